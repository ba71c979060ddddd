"""The benchmark protocol of docs/design.md §9 (``shardwise bench``), run or resumed.

1. **Pools and models.** Each pool of held-out tables is drawn (or read back), and
   the ``calibrated`` model is calibrated on each pool once
   (:mod:`~shardwise.profiler.bench.models`).
2. **Tasks** (:mod:`~shardwise.profiler.bench.tasks`): T tables of one pool for W
   GPUs, memory tight or slack, at the job's batch (``global_batch / W`` per rank, or
   the spec's ``batch_per_rank``: the topology's, which every planner prices and the
   evaluator measures at).
3. **Rows.** Every planner plans each task (timed): the heuristics, TorchRec at full
   strength (every sharding kind: the anchor) and restricted to table-wise/column-wise,
   each also with measured costs, and NeuroShard once per model
   (``neuroshard[bundled]``, ``neuroshard[calibrated]``; with ``-tw-cw``, the same
   search restricted to table-wise/column-wise), each with a fresh predictor
   pricing comm with the task's declared comm. Refined rows
   (``neuroshard[calibrated+refined]``, ``torchrec+refined``) start from their row's
   plan and run measured refinement (:func:`shardwise.profiler.refine.measured.refine_measured`)
   within the spec's budget, timed apart.
4. **Measurement.** Every plan of the task is measured side by side by the evaluator
   (:mod:`~shardwise.profiler.bench.measure`): compute measured, comm from the
   declared model (or measured where that is honest), compute-only kept apart.
5. **Model quality** (:mod:`~shardwise.profiler.bench.quality`): per model the task
   plans with, Spearman's rho and MAPE of its predicted per-rank compute against the
   measured, over the ranks of every plan measured.
6. Each finished task is one line of ``results.jsonl``
   (:mod:`~shardwise.profiler.bench.results`): a rerun resumes after it (a folder of
   the previous schema gets its model quality filled in from its saved plans);
   :mod:`~shardwise.profiler.bench.report` turns the lines into the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions, run_planner
from shardwise.planner.baselines.torchrec_measured import TorchRecMeasuredPlanner
from shardwise.planner.plan import InvalidPlanError, Plan, save_plan
from shardwise.planner.registry import MEASURED_PLANNERS, get_planner
from shardwise.profiler.bench.measure import SingleShardCosts, measure_plans
from shardwise.profiler.bench.models import (
    MODELS_DIR,
    BenchModel,
    bundled_model,
    calibrated_model,
    file_identity,
)
from shardwise.profiler.bench.quality import saved_plans, task_quality_and_ranks
from shardwise.profiler.bench.report import BenchSummary, summarize, write_outputs
from shardwise.profiler.bench.results import PlannerResult, ResultsFolder, TaskResult
from shardwise.profiler.bench.rows import Row
from shardwise.profiler.bench.rows import resolve_rows as resolve_rows  # the CLI's, re-exported
from shardwise.profiler.bench.spec import BenchSpec, spec_json
from shardwise.profiler.bench.tasks import Task, draw_tasks, load_pools

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

PLANS_DIR = "plans"
Step = Callable[[str], None]


# --------------------------------------------------------------------------- running


@dataclass
class BenchRun:
    """What :func:`run_bench` did: every task's result (earlier runs' included)."""

    directory: Path
    results: list[TaskResult]
    summary: BenchSummary
    outputs: list[Path]  # results.jsonl, summary.csv, summary.json, chart.png
    skipped: int  # finished in an earlier run
    ran: int
    models: dict[str, BenchModel]  # "bundled", "calibrated:<pool or task>"


@dataclass
class _Context:
    spec: BenchSpec
    rows: list[Row]
    out_dir: Path
    comm: str
    device: str | None
    models: dict[str, BenchModel]
    costs: SingleShardCosts
    step: Step


def run_bench(
    spec: BenchSpec,
    rows: Sequence[Row],
    out_dir: Path,
    *,
    spec_base: Path | None = None,
    comm: str = "auto",
    device: str | None = None,
    on_step: Step | None = None,
    on_task: Callable[[TaskResult, bool], None] | None = None,
) -> BenchRun:
    """Run (or resume) the benchmark into ``out_dir`` and write its summary files
    there; see the module docstring. ``on_task(result, fresh)`` is called per task in
    order, ``fresh`` False for a task an earlier run finished (and skipped)."""
    from shardwise.planner.comm.choice import resolve_comm
    from shardwise.profiler.fingerprint import current_fingerprint

    rows = list(rows)
    for name in {r.planner for r in rows}:
        get_planner(name)  # unknown names fail before any work
    step = on_step or (lambda _: None)
    bundled = bundled_model()
    from shardwise.planner.costmodel.predictor import CostPredictor

    priced = CostPredictor(bundled.model)
    for world in sorted({s.gpus for s in spec.shapes}):  # a bad --comm fails now
        for measuring in (True, False):  # the evaluator's, and the planners'
            resolve_comm(comm, world=world, device=device, predictor=priced, measuring=measuring)
    folder = ResultsFolder(
        out_dir,
        {
            "spec": spec_json(spec),
            "rows": [r.name for r in rows],
            "comm": comm,
            "fingerprint": current_fingerprint(device).to_dict(),
            "model": bundled.identity,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    )
    pools = load_pools(spec, out_dir, spec_base, step)
    tasks = draw_tasks(spec, pools)
    models = {"bundled": bundled}
    pending = [t for t in tasks if t.id not in folder.done]
    if any(r.model == "calibrated" for r in rows) and spec.calibrate_on == "pool":
        for key in dict.fromkeys(t.pool for t in pending):
            models[f"calibrated:{key}"] = calibrated_model(
                spec, key, pools[key], bundled, out_dir, device=device, on_step=step
            )
    elif any(r.model == "calibrated" for r in rows):
        for t in pending:
            models[f"calibrated:{t.id}"] = calibrated_model(
                spec,
                t.id,
                t.tables,
                bundled,
                out_dir,
                device=device,
                on_step=step,
                gpus=t.topology.gpus,
                gpu_memory=t.topology.gpu_memory_bytes,
            )
    if folder.upgrading_from is not None:
        _upgrade(spec, folder, tasks, models, any(r.model == "calibrated" for r in rows), step)
    ctx = _Context(
        spec, rows, out_dir, comm, device, models, SingleShardCosts(spec.seed, device), step
    )
    if pending:
        _warm_up(pending[0], ctx)
    ran = 0
    for task in tasks:
        if task.id in folder.done:
            if on_task:
                on_task(folder.done[task.id], False)
            continue
        result = run_task(task, ctx)
        folder.append(result)
        ran += 1
        if on_task:
            on_task(result, True)
    results = [folder.done[t.id] for t in tasks if t.id in folder.done]
    calibrations = {k: m.calibration for k, m in models.items() if m.calibration}
    summary = summarize(results, [r.name for r in rows], seed=spec.seed, calibrations=calibrations)
    outputs = [folder.path, *write_outputs(summary, results, out_dir)]
    return BenchRun(out_dir, results, summary, outputs, len(results) - ran, ran, models)


def _upgrade(
    spec: BenchSpec,
    folder: ResultsFolder,
    tasks: Sequence[Task],
    models: dict[str, BenchModel],
    calibrates: bool,
    step: Step,
) -> None:
    """Fill in the model quality of the tasks a previous schema finished, from the
    plans and calibrated models the folder kept (a calibrated model whose file is
    gone is left out rather than calibrated again: that model would not be the one
    that planned), and rewrite the folder in this schema."""
    from shardwise.planner.costmodel.artifact import CostModel
    from shardwise.planner.costmodel.predictor import CostPredictor

    by_id = {t.id: t for t in tasks}
    filled = []
    for result in folder.done.values():
        task = by_id.get(result.task)
        if task is None or result.model_quality:
            filled.append(result)
            continue
        step(f"{result.task}: the cost models' quality (upgrading {folder.directory})")
        bundled = models["bundled"]
        used = {"bundled": (bundled.identity, CostPredictor(bundled.model))}
        path = folder.directory / MODELS_DIR / f"{calibration_key(spec, task)}.pt"
        if calibrates and path.is_file():
            used["calibrated"] = (file_identity(path), CostPredictor(CostModel.load(path)))
        plans = saved_plans(result, folder.directory / PLANS_DIR)
        quality, mixed = task_quality_and_ranks(plans, result.planners, task.tables, used)
        filled.append(replace(result, model_quality=quality, mixed_kind=mixed))
    folder.rewrite(filled)


def calibration_key(spec: BenchSpec, task: Task) -> str:
    """Which calibrated model plans ``task``: its pool's, or its own."""
    return task.pool if spec.calibrate_on == "pool" else task.id


