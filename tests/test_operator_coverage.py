"""The coverage rule of profiling (:func:`shardwise.operator.decide.profiling.coverage` and
how :func:`~shardwise.operator.decide.profiling.decide` uses it): ``IfStale`` calibrates again
when the published model was not calibrated on the job's tables, once per table set."""

from __future__ import annotations

import dataclasses
from typing import Any

from k8s.helpers import dlrmjob
from operator_builders import A100, CFG, NOW, attempt, model, observed

from shardwise import names
from shardwise.operator.cluster.summaries import JobState
from shardwise.operator.crd import DLRMJobSpec, ProfilingSpec, parse_spec
from shardwise.operator.decide import profiling, reconcile
from shardwise.operator.models.cost_models import Calibration, CostModelInfo
from shardwise.operator.models.jobtables import TABLES_NOT_FOUND, JobTables
from shardwise.planner.tables import TableSpec, parse_tables, table_signature

TABLES = [
    TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=16, pooling_factor=2.0) for i in range(4)
]
SIGS = [table_signature(t) for t in TABLES]
IF_STALE = ProfilingSpec.model_validate({"policy": "IfStale", "maxAge": "24h"})


def calibrated(hours_old: float, signatures: list[str]) -> CostModelInfo:
    return dataclasses.replace(model(hours_old), calibration=Calibration(frozenset(signatures)))


def tagged(job: JobState, signatures: list[str]) -> JobState:
    """An attempt Job that calibrated on ``signatures`` (its tables-hash annotation)."""
    ann = {names.ANN_TABLES_HASH: profiling.tables_hash(signatures)}
    return dataclasses.replace(job, ref=dataclasses.replace(job.ref, annotations=ann))


def test_coverage_counts_the_jobs_tables_by_signature() -> None:
    assert profiling.coverage(calibrated(1, SIGS), SIGS) == profiling.Coverage(4, 4)
    part = profiling.coverage(calibrated(1, SIGS[:3]), SIGS)
    assert (part.covered, part.of, part.complete) == (3, 4, False)
    assert part.describe() == "calibrated on 3 of this job's 4 tables"
    assert profiling.coverage(model(1), SIGS) == profiling.Coverage(0, 4), "not calibrated"
    assert profiling.coverage(None, SIGS).covered == 0
    assert profiling.coverage(calibrated(1, []), []).complete
    renamed = TABLES[0].model_copy(update={"name": "other"})
    assert table_signature(renamed) == SIGS[0], "the name is not part of the signature"
    wider = TABLES[0].model_copy(update={"dim": 32})
    assert not profiling.coverage(calibrated(1, SIGS), [table_signature(wider)]).complete


def test_tables_hash_is_the_set_of_signatures() -> None:
    assert profiling.tables_hash(SIGS) == profiling.tables_hash(list(reversed(SIGS)) + SIGS[:1])
    assert profiling.tables_hash(SIGS) != profiling.tables_hash(SIGS[:3])


def decide(m: CostModelInfo | None, jobs: list[JobState], sigs: list[str] | None = SIGS) -> Any:
    return profiling.decide(A100, IF_STALE, m, jobs, NOW, tables=sigs)


def test_a_fresh_model_that_covers_the_tables_is_used() -> None:
    d = decide(calibrated(1, [*SIGS, "other"]), [])
    assert d.state is profiling.State.FRESH and d.create is None
    assert "calibrated on 4 of this job's 4 tables" in d.message


def test_a_fresh_model_that_does_not_cover_them_is_calibrated_again() -> None:
    d = decide(calibrated(1, SIGS[:2]), [])
    assert d.state is profiling.State.RUNNING and d.create == 1
    assert d.message == (
        f"profiling {A100} (the published model is calibrated on 2 of this job's 4 tables)"
    )
    assert decide(model(1), []).create == 1, "a model without calibration covers nothing"
    # unknown tables: coverage is not judged (freshness alone, as before)
    assert decide(calibrated(1, []), [], None).state is profiling.State.FRESH


