"""Plans whose tables are not all table-wise, as the operator makes and shows them: the
worker pods as the plan's hosts (and in its inputs' hash), the tables per sharding kind
in the plan's summary, status (valid against the CRD), the Planned message and the
metrics, a refined plan put on the job's hosts, and the live re-plan that moves only
what it can (:mod:`shardwise.operator.models.plan_kinds`)."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.schema import StructuralSchema
from operator_builders import A100, CFG, JOB, kinds_plan, plan_record, spec
from prometheus_client import generate_latest
from test_observability_operator import sample
from test_operator_planning import inputs

from shardwise.operator.decide.planning import plan_fields, plan_message
from shardwise.operator.loop.planmaker import on_hosts
from shardwise.operator.loop.planner_pool import (
    LivePlanRequest,
    PlanResult,
    compute_live_plan,
    plan_summary,
)
from shardwise.operator.metrics import OperatorMetrics
from shardwise.operator.models.plan_kinds import MAX_NAMES, describe_kinds, status_kinds
from shardwise.operator.render import children as render
from shardwise.planner.plan import Plan, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "dlrmjob.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "dlrmjob.yaml").read_text())
TOPO = Topology(gpus=4, gpu_memory_bytes=2**30, batch_size_per_rank=64, gpus_per_host=2)


def specs(n: int, rows: int = 1000) -> list[TableSpec]:
    return [TableSpec(name=f"t{i}", rows=rows, dim=16, pooling_factor=2.0) for i in range(n)]


def summary_of(plan: Any) -> dict[str, Any]:
    return plan_summary(plan, inputs(), PlanResult(None, None, "fp", 0.1), {"gpuType": A100})


# --------------------------------------------------------------------------- hosts
def test_each_worker_pod_is_a_host_of_the_plan_and_its_hash_says_so() -> None:
    two = inputs(workers=2, gpus_per_worker=4)
    topo = two.topology()
    assert (topo.gpus, topo.gpus_per_host, topo.hosts, topo.local_world) == (8, 4, 2, 4)
    cpu = inputs(workers=3, gpus_per_worker=2, device="cpu").topology()
    assert (cpu.device, cpu.gpus_per_host, cpu.hosts) == ("cpu", 2, 3), "ranks per CPU pod"
    # one pod is one host: written as no gpus_per_host, so its plans keep their hashes
    one = inputs(workers=1, gpus_per_worker=4)
    assert one.topology().gpus_per_host is None and one.topology().local_world == 4

    def hash_before_hosts(i: Any) -> str:
        body = json.dumps(asdict(i), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    assert one.hash() == hash_before_hosts(one)
    # several pods: a plan made when one host was assumed is not the plan for them
    assert two.hash() != hash_before_hosts(two)
    assert two.hash() != inputs(workers=4, gpus_per_worker=2).hash(), "same 8 GPUs, 4 hosts"


def test_torchruns_local_world_is_the_plans_gpus_per_host() -> None:
    """TorchRec finds a rank's host from LOCAL_WORLD_SIZE, which torchrun sets to
    --nproc_per_node: the worker pod's and the plan's must agree."""
    s = spec(gpusPerWorker=4)
    body = render.worker_job(JOB, s, "dj-plan-x", "h" * 64, 2, A100, CFG)
    container = body["spec"]["template"]["spec"]["containers"][0]
    nproc = next(a for a in container["args"] if a.startswith("--nproc_per_node="))
    env = {e["name"]: e.get("value") for e in container["env"]}
    topo = inputs(workers=2, gpus_per_worker=s.gpus_per_worker).topology()
    assert nproc == f"--nproc_per_node={topo.gpus_per_host}" == "--nproc_per_node=4"
    assert env["SHARDWISE_NPROC_PER_NODE"] == str(topo.gpus_per_host)
    assert body["spec"]["parallelism"] == topo.hosts


def test_a_refined_plan_for_one_host_runs_on_the_jobs_hosts() -> None:
    """The profiling pod refines for a world size; the operator puts its plan on the
    worker pods' hosts (rehashed), unless a host-bound table does not fit a host."""
    tables = specs(4)
    one_host = TOPO.model_copy(update={"gpus_per_host": None})
    plan = table_wise_plan(tables, [0, 1, 2, 3], one_host, "neuroshard")
    moved = on_hosts(plan, TOPO)
    assert moved.topology == TOPO and moved.tables == plan.tables
    assert moved.hash == moved.content_hash() != plan.hash and moved.problems(tables) == []
    assert on_hosts(moved, TOPO) == moved, "already on the hosts"
    other = Topology(gpus=4, gpu_memory_bytes=2**31, batch_size_per_rank=64)
    assert on_hosts(table_wise_plan(tables, [0, 1, 2, 3], other, "x"), TOPO).topology == other
    # table-row-wise over all 4 ranks of one host: on hosts of 2 it spans two hosts
    wide = kinds_plan(tables, ["table_row_wise", *["table_wise"] * 3], one_host.model_copy(
        update={"gpus_per_host": 4}))  # fmt: skip
    wide = wide.model_copy(update={"topology": one_host}).with_hash()
    assert wide.problems(tables) == []
    bad = on_hosts(wide, TOPO).problems(tables)
    assert bad and "t0" in bad[0], bad