def _predictor(model: BenchModel, task: Task, ctx: _Context) -> CostPredictor:
    """A fresh predictor (no caches warmed by another task) pricing comm with the
    task's declared comm for planners (``--comm``, as ``resolve_comm`` resolves it)."""
    from shardwise.planner.comm.choice import resolve_comm
    from shardwise.planner.comm.model import LearnedComm
    from shardwise.planner.costmodel.predictor import CostPredictor

    plain = CostPredictor(model.model)
    comm = resolve_comm(
        ctx.comm, world=task.topology.gpus, device=ctx.device, predictor=plain, measuring=False
    )
    return plain if isinstance(comm, LearnedComm) else CostPredictor(model.model, comm=comm)


def _model_for(row: Row, task: Task, ctx: _Context) -> BenchModel | None:
    if row.model is None:
        return None
    if row.model == "calibrated":
        return ctx.models[f"calibrated:{calibration_key(ctx.spec, task)}"]
    return ctx.models["bundled"]


def _warm_up(task: Task, ctx: _Context) -> None:
    """Plan one task untimed first, so no planner's time includes importing its
    libraries (TorchRec takes seconds) or first-call set-up. A row planning from
    measured costs warms up on the task's first two tables with measurements of its
    own, so the task's measurements are still taken (and timed) when it is run."""
    for row in ctx.rows:
        if not row.refined:
            ctx.step(f"warming up {row.name}")
            model = _model_for(row, task, ctx)
            predictor = _predictor(model, task, ctx) if model else None
            if row.planner in MEASURED_PLANNERS:
                small = replace(task, tables=task.tables[:2])
                _plan_one(row, small, predictor, SingleShardCosts(ctx.spec.seed, ctx.device))
            else:
                _plan_one(row, task, predictor, ctx.costs)


