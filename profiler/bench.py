"""The benchmark protocol of docs/design.md §9 (``shardwise bench``).

For every task (T held-out tables for W GPUs, a memory limit that makes placement
non-trivial), every planner plans (timed), then every plan is measured by the
evaluator side by side with the others (:func:`shardwise.profiler.evaluate.evaluate_side_by_side`),
never priced by a planner's own model. Each finished task is appended to
``results.jsonl`` (:mod:`shardwise.profiler.bench_results`), so a run resumes where
it stopped; :mod:`shardwise.profiler.bench_report` turns the results into ratios,
geomeans, a CSV, a JSON summary and a chart.

- **Tables**: drawn without replacement from the held-out pool of
  :mod:`shardwise.profiler.bench_spec`, per task from ``(seed, T, W, index)``.
- **Memory**: each GPU may hold ``memory_factor × max(total / W, largest table)``
  bytes of weights (after the plan's default 15 % reserve), so a planner can neither
  pile tables on one GPU nor ignore sizes, and every table fits somewhere.
- **Planners** get ``PlannerOptions(seed, predictor, batch_size_per_rank)``: the cost
  model (the bundled one unless another is given or picked for the pool, see
  docs/model-cache.md) loaded once, with a fresh
  predictor per task so no planner plans with caches warmed by an earlier task.
  ``torchrec-measured`` gets single-shard measurements (memoized across tasks); the
  time spent measuring is recorded apart from its planning time.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.basics import UserError, format_bytes
from shardwise.planner.base import Planner, PlannerOptions, run_planner
from shardwise.planner.plan import (
    DEFAULT_MEMORY_RESERVE,
    InvalidPlanError,
    Plan,
    Topology,
    save_plan,
)
from shardwise.planner.registry import get_planner, planner_names
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec, load_tables, save_tables
from shardwise.planner.torchrec_measured import TorchRecMeasuredPlanner
from shardwise.profiler.bench_measure import SingleShardCosts
from shardwise.profiler.bench_report import BenchSummary, summarize, write_outputs
from shardwise.profiler.bench_results import PlannerResult, ResultsFolder, TaskResult
from shardwise.profiler.bench_spec import BenchSpec, spec_json
from shardwise.profiler.evaluate import SideBySide, evaluate_side_by_side

POOL_FILE = "pool.yaml"
PLANS_DIR = "plans"


@dataclass(frozen=True)
class Task:
    """T tables for W GPUs: one line of the benchmark."""

    id: str
    index: int
    seed: int
    tables: list[TableSpec]
    topology: Topology


# --------------------------------------------------------------------------- planners


def resolve_planners(text: str) -> list[str]:
    """``all`` (every registered planner) or a comma list of registered names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return planner_names()
    known = planner_names()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"unknown planner {unknown[0]!r}" if unknown else "no planner named"
        raise UserError(f"--planners: {what}; use 'all' or a comma list of: {', '.join(known)}.")
    if len(set(names)) != len(names):
        raise UserError(f"--planners names a planner twice: {text!r}.")
    return names


# --------------------------------------------------------------------------- tasks


def held_out_pool(spec: BenchSpec, base: Path | None) -> list[TableSpec]:
    """The tables tasks are drawn from: generated with the held-out seed (or read from
    ``pool.file``), without tables above ``pool.max_table_bytes``."""
    pool_spec = spec.pool
    if pool_spec.file is not None:
        path = Path(pool_spec.file)
        tables = load_tables(path if path.is_absolute() or base is None else base / path)
        source = f"pool file {pool_spec.file}"
    else:
        tables = generate_tables(pool_spec.count, pool_spec.seed)
        source = f"generated pool (seed {pool_spec.seed}, {pool_spec.count} tables)"
    kept = [t for t in tables if t.size_bytes <= pool_spec.max_table_bytes]
    need = max(spec.tables)
    if len(kept) < need:
        raise UserError(
            f"the {source} has {len(kept)} tables of at most "
            f"{format_bytes(pool_spec.max_table_bytes)} (pool.max_table_bytes), but tasks "
            f"of T={need} tables need at least that many; raise pool.count or "
            "pool.max_table_bytes, or lower the largest T in 'tables'."
        )
    return kept


def task_topology(tables: Sequence[TableSpec], gpus: int, spec: BenchSpec) -> Topology:
    """GPUs holding ``memory_factor × max(total / W, largest table)`` of weights each."""
    total = sum(t.size_bytes for t in tables)
    usable = math.ceil(spec.memory_factor * max(total / gpus, max(t.size_bytes for t in tables)))
    memory = math.ceil(usable / (1.0 - DEFAULT_MEMORY_RESERVE))
    topology = Topology(
        gpus=gpus,
        gpu_memory_bytes=memory,
        device="cpu",
        batch_size_per_rank=spec.batch_size_per_rank,
    )
    while topology.usable_bytes < usable:  # float rounding in the reserve
        topology = topology.model_copy(update={"gpu_memory_bytes": topology.gpu_memory_bytes + 1})
    return topology


