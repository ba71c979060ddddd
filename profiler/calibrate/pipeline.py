"""``shardwise calibrate`` end to end: anchors, plan ranks, fit, within one budget.

The phases share the budget (``--minutes``), in this order:

1. **anchors** (at most :data:`ANCHOR_SHARE` of the budget): every job table alone at
   the job's batch, heaviest first, then the column halves of the heaviest
   and their first row ranges, the smallest fp32 tables as data-parallel copies
   (:mod:`.anchors`); a few all-to-alls on two ranks, each with a reduce-scatter and
   an all-reduce sized like the job's (their fitted lines rescaled to this machine, or
   fitted here for a model without any: :func:`.speed.fit_collectives`). The
   machine's speed factors are fitted to the training tables' whole anchors
   (:mod:`.speed`), so every budget ends with a model carrying them.
2. **ranks**: the ranks of candidate plans for the training tables and, apart, for the
   test tables (:mod:`.plans`), every kernel of each (row ranges, data-parallel
   copies: :mod:`.shards`), round by round, until the fit's share is left; at
   :data:`SECOND_PASS_AT` of the budget they pause for a second pass of the anchors
   (heaviest first, until :data:`SECOND_PASS_END`): a constant factor is fitted as
   well on a few dozen ranks as on hundreds, while each anchor's own noise goes
   straight into the plans' slowest ranks.
3. **fit** (:data:`FIT_SHARE`, at least :data:`FIT_MIN_S`): the compute network
   fine-tuned on the training anchors and ranks (kept only when it beats the base on
   the last training plans, :mod:`.finetune`), then the rank head: anchors and fusion
   factors fitted on the training ranks (:mod:`.rankfit`); then the held-out metrics of
   the base, the base with factors and the result on the test tables' ranks, the
   ablation of the fusion's inputs, and the verdict, overall and per kind
   (:mod:`.heldout`). The model then ships with the fusion fitted again on every
   measured rank, held-out ones included; the verdict stays the training head's.

All samples go to resumable datasets under the work directory (``anchors/``,
``ranks/``, ``comm/``, and the planned ranks in ``ranks.json``): Ctrl-C keeps them, and
the same command resumes, measuring more and fitting on everything there is.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardwise.basics import UserError
from shardwise.planner.comm.learned import COLLECTIVES_KEY, FACTORS_KEY
from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.tables import tables_signatures
from shardwise.profiler.calibrate.anchors import (
    anchor_tasks,
    anchors_of,
    overhead_of,
    plain_anchor,
)
from shardwise.profiler.calibrate.finetune import finetune
from shardwise.profiler.calibrate.heldout import ablation, judge, kind_metrics, verdict
from shardwise.profiler.calibrate.measure import (
    COMM_WORLD,
    Counts,
    comm_cases,
    load_records,
    measure_again,
    measure_comm_missing,
    measure_compute_until,
)
from shardwise.profiler.calibrate.model import calibrated_metadata, with_factors, with_head
from shardwise.profiler.calibrate.plans import (
    RANKS_FILE,
    load_rank_tasks,
    plan_rank_tasks,
    save_rank_tasks,
    side_world,
)
from shardwise.profiler.calibrate.progress import PhaseProgress, Run
from shardwise.profiler.calibrate.rankfit import (
    fit_fusion,
    predict_samples,
    rank_metrics,
    samples_of,
    shipped_fusion,
)
from shardwise.profiler.calibrate.speed import (
    SpeedFit,
    fit_collectives,
    fit_speed,
    reference_check,
)
from shardwise.profiler.calibrate.spreads import head_errors
from shardwise.profiler.calibrate.tasks import (
    Job,
    Task,
    available_memory,
    feasible_batches,
    memory_limit,
    split_tables,
)
from shardwise.profiler.fingerprint import Fingerprint, current_fingerprint

ANCHOR_SHARE = 0.40
#: The ranks pause at this share of the budget for the anchors' second pass, which
#: ends at the next (or when every anchor has two figures).
SECOND_PASS_AT = 0.60
SECOND_PASS_END = 0.80
FIT_SHARE = 0.05
FIT_MIN_S = 8.0
#: Rounds of candidate plans planned per side (more than a 10-minute budget measures
#: on heavy tables; a resumed run measures the ones still missing).
ROUNDS = 40
#: The all-to-all samples need one launch of two workers (about 4–6 s on 2 cores):
#: measured only when the budget has at least this long.
COMM_MIN_BUDGET_S = 50.0
COMM_RESERVE_S = 6.0
#: Below this no budget can measure a sample and fit anything.
MIN_BUDGET_S = 20.0
#: The share of training plans whose ranks early-stop the network's fine-tune.
VAL_PLAN_SHARE = 0.15


@dataclass(frozen=True)
class Budget:
    """The seconds each phase may take, from the whole budget."""

    total_s: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.total_s) or self.total_s < MIN_BUDGET_S:
            raise UserError(
                f"--minutes {self.total_s / 60:g} ({self.total_s:.0f} s) is too short for any "
                f"sample: the anchors alone need a few of the job's kernels. Give --minutes "
                f"{MIN_BUDGET_S / 60:g} or more (10 is the default)."
            )

    @property
    def anchors_s(self) -> float:
        return ANCHOR_SHARE * self.total_s

    @property
    def fit_s(self) -> float:
        return max(FIT_MIN_S, FIT_SHARE * self.total_s)


@dataclass
class CalibrationResult:
    """The calibrated model and what the CLI prints about it."""

    model: CostModel
    calibration: dict[str, Any]
    work_dir: Path
    #: kind -> samples measured by this run.
    measured: dict[str, int]
    #: samples in the datasets now, by kind (this run's and earlier ones').
    totals: dict[str, int]
    phase_seconds: dict[str, float]
    speed: SpeedFit
    notes: list[str] = field(default_factory=list)


def default_work_dir(root: Path, fingerprint: Fingerprint, job: Job) -> Path:
    """``<cache root>/work/<fingerprint key>/<job key>``: the resumable datasets."""
    return root / "work" / fingerprint.key() / job.key()


def calibrate(
    job: Job,
    base: CostModel,
    base_name: str,
    work_dir: Path,
    budget: Budget,
    *,
    from_scratch: bool = False,
    device: str | None = None,
    max_samples: int | None = None,
    anchor_samples: int | None = None,
    rounds: int = ROUNDS,
    tiny: bool = False,
    on_progress: Callable[[PhaseProgress], None] | None = None,
) -> CalibrationResult:
    """Calibrate ``base`` for ``job`` on this machine within ``budget`` (see the module
    docstring). ``max_samples`` caps the plan ranks measured and ``anchor_samples``
    the anchors (tests, and runs that want a fixed dataset); ``tiny`` trains small
    networks from scratch (tests)."""
    start = time.monotonic()
    fingerprint = current_fingerprint(device)
    limit = memory_limit(device)
    now = available_memory(device)
    if now is not None and now < limit:  # the job's batch must fit what is free now
        feasible_batches(job, now)
    feasible_batches(job, limit)
    split = split_tables(job.tables, job.seed, job.global_batch)
    run = Run(start, budget.total_s, on_progress)
    notes: list[str] = []
    measured: dict[str, int] = {}

    # ---------------------------------------------------------------- anchors
    worlds = [side_world(job, len(names)) for names in (split.train, split.test) if names]
    anchors_list = anchor_tasks(job, limit, worlds)
    if anchor_samples is not None:
        anchors_list = anchors_list[:anchor_samples]
    with_comm = base.comm is not None and budget.total_s >= COMM_MIN_BUDGET_S
    anchor_settings = {"job": job.key(), "purpose": "anchors", "batch_size": job.global_batch}
    counts = _measure(
        work_dir / "anchors",
        fingerprint,
        anchor_settings,
        anchors_list,
        start + budget.anchors_s - (COMM_RESERVE_S if with_comm else 0.0),
        job.seed,
        device,
        run.sampled("anchors"),
    )
    _merge(measured, counts)
    anchor_records = load_records(work_dir / "anchors")
    if not anchor_records:
        raise UserError(
            f"--minutes {budget.total_s / 60:g} was too short for any of the job's kernels "
            f"({budget.anchors_s:.0f} s for the anchors; the job's tables at batch "
            f"{job.global_batch} take longer here). Give a larger --minutes."
        )
    comm_records: list[dict[str, Any]] = []
    if with_comm:
        run.say("anchors", "timing all-to-alls on 2 ranks")
        got = measure_comm_missing(
            work_dir / "comm",
            fingerprint,
            {"job": job.key(), "purpose": "speed", "world_size": COMM_WORLD, "collectives": 1},
            comm_cases(job),
            job.batch_per_rank,
        )
        _merge(measured, got)
        comm_records = load_records(work_dir / "comm")
    elif base.comm is not None:
        notes.append(
            f"a budget under {COMM_MIN_BUDGET_S:.0f} s times no all-to-all, so the comm "
            "factor is the base model's"
        )
    train_names = set(split.train) or {t.name for t in job.tables}
    plain = [r for r in anchor_records if plain_anchor(r)]
    train_anchors = [r for r in plain if r["extra"].get("table") in train_names]
    speed = fit_speed(base, train_anchors or plain, comm_records)
    speeded = with_factors(base, speed)
    anchors = anchors_of(anchor_records, job.tables)
    local_anchors = anchors_of(anchor_records, job.tables, local=True)
    overhead = overhead_of(anchor_records)
    phase_seconds = {"anchors": run.elapsed()}

    # ---------------------------------------------------------------- ranks
    provisional = with_head(
        speeded,
        head_errors(speeded, anchors, job, None, overhead=overhead, local_anchors=local_anchors),
    )
    tasks = _rank_tasks(work_dir, job, split, rounds, CostPredictor(provisional), run)
    if max_samples is not None:
        tasks = tasks[:max_samples]
    rank_settings = {"job": job.key(), "purpose": "ranks", "batch_size": job.global_batch}
    counts = _measure(
        work_dir / "ranks",
        fingerprint,
        rank_settings,
        tasks,
        start + SECOND_PASS_AT * budget.total_s,
        job.seed,
        device,
        run.sampled("ranks"),
    )
    _merge(measured, counts)
    # Every anchor again, heaviest first, minutes after the first: a table's figure is
    # then the median of two windows of this host's drifting speed (the model's error
    # on a plan's slowest rank is mostly its heaviest tables' anchors).
    again = [replace(t, extra={**t.extra, "pass": 2}) for t in anchors_list]
    counts = _measure(
        work_dir / "anchors",
        fingerprint,
        anchor_settings,
        [*anchors_list, *again],
        start + SECOND_PASS_END * budget.total_s,
        job.seed,
        device,
        run.sampled("anchors"),
    )
    _merge(measured, counts, "anchor (again)")
    anchor_records = load_records(work_dir / "anchors")
    anchors = anchors_of(anchor_records, job.tables)
    local_anchors = anchors_of(anchor_records, job.tables, local=True)
    overhead = overhead_of(anchor_records)
    counts = _measure(
        work_dir / "ranks",
        fingerprint,
        rank_settings,
        tasks,
        start + budget.total_s - budget.fit_s,
        job.seed,
        device,
        run.sampled("ranks"),
    )
    _merge(measured, counts)
    rank_records = load_records(work_dir / "ranks")
    # Every planned rank measured early: the time left measures the noisiest again
    # (not when the caller capped the samples).
    stopped = f"the sample cap ({max_samples})"
    if max_samples is None:
        more = measure_again(
            work_dir / "ranks",
            fingerprint,
            rank_settings,
            tasks,
            rank_records,
            start + budget.total_s - budget.fit_s,
            seed=job.seed,
            device=device,
            on_sample=run.sampled("ranks"),
        )
        _merge(measured, more.counts, "rank (again)")
        stopped, rank_records = more.stopped, more.records
    train = [r for r in rank_records if r["extra"].get("kind") == "rank"]
    test = [r for r in rank_records if r["extra"].get("kind") == "heldout"]
    phase_seconds["ranks"] = run.elapsed() - phase_seconds["anchors"]

    # ---------------------------------------------------------------- fit
    # The anchors timed twice judge the reference kernel's correction; where it
    # widened their spread, the factors are fitted again on the timings as measured.
    check = reference_check(anchor_records)
    if check is not None:
        notes.append(check.note())
    drifted = check is None or check.helps
    if not drifted:
        speed = fit_speed(base, train_anchors or plain, comm_records, drift=False)
        speeded = with_factors(base, speed)
    run.say("fit", "fine-tuning the network")
    fit_train, fit_val = _by_plan(train, VAL_PLAN_SHARE)
    tuned = finetune(
        speeded,
        speed.factors,
        [*(r for r in anchor_records if r["extra"].get("table") in train_names), *fit_train],
        fit_val,
        seed=job.seed,
        # Half the fit's share, from now: a run that measured fast does not hand the
        # fine-tune the rest of its budget (its epochs would then depend on the clock).
        deadline=min(start + budget.total_s, time.monotonic() + budget.fit_s) - budget.fit_s / 2,
        from_scratch=from_scratch or tiny,
        hidden=16 if tiny else 64,
        on_epoch=run.epoch,
        drift=drifted,
    )
    notes.extend(tuned.notes)
    network = copy.copy(speeded)
    network.compute = tuned.net
    run.say("fit", "fitting the rank head")
    errors = head_errors(network, anchors, job, None, local_anchors=local_anchors)
    channels = CostPredictor(with_head(network, errors))
    samples_train = samples_of(train, job, channels.encodings)
    samples_test = samples_of(test, job, channels.encodings)
    fusion = fit_fusion(samples_train, overhead=overhead) if samples_train else None
    if fusion is None:
        notes.append("no plan rank was measured: the rank head sums the anchors as they are")
    test_pred = predict_samples(fusion, samples_test, overhead).sum(axis=1) if samples_test else []
    test_meas = [sum(s.measured) for s in samples_test]
    test_plans = [s.plan for s in samples_test]
    final_metrics = rank_metrics(test_pred, test_meas, test_plans)
    final_metrics["kinds"] = kind_metrics(
        test_pred,
        test_meas,
        test_plans,
        [s.kinds for s in samples_test],
        [s.kinds for s in samples_train],
    )
    sigma = final_metrics.get("sigma") if final_metrics.get("ranks", 0) >= 4 else None
    if sigma is None and fusion is not None and len(fusion.cv_sigma) == 2:
        sigma = math.sqrt(sum(v**2 for v in fusion.cv_sigma.values()) / 2) or None
    # The verdict and σ are the training ranks' head's; the model ships one fitted on all.
    shipped = fusion
    if fusion is not None and samples_test:
        shipped = shipped_fusion(samples_train, samples_test, overhead)
        notes.append(
            f"rank head fitted again on all {len(samples_train) + len(samples_test)} "
            f"measured ranks after the held-out verdict ({len(samples_train)} training, "
            f"{len(samples_test)} held-out): the verdict is the training ranks' head's"
        )
    head = head_errors(network, anchors, job, sigma, shipped, overhead, local_anchors)
    final = with_head(network, head)
    metrics = {
        "final": final_metrics,
        "base": judge(base, test, job),
        "speed_only": judge(speeded, test, job),
        "test_tables": len(split.test),
        "train_tables": len(split.train),
    }
    inputs = ablation(samples_train, samples_test, fusion, overhead)
    ranks_measured = sum(
        n for kind, n in measured.items() if kind in ("rank", "heldout", "rank (again)")
    )
    per_rank_s = phase_seconds["ranks"] / ranks_measured if ranks_measured else None
    planned = sum(t.kind == "heldout" for t in tasks)
    judged = verdict(
        final_metrics,
        seconds_per_rank=per_rank_s,
        heldout_share=len(split.test) / max(len(job.tables), 1),
        budget_s=budget.total_s,
        exhausted=len(test) >= planned,
        test_tables=len(split.test),
        every_rank_measured=stopped != "budget",
        kinds=final_metrics["kinds"],
    )
    phase_seconds["fit"] = run.elapsed() - phase_seconds["anchors"] - phase_seconds["ranks"]
    again_n = sum(r["extra"].get("pass") == 2 for r in anchor_records)
    totals = {
        "anchor": len(anchor_records) - again_n,
        "anchor (again)": again_n,
        "rank": len(train),
        "heldout": len(test),
        "comm": len(comm_records),
    }
    collectives = fit_collectives(base, comm_records, fingerprint.cores)
    notes.extend(collectives.notes)
    calibration: dict[str, Any] = {
        "fingerprint_key": fingerprint.key(),
        "tables": tables_signatures(job.tables),
        "batch_sizes": [job.global_batch],
        "base": base_name,
        "speed_factors": speed.factors.to_dict(),
        **({FACTORS_KEY: collectives.factors} if collectives.factors else {}),
        "phases": ["anchors", "ranks", *(["finetune"] if tuned.kept else []), "rank_head"],
        "samples": {"compute": len(anchor_records) + len(rank_records), "comm": len(comm_records)},
        "seconds": round(run.elapsed(), 1),
        "budget_s": round(budget.total_s, 1),
        "stopped": stopped,
        "metrics": metrics,
        "verdict": judged,
        "ablation": inputs,
        "fusion": fusion.to_json() if fusion else None,
        "rank_head": head.to_json(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "job": {
            "gpus": job.gpus,
            "batch_per_rank": job.batch_per_rank,
            "seed": job.seed,
            "gpu_memory": job.gpu_memory,
        },
        "speed": speed.to_json(),
        "reference_check": asdict(check) if check else None,
        "finetune": tuned.to_json(),
        "samples_by_kind": totals,
        "notes": list(notes),
    }
    final.metadata = calibrated_metadata(base, fingerprint, calibration, tuned, job)
    if collectives.fitted:
        final.metadata[COLLECTIVES_KEY] = collectives.fitted
    final.source = "the calibrated cost model"
    return CalibrationResult(
        final, final.metadata["calibration"], work_dir, measured, totals, phase_seconds,
        speed, notes,
    )  # fmt: skip


# --------------------------------------------------------------------------- helpers


def _measure(
    directory: Path,
    fingerprint: Fingerprint,
    settings: Mapping[str, Any],
    tasks: Sequence[Task],
    deadline: float,
    seed: int,
    device: str | None,
    on_sample: Callable[[Task], None],
) -> Counts:
    if not tasks:
        return Counts()
    return measure_compute_until(
        directory,
        fingerprint,
        settings,
        lambda i: tasks[i],
        deadline,
        seed=seed,
        max_samples=len(tasks),
        device=device,
        on_sample=on_sample,
    )


def _rank_tasks(
    work_dir: Path, job: Job, split: Any, rounds: int, predictor: CostPredictor, run: Run
) -> list[Task]:
    """The planned ranks an earlier run of this calibration wrote, else planned now."""
    path = work_dir / RANKS_FILE
    tasks = load_rank_tasks(path, job)
    if tasks is None:
        tasks = plan_rank_tasks(job, split, rounds, predictor, lambda t: run.say("ranks", t))
        work_dir.mkdir(parents=True, exist_ok=True)
        save_rank_tasks(path, job, tasks)
    return tasks


def _by_plan(
    records: Sequence[dict[str, Any]], share: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, validation) records: the last ``share`` of the plans validate."""
    plans = list(dict.fromkeys(str(r["extra"].get("plan")) for r in records))
    n_val = round(share * len(plans)) if len(plans) >= 4 else 0
    val = set(plans[len(plans) - n_val :]) if n_val else set()
    return (
        [r for r in records if str(r["extra"].get("plan")) not in val],
        [r for r in records if str(r["extra"].get("plan")) in val],
    )


def _merge(into: dict[str, int], counts: Counts, name: str | None = None) -> None:
    for (kind, _batch), n in counts.by_kind.items():
        into[name or kind] = into.get(name or kind, 0) + n