def run_task(task: Task, ctx: _Context) -> TaskResult:
    """Plan the task with every row, refine, then measure all plans side by side."""
    from shardwise.planner.comm.choice import resolve_comm

    predictors: dict[str, CostPredictor] = {}
    outcomes: dict[str, PlannerResult] = {}
    plans: dict[str, Plan] = {}
    # Per row, the runner-up plans its planner priced (NeuroShard's baselines), which
    # measured refinement times beside the row's plan, as `shardwise plan` does.
    runners_up: dict[str, dict[str, Plan]] = {}
    for row in ctx.rows:
        model = _model_for(row, task, ctx)
        if model is not None and model.identity not in predictors:
            predictors[model.identity] = _predictor(model, task, ctx)
        predictor = predictors[model.identity] if model is not None else None
        if row.refined:
            ctx.step(f"{task.id}: refining {row.start} for {row.name}")
            assert predictor is not None and row.start is not None
            outcome, plan = _refine_one(
                row,
                plans.get(row.start),
                outcomes[row.start],
                task,
                predictor,
                ctx,
                runners_up.get(row.start, {}),
            )
        else:
            ctx.step(f"{task.id}: planning with {row.name}")
            outcome, plan, runners_up[row.name] = _plan_one(row, task, predictor, ctx.costs)
        if model is not None:
            outcome = replace(outcome, model=model.identity)
        outcomes[row.name] = outcome
        if plan is not None:
            plans[row.name] = plan
            save_plan(plan, ctx.out_dir / PLANS_DIR / task.id / f"{row.name}.json")
    topo = task.topology
    bundled = ctx.models["bundled"]
    if bundled.identity not in predictors:
        predictors[bundled.identity] = _predictor(bundled, task, ctx)
    priced = predictors[bundled.identity]
    # The evaluator's comm; ``model`` there is the bundled model's network.
    comm = resolve_comm(
        ctx.comm, world=topo.gpus, device=ctx.device, predictor=priced, measuring=True
    )
    start = time.perf_counter()
    measured = measure_plans(
        plans,
        outcomes,
        task.tables,
        batch_size_per_rank=topo.batch_size_per_rank,
        repeats=ctx.spec.repeats,
        comm=comm,
        seed=ctx.spec.seed,
        device=ctx.device,
        on_step=lambda what: ctx.step(f"{task.id}: {what}"),
    )
    evaluation_s = time.perf_counter() - start
    used = {"bundled": (bundled.identity, priced)}
    calibrated = ctx.models.get(f"calibrated:{calibration_key(ctx.spec, task)}")
    if calibrated is not None:
        if calibrated.identity not in predictors:
            predictors[calibrated.identity] = _predictor(calibrated, task, ctx)
        used["calibrated"] = (calibrated.identity, predictors[calibrated.identity])
    where = next((r.device for r in outcomes.values() if r.device), ctx.device or "cpu")
    quality, mixed = task_quality_and_ranks(plans, outcomes, task.tables, used)
    return TaskResult(
        task=task.id,
        pool=task.pool,
        fill_kind=task.fill_kind,
        tables=len(task.tables),
        gpus=topo.gpus,
        index=task.index,
        seed=task.seed,
        table_names=[t.name for t in task.tables],
        global_batch=topo.batch_size_per_rank * topo.gpus,
        batch_size_per_rank=topo.batch_size_per_rank,
        gpu_memory_bytes=topo.gpu_memory_bytes,
        usable_bytes=topo.usable_bytes,
        memory_total=task.memory_total,
        fill=task.fill,
        fill_bound=task.fill_bound,
        repeats=ctx.spec.repeats,
        device=where,
        comm=comm.describe(),
        planner_comm=priced.comm_model.describe(),
        bound_s=measured.bound_s if measured else 0.0,
        bound_per_repeat=list(measured.bound_per_repeat) if measured else [],
        bound_cv=measured.bound_cv if measured else 0.0,
        heaviest_table_s=measured.heaviest_s if measured else 0.0,
        evaluation_s=evaluation_s,
        planners=outcomes,
        model_quality=quality,
        oversized=task.oversized,
        mixed_kind=mixed,
    )