def test_once_per_table_set_so_jobs_never_take_turns() -> None:
    ours = tagged(attempt(1, "ok", minutes_ago=5), SIGS)
    # another job with other tables published since: used, not re-profiled
    later = calibrated(0.01, ["someone-elses"])
    d = decide(later, [ours])
    assert d.state is profiling.State.SUCCEEDED and d.model == later and d.create is None
    # the spec's tables changed since our attempt: calibrate on the new ones
    changed = decide(later, [tagged(attempt(1, "ok", minutes_ago=5), SIGS[:3])])
    assert changed.create == 2 and changed.state is profiling.State.RUNNING
    # an attempt from before coverage existed (no tables hash) calibrated no job tables
    assert decide(later, [attempt(1, "ok", minutes_ago=5)]).create == 2
    # a success whose own model covers the tables: fresh, whatever the attempts
    assert decide(calibrated(0.01, SIGS), [ours]).state is profiling.State.FRESH


def test_policies_other_than_if_stale() -> None:
    never = ProfilingSpec.model_validate({"policy": "Never"})
    d = profiling.decide(A100, never, calibrated(1, []), [], NOW, tables=SIGS)
    assert d.state is profiling.State.SKIPPED and d.model is not None
    always = ProfilingSpec.model_validate({"policy": "Always"})
    covered = calibrated(1, SIGS)
    assert profiling.decide(A100, always, covered, [], NOW, tables=SIGS).create == 1
    done = tagged(attempt(1, "ok", minutes_ago=5), SIGS)
    d = profiling.decide(A100, always, calibrated(0.01, SIGS), [done], NOW, tables=SIGS)
    assert d.state is profiling.State.SUCCEEDED


def referenced() -> DLRMJobSpec:
    """An ``IfStale`` job whose tables are in the ConfigMap ``dlrm-tables``."""
    raw = dlrmjob("dj", "ml", 4, gpu_memory="2Gi", policy="IfStale")["spec"]
    raw["tables"] = {"configMapRef": {"name": "dlrm-tables"}}
    return parse_spec(raw)


def test_referenced_tables_that_cannot_be_read_profile_nothing() -> None:
    s = referenced()
    missing = JobTables.unreadable(
        TABLES_NOT_FOUND, "spec.tables.configMapRef: ConfigMap ml/dlrm-tables does not exist"
    )
    d = reconcile.decide(observed(spec=s, tables=missing))
    assert d.creates == [] and d.plan is None
    planned = next(c for c in d.conditions if c.type == "Planned")
    assert (planned.status, planned.reason) == (False, "TablesNotFound")
    assert "ConfigMap ml/dlrm-tables does not exist" in planned.message
    assert d.requeue_after == CFG.tables_retry_seconds


def test_referenced_tables_are_copied_for_the_profiling_pod() -> None:
    s = referenced()
    d = reconcile.decide(observed(spec=s, tables=JobTables.of(TABLES)))
    tables_cm, job = d.creates
    assert tables_cm["kind"] == "ConfigMap" and job["kind"] == "Job"
    assert parse_tables(tables_cm["data"]["tables.yaml"], "yaml") == TABLES
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "tables")
    assert volume["configMap"]["name"] == tables_cm["metadata"]["name"]
    assert job["metadata"]["annotations"][names.ANN_TABLES_HASH] == profiling.tables_hash(SIGS)
    # the published model covers them: fresh, nothing to create, coverage in the status
    covered = reconcile.decide(
        observed(spec=s, tables=JobTables.of(TABLES), models={A100: calibrated(1, SIGS)})
    )
    assert covered.creates == [] and covered.plan is not None
    cal = covered.fields["costModel"]["calibration"]
    assert (cal["tablesCovered"], cal["tablesTotal"]) == (4, 4)