def draw_tasks(spec: BenchSpec, pool: Sequence[TableSpec]) -> list[Task]:
    """Every task of the grid, in order (T, then W, then index); pure in ``spec``."""
    tasks = []
    for count in spec.tables:
        for gpus in spec.gpus:
            for index in range(spec.tasks):
                seq = np.random.SeedSequence([spec.seed, count, gpus, index])
                seed = int(seq.generate_state(1)[0])
                picked = np.random.default_rng(seed).choice(len(pool), count, replace=False)
                tables = [pool[i] for i in sorted(int(i) for i in picked)]
                tasks.append(
                    Task(
                        id=f"T{count}-W{gpus}-{index}",
                        index=index,
                        seed=seed,
                        tables=tables,
                        topology=task_topology(tables, gpus, spec),
                    )
                )
    return tasks


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


Step = Callable[[str], None]


def run_bench(
    spec: BenchSpec,
    planners: Sequence[str],
    out_dir: Path,
    *,
    spec_base: Path | None = None,
    model_path: Path | None = None,
    pick_model: Callable[[list[TableSpec]], Path | None] | None = None,
    device: str | None = None,
    on_step: Step | None = None,
    on_task: Callable[[TaskResult, bool], None] | None = None,
) -> BenchRun:
    """Run (or resume) the benchmark into ``out_dir`` and write its summary files
    there; see the module docstring.

    ``pick_model(pool)``, when given, chooses the model file for the held-out pool
    (None: the bundled one) in place of ``model_path``, before the folder's settings
    are checked (the model is one of them). ``on_task(result, fresh)`` is called per
    task in order, ``fresh`` False for a task finished by an earlier run (and skipped).
    """
    from shardwise.profiler.fingerprint import current_fingerprint

    for name in planners:
        get_planner(name)  # unknown names fail before any work
    fingerprint = current_fingerprint(device)
    step = on_step or (lambda _: None)
    step("drawing the held-out table pool")
    pool_path = out_dir / POOL_FILE
    pool = load_tables(pool_path) if pool_path.exists() else held_out_pool(spec, spec_base)
    if pick_model is not None:
        model_path = pick_model(pool)
    folder = ResultsFolder(
        out_dir,
        {
            "spec": spec_json(spec),
            "planners": list(planners),
            "fingerprint": fingerprint.to_dict(),
            "model": _model_identity(model_path),
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    )
    if not pool_path.exists():
        save_tables(pool, pool_path)
    tasks = draw_tasks(spec, pool)
    model = _model(model_path)
    costs = SingleShardCosts(seed=spec.seed, device=device)
    pending = [t for t in tasks if t.id not in folder.done]
    if pending:
        _warm_up(pending[0], spec, planners, model, costs, step)
    ran = 0
    for task in tasks:
        if task.id in folder.done:
            if on_task:
                on_task(folder.done[task.id], False)
            continue
        result = run_task(task, spec, planners, out_dir, model, costs, device, step)
        folder.append(result)
        ran += 1
        if on_task:
            on_task(result, True)
    results = [folder.done[t.id] for t in tasks if t.id in folder.done]
    summary = summarize(results, planners)
    outputs = [folder.path, *write_outputs(summary, out_dir)]
    return BenchRun(out_dir, results, summary, outputs, skipped=len(results) - ran, ran=ran)


def _model_identity(model_path: Path | None) -> str:
    """Which cost model planners search with: its path and content hash."""
    from shardwise.planner.costmodel.artifact import BUNDLED_MODEL

    path = model_path or BUNDLED_MODEL
    if not path.is_file():
        return f"{path} (missing)"
    return f"{path.name} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def _model(model_path: Path | None) -> Any:
    """The cost model planners search with (None: none at hand, planners decide)."""
    from shardwise.planner.costmodel.artifact import BUNDLED_MODEL, CostModel

    if model_path is not None:
        return CostModel.load(model_path)
    if BUNDLED_MODEL.is_file():
        return CostModel.load(BUNDLED_MODEL)
    return None


def _options(task: Task, spec: BenchSpec, model: Any) -> PlannerOptions:
    """A fresh predictor per task, so no planner plans with another task's caches."""
    from shardwise.planner.costmodel.predictor import CostPredictor

    return PlannerOptions(
        seed=task.seed,
        predictor=CostPredictor(model) if model is not None else None,
        batch_size_per_rank=spec.batch_size_per_rank,
    )


def _warm_up(
    task: Task,
    spec: BenchSpec,
    planners: Sequence[str],
    model: Any,
    costs: SingleShardCosts,
    step: Step,
) -> None:
    """Plan one task untimed first, so no planner's time includes importing its
    libraries (TorchRec takes seconds) or first-call set-up."""
    for name in planners:
        step(f"warming up {name}")
        _plan_one(get_planner(name, _options(task, spec, model)), task, costs)


def run_task(
    task: Task,
    spec: BenchSpec,
    planners: Sequence[str],
    out_dir: Path,
    model: Any,
    costs: SingleShardCosts,
    device: str | None,
    step: Step,
) -> TaskResult:
    """Plan the task with every planner, then measure all plans side by side."""
    options = _options(task, spec, model)
    outcomes: dict[str, PlannerResult] = {}
    plans: dict[str, Plan] = {}
    for name in planners:
        step(f"{task.id}: planning with {name}")
        planner = get_planner(name, options)
        outcome, plan = _plan_one(planner, task, costs)
        outcomes[name] = outcome
        if plan is not None:
            plans[name] = plan
            save_plan(plan, out_dir / PLANS_DIR / task.id / f"{name}.json")
    start = time.perf_counter()
    bound = _measure_plans(task, spec, plans, outcomes, device, step)
    evaluation_s = time.perf_counter() - start
    where = next((r.device for r in outcomes.values() if r.device), device or "cpu")
    topo = task.topology
    return TaskResult(
        task=task.id,
        tables=len(task.tables),
        gpus=topo.gpus,
        index=task.index,
        seed=task.seed,
        table_names=[t.name for t in task.tables],
        total_bytes=sum(t.size_bytes for t in task.tables),
        gpu_memory_bytes=topo.gpu_memory_bytes,
        usable_bytes=topo.usable_bytes,
        batch_size_per_rank=spec.batch_size_per_rank,
        repeats=spec.repeats,
        device=where,
        bound_s=bound.bound_s if bound else 0.0,
        bound_per_repeat=list(bound.bound_per_repeat) if bound else [],
        bound_cv=bound.bound_cv if bound else 0.0,
        heaviest_table_s=bound.heaviest_s if bound else 0.0,
        evaluation_s=evaluation_s,
        planners=outcomes,
    )


def _measure_plans(
    task: Task,
    spec: BenchSpec,
    plans: dict[str, Plan],
    outcomes: dict[str, PlannerResult],
    device: str | None,
    step: Step,
) -> SideBySide | None:
    """Measure the plans side by side and fill in ``outcomes``; planners that found
    the same placement share one measurement. Returns the measurement (with the
    balance bound), or None when no planner produced a plan."""
    unique = list({p.hash: p for p in plans.values()}.values())
    if not unique:
        return None
    measured = evaluate_side_by_side(
        unique,
        task.tables,
        batch_size_per_rank=spec.batch_size_per_rank,
        repeats=spec.repeats,
        seed=spec.seed,
        device=device,
        on_step=lambda what: step(f"{task.id}: {what}"),
    )
    by_hash = {p.hash: i for i, p in enumerate(unique)}
    for name, plan in plans.items():
        i = by_hash[plan.hash]
        ev, why = measured.evaluations[i], measured.errors[i]
        if ev is None:
            outcomes[name] = replace(outcomes[name], status="measure-failed", error=why)
            continue
        outcomes[name] = replace(
            outcomes[name],
            max_s=ev.max_s,
            max_per_repeat=list(ev.max_per_repeat),
            repeat_cv=ev.repeat_cv,
            imbalance=ev.max_over_mean,
            device=ev.device,
            ranks=[{**asdict(r), "total_s": r.total_s} for r in ev.ranks],
        )
    return measured


def _plan_one(
    planner: Planner, task: Task, costs: SingleShardCosts
) -> tuple[PlannerResult, Plan | None]:
    """Plan and time one planner; a planner that cannot plan the task is a result too."""
    if isinstance(planner, TorchRecMeasuredPlanner):
        planner.measure = costs
    measuring_before = costs.seconds
    try:
        run = run_planner(planner, task.tables, task.topology)
    except InvalidPlanError as err:  # a planner's bug, not a result
        raise RuntimeError(f"planner {planner.name} returned an invalid plan: {err}") from None
    except UserError as err:
        return PlannerResult(planner=planner.name, status="plan-failed", error=str(err)), None
    measuring = costs.seconds - measuring_before
    plan = run.plan
    result = PlannerResult(
        planner=planner.name,
        status="ok",
        plan_hash=plan.hash,
        planning_s=run.seconds - measuring,
        measure_s=measuring,
        column_wise_tables=sum(1 for t in plan.tables if not t.is_table_wise),
    )
    return result, plan