# --------------------------------------------------------------------------- kinds
def test_the_summary_counts_kinds_and_names_the_cut_tables() -> None:
    tables = specs(16)
    kinds = ["row_wise", "table_row_wise", *["data_parallel"] * 12, "table_wise", "table_wise"]
    plan = kinds_plan(tables, kinds, TOPO)
    assert plan.problems(tables) == []
    s = summary_of(plan)
    assert s["kinds"] == {"table_wise": 2, "row_wise": 1, "table_row_wise": 1, "data_parallel": 12}
    by = s["tablesByKind"]
    assert by["row_wise"] == {"tables": ["t0"], "more": 0}
    assert by["table_row_wise"] == {"tables": ["t1"], "more": 0}
    assert by["data_parallel"]["tables"] == [f"t{i}" for i in range(2, 2 + MAX_NAMES)]
    assert by["data_parallel"]["more"] == 12 - MAX_NAMES
    assert "grid" not in by and "table_wise" not in by
    assert json.loads(json.dumps(s)) == s, "the annotation is JSON"
    # every table table-wise: nothing about kinds anywhere
    plain = summary_of(table_wise_plan(tables, [i % 4 for i in range(16)], TOPO, "x"))
    assert "kinds" not in plain and "tablesByKind" not in plain
    assert describe_kinds(plain) == ""


def test_status_and_the_planned_message_show_the_kinds() -> None:
    tables = specs(5, rows=4000)
    plan = kinds_plan(tables, ["row_wise", "data_parallel", *["table_wise"] * 3], TOPO)
    record = plan_record("dj-plan-abc", "ih")
    record = type(record)(record.ref, "ih", {**summary_of(plan), "worldSize": 4})
    fields = plan_fields(record)
    assert fields["kinds"] == {"table_wise": 3, "row_wise": 1, "data_parallel": 1}
    assert fields["tablesByKind"] == {
        "row_wise": {"tables": ["t0"], "more": 0},
        "data_parallel": {"tables": ["t1"], "more": 0},
    }
    msg = plan_message(record)
    assert msg.startswith(
        "plan dj-plan-abc: 5 tables on 4 GPUs by test "
        "(1 row-wise (t0), 1 data-parallel (t1), 3 table-wise)"
    ), msg
    many = {"kinds": {"data_parallel": 12}, "tablesByKind": summary_of(
        kinds_plan(specs(12), ["data_parallel"] * 12, TOPO))["tablesByKind"]}  # fmt: skip
    assert (
        describe_kinds(many)
        == "12 data-parallel (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9 and 2 more)"
    )

    # status as the API server takes it: every field kept, valid against the CRD
    schema = StructuralSchema(SCHEMA)
    body = {**copy.deepcopy(EXAMPLE), "status": {"plan": fields}}
    admitted, dropped = schema.admit(body)
    assert dropped == [] and admitted["status"]["plan"]["kinds"] == fields["kinds"]
    assert schema.validate_status(admitted) == []
    over = copy.deepcopy(admitted)
    over["status"]["plan"]["tablesByKind"]["row_wise"]["tables"] = [f"x{i}" for i in range(11)]
    refused = schema.validate_status(over)
    assert str(refused[0]) == (
        "status.plan.tablesByKind.row_wise.tables: Too many: 11: must have at most 10 items"
    )