def _plan_one(
    row: Row, task: Task, predictor: CostPredictor | None, costs: SingleShardCosts
) -> tuple[PlannerResult, Plan | None, dict[str, Plan]]:
    """Plan and time one row; a planner that cannot plan the task is a result too.
    Also the runner-up plans the planner priced (NeuroShard's), for refinement."""
    planner: Planner = get_planner(row.planner, PlannerOptions(seed=task.seed, predictor=predictor))
    if isinstance(planner, TorchRecMeasuredPlanner):
        planner.measure = costs
    measuring_before = costs.seconds
    try:
        run = run_planner(planner, task.tables, task.topology)
    except InvalidPlanError as err:  # a planner's bug: recorded loudly, the run goes on
        return PlannerResult(planner=row.name, status="invalid-plan", error=str(err)), None, {}
    except UserError as err:
        return PlannerResult(planner=row.name, status="plan-failed", error=str(err)), None, {}
    measuring = costs.seconds - measuring_before
    plan = run.plan.model_copy(update={"planner": row.name})
    return (
        PlannerResult(
            planner=row.name,
            status="ok",
            plan_hash=plan.hash,
            planning_s=run.seconds - measuring,
            measure_s=measuring,
            column_wise_tables=sum(1 for t in plan.tables if not t.is_table_wise),
            kinds=plan.kinds(),
        ),
        plan,
        dict(getattr(planner, "last_alternatives", {})),
    )


def _refine_one(
    row: Row,
    start: Plan | None,
    start_result: PlannerResult,
    task: Task,
    predictor: CostPredictor,
    ctx: _Context,
    alternatives: dict[str, Plan],
) -> tuple[PlannerResult, Plan | None]:
    """Measured refinement of ``start`` (timed); skipped with the reason where this
    host cannot measure the task's batch. Kinds move too, unless the row's planner is
    restricted to table-wise and column-wise."""
    from shardwise.planner.registry import TW_CW_PLANNERS
    from shardwise.profiler.refine.measured import RefinementSkipped, refine_measured

    if start is None:
        why = f"{row.start} has no plan to refine: {start_result.error}"
        return PlannerResult(planner=row.name, status="plan-failed", error=why), None
    began = time.perf_counter()
    try:
        plan = refine_measured(
            start,
            task.tables,
            comm=predictor.comm_model,
            predictor=predictor,
            budget_s=ctx.spec.refine_budget_s,
            seed=task.seed,
            device=ctx.device,
            on_step=lambda what: ctx.step(f"{task.id}: {row.name}: {what}"),
            alternatives=alternatives,
            kinds=row.planner not in TW_CW_PLANNERS,
        )
    except RefinementSkipped as err:
        return PlannerResult(planner=row.name, status="skipped", error=str(err)), None
    seconds = time.perf_counter() - began
    plan = plan.model_copy(update={"planner": row.name})
    refinement = plan.refinement.model_dump(mode="json") if plan.refinement else None
    return (
        PlannerResult(
            planner=row.name,
            status="ok",
            plan_hash=plan.hash,
            planning_s=start_result.planning_s,
            measure_s=start_result.measure_s,
            refine_s=seconds,
            column_wise_tables=sum(1 for t in plan.tables if not t.is_table_wise),
            kinds=plan.kinds(),
            refinement=refinement,
        ),
        plan,
    )