def test_an_edited_annotation_cannot_write_a_status_the_crd_refuses() -> None:
    junk = {
        "kinds": {"row_wise": 2, "sideways": 1, "grid": -1, "data_parallel": True},
        "tablesByKind": {
            "row_wise": {"tables": [f"r{i}" for i in range(30)], "more": "many"},
            "grid": "g",
            "sideways": {"tables": ["s"]},
        },
    }
    assert status_kinds(junk) == {
        "kinds": {"row_wise": 2},
        "tablesByKind": {"row_wise": {"tables": [f"r{i}" for i in range(MAX_NAMES)], "more": 0}},
    }
    assert status_kinds({"kinds": "row_wise", "tablesByKind": []}) == {}


def test_the_tables_per_kind_metric_follows_the_status() -> None:
    metrics = OperatorMetrics()
    plan = {"tables": 5, "kinds": {"table_wise": 3, "row_wise": 1, "data_parallel": 1}}
    metrics.observe_status("ml", "dj", {"phase": "Running", "plan": plan})
    out = generate_latest(metrics.registry).decode()
    job = {"namespace": "ml", "job": "dj"}
    got = {
        k: sample(out, "shardwise_plan_tables", **job, kind=k)
        for k in (
            "table_wise",
            "column_wise",
            "row_wise",
            "table_row_wise",
            "grid",
            "data_parallel",
        )
    }
    assert got == {"table_wise": 3, "column_wise": 0, "row_wise": 1, "table_row_wise": 0,
                   "grid": 0, "data_parallel": 1}  # fmt: skip
    metrics.observe_status("ml", "dj", {"phase": "Running", "plan": {"tables": 7}})
    out = generate_latest(metrics.registry).decode()
    assert sample(out, "shardwise_plan_tables", **job, kind="table_wise") == 7
    assert sample(out, "shardwise_plan_tables", **job, kind="row_wise") == 0
    metrics.forget_job("ml", "dj")
    assert "shardwise_plan_tables{" not in generate_latest(metrics.registry).decode()


def test_the_live_replan_moves_table_wise_shards_and_keeps_the_rest() -> None:
    """The planner process's live re-plan of a plan with a row-wise table: the row-wise
    table stays where it is, its kind kept, and table-wise shards move off the
    straggler (the re-planner's own rules are pinned in tests/test_planner_live.py)."""
    from test_planner_live import summary as live_summary

    tables = specs(5)
    plan = kinds_plan(
        tables, ["row_wise", "table_wise", "table_wise", "table_wise", "table_wise"], TOPO
    )
    lopsided = plan.model_copy(
        update={
            "tables": [
                t
                if t.kind == "row_wise"
                else t.model_copy(update={"shards": [t.shards[0].model_copy(update={"rank": 0})]})
                for t in plan.tables
            ]
        }
    ).with_hash()
    live = live_summary(lopsided, {"t0": 1.0, **{f"t{i}": 2.0 for i in range(1, 5)}})
    request = LivePlanRequest(
        lopsided.model_dump_json(),
        json.dumps([t.model_dump(mode="json") for t in tables]),
        TOPO.model_dump_json(),
        live.model_dump_json(),
    )
    out = compute_live_plan(request)
    assert out.error is None and out.plan_json is not None, out.error
    new = Plan.model_validate_json(out.plan_json)
    assert [t.kind for t in new.tables] == [t.kind for t in lopsided.tables]
    assert new.tables[0].shards == lopsided.tables[0].shards
    assert {t.shards[0].rank for t in new.tables[1:]} != {0}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_plan_inputs_topology_round_trips_through_the_planner_request(workers: int) -> None:
    from shardwise.operator.loop.planner_pool import make_request

    i = inputs(workers=workers)
    request = make_request(i, specs(2), None)
    assert Topology.model_validate_json(request.topology_json) == i.topology()


def test_without_a_calibrated_model_the_live_replan_prices_row_ranges_with_the_bundled_one() -> (
    None
):
    """A job with no calibrated model: the planner process hands the re-plan the bundled
    model, so a hot table's cut is priced (and here declined at its worst plausible
    price, with its figures) instead of never considered."""
    from test_planner_live import summary as live_summary
    from test_planner_live_kinds import TOPO as LIVE_TOPO
    from test_planner_live_kinds import hot_case

    tables, plan, ms = hot_case()
    request = LivePlanRequest(
        plan.model_dump_json(),
        json.dumps([t.model_dump(mode="json") for t in tables]),
        LIVE_TOPO.model_dump_json(),
        live_summary(plan, ms).model_dump_json(),
    )
    out = compute_live_plan(request)
    assert out.error is None
    said = out.live["describe"]
    assert "h: table-wise → row-wise over 2 ranks" in said, said
    assert "of the whole by the cost model" in said, said
