"""The plan evaluator (docs/design.md §6): a plan's real embedding cost, measured, per rank.

Every planner is judged by this measurement, never by its own model. For each
repeat, each rank's compute is its kernels timed back to back, one rank at a time
(peak memory is one rank's shards): one fused TBE per kernel group and precision
holding exactly the rank's shards of that group (``Plan.kernel_shards``,
:func:`~shardwise.profiler.compute.measure_compute`). Table-wise and column-wise
shards share the fused kernel at the global batch (``batch_size_per_rank ×
world_size``: every rank looks up its tables for all samples); row-wise,
table-row-wise and grid shards run in their kind's kernel at the global batch, each
holding its row range and receiving the real lookups that fall in it; data-parallel
tables run whole at the rank's own batch. Then one real all-to-all runs with the
plan's per-rank table-wise and column-wise widths at the per-rank batch, each rank
starting after its own forward compute, so a fast rank's forward communication
includes the wait for the straggler; the other kinds' collectives (row-wise
reduce-scatter and all-gather, data-parallel all-reduce) are measured in the same
launch where the plan is one host, and modelled otherwise
(:mod:`shardwise.planner.comm.collectives`), each part labelled with what priced it.
A rank's cost is fwd + bwd compute + fwd + bwd comm; the plan's cost is the max
over ranks. Repeats give the evaluator's own repeatability (CV of
the max over repeats). On machines without a GPU these are CPU figures.

Several plans are measured side by side (:func:`evaluate_side_by_side`; one plan is
the special case :func:`evaluate_plan`): this host's speed drifts by ±25 % over
minutes, so every repeat measures every plan once, in a rotating order (and the
balance bound's single tables with them), and drift hits all plans alike. The
all-to-alls of every plan and repeat run in one launch of the W worker processes
(starting 8 workers costs ~10 s here, more than the collectives), in the same order.

Where the all-to-all cannot be measured honestly (W gloo processes on fewer cores
measure the OS scheduler: docs/comm.md), the caller gives a declared
:class:`~shardwise.planner.comm.model.CommModel` instead: each repeat's comm is then
computed from that repeat's *measured* forward compute (the straggler wait is real,
the transfer declared) and no worker is launched. Every :class:`Evaluation` says
which comm it holds, and keeps the compute-only max beside the total.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.comm.choice import honest_comm_measurement
from shardwise.planner.comm.collectives import (
    ALL_TO_ALL,
    DATA_PARALLEL,
    HOST_ROW_WISE,
    ROW_WISE,
    CommPart,
    describe_parts,
    kind_sizes,
    kind_tables,
    plan_kind_parts,
)
from shardwise.planner.comm.hosts import comm_local_world
from shardwise.planner.comm.model import CommModel, MeasuredComm
from shardwise.planner.costmodel.predictor import kernel_json
from shardwise.planner.plan import Plan, PlanCost, RankCost
from shardwise.planner.tables import TableSpec
from shardwise.profiler.comm import CommCase, CommResult, measure_comm_many, rank_dims
from shardwise.profiler.compute import KernelTime, ShardLoad, measure_compute

#: Per-rank batch when none is given: one 80-table, 8-rank plan (global batch 1024)
#: evaluates in under a minute on 2 CPU cores with the default repeats.
DEFAULT_BATCH_PER_RANK = 128
#: The reported cost is the max over ranks of per-rank medians over the repeats;
#: three repeats left +-6 % between evaluations of one plan here, five fewer.
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class Evaluation(PlanCost):
    """Medians over repeats per rank and component, and the max-rank cost's spread."""

    repeats: int
    max_per_repeat: list[float]
    allocator_mitigated: bool
    #: Where the all-to-all figures come from: ``CommModel.describe()``.
    comm: str = ""
    #: ``measured``, ``learned`` or ``modelled`` (``CommModel.kind``).
    comm_kind: str = "measured"
    #: [repeat][rank] fwd + bwd compute: how well one repeat orders the ranks against
    #: another (the measurement's own agreement, beside a model's).
    compute_per_repeat: list[list[float]] = field(default_factory=list)
    #: Per rank, each kernel timed (:func:`kernel_json`), medians over the repeats.
    rank_kernels: list[list[dict[str, object]]] = field(default_factory=list)
    #: Each part of the comm (the all-to-all, each other kind's collectives) with what
    #: priced it and its per-rank medians (``CommPart.to_json``).
    comm_parts: list[dict[str, object]] = field(default_factory=list)

    @property
    def repeat_cv(self) -> float:
        """Coefficient of variation of the max-rank cost over repeats."""
        return _cv(self.max_per_repeat)

    @property
    def max_compute_per_repeat(self) -> list[float]:
        """Each repeat's max over ranks of fwd + bwd compute alone."""
        return [max(rep) for rep in self.compute_per_repeat]

    @property
    def max_compute_s(self) -> float:
        """The slowest rank's compute alone (per-rank medians), beside :attr:`max_s`."""
        return max_compute(self)

    def to_json(self) -> dict[str, object]:
        return {
            **self.cost_json(),
            "repeats": self.repeats,
            "max_per_repeat": self.max_per_repeat,
            "allocator_mitigated": self.allocator_mitigated,
            "repeat_cv": self.repeat_cv,
            "comm": self.comm,
            "comm_kind": self.comm_kind,
            "max_compute_s": self.max_compute_s,
            "max_compute_per_repeat": self.max_compute_per_repeat,
            "compute_repeat_cv": _cv(self.max_compute_per_repeat),
            "compute_per_repeat": self.compute_per_repeat,
            "rank_kernels": self.rank_kernels,
            "comm_parts": self.comm_parts,
        }


def max_compute(cost: PlanCost) -> float:
    """Max over ranks of fwd + bwd compute: the plan's cost without its all-to-all."""
    return max(r.fwd_compute_s + r.bwd_compute_s for r in cost.ranks)


def _cv(xs: Sequence[float]) -> float:
    if len(xs) < 2 or statistics.fmean(xs) == 0:
        return 0.0
    return statistics.stdev(xs) / statistics.fmean(xs)


def rank_shards(plan: Plan, tables: Sequence[TableSpec]) -> list[list[ShardLoad]]:
    """Each rank's shards as the compute benchmark takes them (plan checked first):
    ``Plan.kernel_shards``, each with its whole table's spec, its row range, its
    kernel group and whether it reads the local batch."""
    plan.validate_plan(tables, source=f"plan {plan.hash[:8] or '(unhashed)'}")
    specs = {t.name: t for t in tables}
    out = []
    for shards in plan.kernel_shards(specs):
        loads = []
        for k in shards:
            spec = specs[k.table]
            whole = k.row_offset == 0 and k.spec.rows == spec.rows
            loads.append(
                ShardLoad(
                    spec,
                    k.cols,
                    row_offset=k.row_offset,
                    rows=None if whole else k.spec.rows,
                    group=k.group,
                    local_batch=k.local_batch,
                )
            )
        out.append(loads)
    return out


def _kernel_medians(
    kernels: Sequence[Sequence[Sequence[KernelTime]]], world: int
) -> list[list[dict[str, object]]]:
    """[rep][rank][kernel] → per rank, each kernel with its medians over the repeats."""
    out: list[list[dict[str, object]]] = []
    for r in range(world):
        runs = [rep[r] for rep in kernels]
        if not runs:
            out.append([])
            continue
        out.append(
            [
                kernel_json(
                    k.group,
                    k.dtype,
                    k.batch_size,
                    k.shards,
                    statistics.median(run[j].fwd_s for run in runs),
                    statistics.median(run[j].bwd_s for run in runs),
                )
                for j, k in enumerate(runs[0])
            ]
        )
    return out


def _part_medians(parts: Sequence[Sequence[CommPart]]) -> list[dict[str, object]]:
    """[rep][part] → each part with its per-rank medians over the repeats."""
    if not parts:
        return []
    out = []
    for j, first in enumerate(parts[0]):
        fwd = np.median(np.stack([rep[j].fwd for rep in parts]), axis=0)
        bwd = np.median(np.stack([rep[j].bwd for rep in parts]), axis=0)
        out.append(CommPart(first.name, fwd, bwd, first.priced_by).to_json())
    return out


def evaluate_plan(
    plan: Plan,
    tables: Sequence[TableSpec],
    *,
    batch_size_per_rank: int = DEFAULT_BATCH_PER_RANK,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    device: str | None = None,
    on_step: Callable[[str], None] | None = None,
    comm: CommModel | None = None,
) -> Evaluation:
    """Measure ``plan`` ``repeats`` times; see the module docstring for what is timed
    and :func:`evaluate_side_by_side` for ``comm``."""
    if batch_size_per_rank < 1 or repeats < 1:
        raise UserError("the batch size and the number of repeats must be at least 1.")
    side = evaluate_side_by_side(
        [plan],
        tables,
        batch_size_per_rank=batch_size_per_rank,
        repeats=repeats,
        seed=seed,
        device=device,
        bound=False,
        on_step=on_step,
        comm=comm,
    )
    got = side.evaluations[0]
    if got is None:  # e.g. a rank too big for this host's memory
        raise UserError(side.errors[0] or "the plan could not be measured.")
    return got


def aggregate(
    plan: Plan,
    computes: Sequence[Sequence[tuple[float, float]]],
    comms: Sequence[Sequence[tuple[float, float]]],
    *,
    batch_size_per_rank: int,
    device: str,
    mitigated: bool,
    comm: str = "",
    comm_kind: str = "measured",
    kernels: Sequence[Sequence[Sequence[KernelTime]]] = (),
    parts: Sequence[Sequence[CommPart]] = (),
) -> Evaluation:
    """Per-repeat, per-rank (fwd, bwd) compute and comm → the evaluation: per-rank
    medians per component, and each repeat's max over ranks (with and without the
    comm); ``kernels`` ([rep][rank]) and ``parts`` ([rep]) give the per-kernel and
    per-part medians."""
    repeats, world = len(computes), plan.world_size
    compute_per_repeat = [
        [computes[k][r][0] + computes[k][r][1] for r in range(world)] for k in range(repeats)
    ]
    max_per_repeat = [
        max(
            computes[k][r][0] + computes[k][r][1] + comms[k][r][0] + comms[k][r][1]
            for r in range(world)
        )
        for k in range(repeats)
    ]
    median = statistics.median
    ranks = [
        RankCost(
            rank=r,
            fwd_compute_s=median([computes[k][r][0] for k in range(repeats)]),
            bwd_compute_s=median([computes[k][r][1] for k in range(repeats)]),
            fwd_comm_s=median([comms[k][r][0] for k in range(repeats)]),
            bwd_comm_s=median([comms[k][r][1] for k in range(repeats)]),
        )
        for r in range(world)
    ]
    return Evaluation(
        plan_hash=plan.hash,
        planner=plan.planner,
        world_size=world,
        batch_size_per_rank=batch_size_per_rank,
        device=device,
        ranks=ranks,
        repeats=repeats,
        max_per_repeat=max_per_repeat,
        allocator_mitigated=mitigated,
        comm=comm,
        comm_kind=comm_kind,
        compute_per_repeat=compute_per_repeat,
        rank_kernels=_kernel_medians(kernels, world),
        comm_parts=_part_medians(parts),
    )


# ------------------------------------------------------------------ side by side


@dataclass(frozen=True)
class SideBySide:
    """One evaluation per plan (``None`` where it could not be measured, with why),
    and the balance bound: sum of single-table compute ÷ W, per repeat."""

    evaluations: list[Evaluation | None]
    errors: list[str | None]
    bound_per_repeat: list[float]
    #: The costliest single table alone, per repeat: no table-wise plan can beat it.
    heaviest_per_repeat: list[float] = field(default_factory=list)
    #: Where every evaluation's all-to-all figures come from: ``CommModel.describe()``.
    comm: str = ""

    @property
    def heaviest_s(self) -> float:
        xs = self.heaviest_per_repeat
        return statistics.median(xs) if xs else 0.0

    @property
    def bound_s(self) -> float:
        return statistics.median(self.bound_per_repeat) if self.bound_per_repeat else 0.0

    @property
    def bound_cv(self) -> float:
        xs = self.bound_per_repeat
        if len(xs) < 2 or statistics.fmean(xs) == 0:
            return 0.0
        return statistics.stdev(xs) / statistics.fmean(xs)


_BOUND = -1  # the balance bound's entry in the rotation


def evaluate_side_by_side(
    plans: Sequence[Plan],
    tables: Sequence[TableSpec],
    *,
    batch_size_per_rank: int,
    repeats: int,
    seed: int = 0,
    device: str | None = None,
    bound: bool = True,
    on_step: Callable[[str], None] | None = None,
    comm: CommModel | None = None,
) -> SideBySide:
    """Measure every plan ``repeats`` times, interleaved; see the module docstring.

    ``comm``: None or a ``measured`` model runs real all-to-alls (one worker launch
    for all); a declared model (modelled, learned) computes each repeat's comm from
    its measured forward compute instead. The balance bound measures each table
    whole and alone at the global batch (compute only, fwd + bwd medians) and
    divides the sum by W.
    """
    if not plans:
        raise UserError("nothing to evaluate: no plan was given.")
    worlds = {p.world_size for p in plans}
    if len(worlds) != 1 or batch_size_per_rank < 1 or repeats < 1:
        raise UserError(
            f"side-by-side plans need one world size (got {sorted(worlds)}), a batch and "
            "repeats of at least 1."
        )
    world = worlds.pop()
    global_batch = batch_size_per_rank * world
    shards = [rank_shards(p, tables) for p in plans]
    errors: list[str | None] = [None] * len(plans)
    computes: list[list[list[tuple[float, float]]]] = [[] for _ in plans]  # [plan][rep][rank]
    kernels: list[list[list[tuple[KernelTime, ...]]]] = [[] for _ in plans]
    bounds: list[float] = []
    heaviest: list[float] = []
    mitigated = [True] * len(plans)
    used_device = [device or "cpu"] * len(plans)
    entries = list(range(len(plans))) + ([_BOUND] if bound else [])
    for rep in range(repeats):
        k = rep % len(entries)
        for entry in entries[k:] + entries[:k]:
            if entry == _BOUND:
                if on_step:
                    on_step(f"repeat {rep + 1}/{repeats}: balance bound, {len(tables)} tables")
                singles = _single_tables(tables, global_batch, seed, device)
                bounds.append(sum(singles) / world)
                heaviest.append(max(singles))
                continue
            if errors[entry] is not None:
                continue
            if on_step:
                on_step(f"repeat {rep + 1}/{repeats}: {plans[entry].planner}")
            row = []
            timed = []
            try:
                for rank_loads in shards[entry]:
                    m = measure_compute(
                        rank_loads,
                        global_batch,
                        seed=seed,
                        device=device,
                        local_batch_size=batch_size_per_rank,
                    )
                    mitigated[entry] = mitigated[entry] and (
                        m.allocator_mitigated or not rank_loads
                    )
                    used_device[entry] = m.device
                    row.append((m.fwd_s, m.bwd_s))
                    timed.append(m.kernel_times)
            except UserError as err:  # e.g. a rank too big for this host's memory
                errors[entry] = str(err)
                continue
            computes[entry].append(row)
            kernels[entry].append(timed)
    if comm is None or comm.kind == "measured":
        why = honest_comm_measurement(world, device) if comm is None else None
        measured = comm if isinstance(comm, MeasuredComm) else MeasuredComm(warning=why)
        parts, backend = _measured(
            plans, computes, errors, repeats, batch_size_per_rank, measured, on_step
        )
        used: CommModel = MeasuredComm(measured.auto_reason, measured.warning, backend)
    else:
        used = comm
        parts = _declared(plans, computes, errors, batch_size_per_rank, comm)
    evaluations: list[Evaluation | None] = []
    for i, plan in enumerate(plans):
        if errors[i] is not None:
            evaluations.append(None)
            continue
        totals = [
            [(float(f), float(b)) for f, b in zip(*_summed(rep_parts, world), strict=True)]
            for rep_parts in parts[i]
        ]
        first = parts[i][0] if parts[i] else []
        line = _a2a_line(used, plan)
        evaluations.append(
            aggregate(
                plan,
                computes[i],
                totals,
                batch_size_per_rank=batch_size_per_rank,
                device=used_device[i],
                mitigated=mitigated[i],
                comm=describe_parts(line, [p for p in first if p.name != ALL_TO_ALL]),
                comm_kind=used.kind,
                kernels=kernels[i],
                parts=parts[i],
            )
        )
    return SideBySide(evaluations, errors, bounds, heaviest, used.describe())


def _summed(parts: Sequence[CommPart], world: int) -> tuple[np.ndarray, np.ndarray]:
    fwd, bwd = np.zeros(world), np.zeros(world)
    for p in parts:
        fwd = fwd + p.fwd
        bwd = bwd + p.bwd
    return fwd, bwd


def _a2a_line(used: CommModel, plan: Plan) -> str:
    """The all-to-all's line; a measured one says when the plan's hosts were only
    processes on this one host."""
    if isinstance(used, MeasuredComm) and plan.topology.hosts > 1:
        warn = f"the plan's {plan.topology.hosts} hosts are processes on this one host"
        both = f"{used.warning}; {warn}" if used.warning else warn
        return MeasuredComm(used.auto_reason, both, used.backend).describe()
    return used.describe()


def _single_tables(
    tables: Sequence[TableSpec], global_batch: int, seed: int, device: str | None
) -> list[float]:
    """Each table's compute (fwd + bwd medians) whole and alone at the global batch."""
    out = []
    for t in tables:
        m = measure_compute([ShardLoad.whole(t)], global_batch, seed=seed, device=device)
        out.append(m.fwd_s + m.bwd_s)
    return out


def _measurable_sizes(plan: Plan, batch_size_per_rank: int) -> dict[str, int]:
    """The other kinds' collectives to measure for ``plan`` (none when it spans hosts:
    one host cannot measure the link between them): reduce-scatter widths of the
    row-wise and table-row-wise/grid outputs, the data-parallel gradients' fp32
    elements."""
    if plan.topology.hosts > 1 or plan.world_size < 2:
        return {}
    world = plan.world_size
    sizes = kind_sizes(kind_tables(plan.tables, world), world, world, batch_size_per_rank)
    row = world * batch_size_per_rank * 4
    out = {}
    if sizes["row_wise"]:
        out[ROW_WISE] = int(sizes["row_wise"]) // row
    if sizes["host_row_wise"]:
        out[HOST_ROW_WISE] = int(sizes["host_row_wise"]) // row
    if sizes["data_parallel"]:
        out[DATA_PARALLEL] = -(-int(sizes["data_parallel"]) // 4)
    return out


def _measured(
    plans: Sequence[Plan],
    computes: Sequence[Sequence[Sequence[tuple[float, float]]]],
    errors: Sequence[str | None],
    repeats: int,
    batch_size_per_rank: int,
    measured: MeasuredComm,
    on_step: Callable[[str], None] | None,
) -> tuple[list[list[list[CommPart]]], str | None]:
    """[plan][rep] → the comm parts, measured in one launch for all cases: each case
    the plan's all-to-all with that repeat's forward compute as delays, and its other
    kinds' collectives on one host; those of a plan spanning hosts are modelled.
    Also the backend that measured (None when nothing was)."""
    world = plans[0].world_size
    zero = np.zeros(world)
    out: list[list[list[CommPart]]] = [
        [[] for _ in range(len(computes[i]))] for i in range(len(plans))
    ]
    live = [i for i in range(len(plans)) if errors[i] is None]
    if world < 2 or not live:
        for i in live:
            out[i] = [[CommPart(ALL_TO_ALL, zero, zero, "one rank: no comm")] for _ in computes[i]]
        return out, None
    order: list[tuple[int, int]] = []  # (plan, rep), rotating like the compute
    for rep in range(repeats):
        k = rep % len(live)
        order.extend((i, rep) for i in live[k:] + live[:k])
    sizes = {i: _measurable_sizes(plans[i], batch_size_per_rank) for i in live}
    cases = []
    for i, rep in order:
        rs = [sizes[i][n] for n in (ROW_WISE, HOST_ROW_WISE) if n in sizes[i]]
        ar = [sizes[i][DATA_PARALLEL]] if DATA_PARALLEL in sizes[i] else []
        cases.append(
            CommCase(
                dims=rank_dims(plans[i]),
                delays=[f for f, _ in computes[i][rep]],
                reduce_scatter=rs,
                all_reduce=ar,
            )
        )
    if on_step:
        on_step(f"comm across {world} processes: {len(cases)} cases")
    backend = None
    for (i, rep), result in zip(order, measure_comm_many(cases, batch_size_per_rank), strict=True):
        backend = result.backend
        out[i][rep] = _measured_parts(plans[i], sizes[i], result, measured, batch_size_per_rank)
    return out, backend


def _measured_parts(
    plan: Plan,
    sizes: dict[str, int],
    result: CommResult,
    measured: MeasuredComm,
    batch_size_per_rank: int,
) -> list[CommPart]:
    """One case's figures as comm parts: the all-to-all, each measured collective,
    and the other kinds' collectives modelled where they could not be measured."""
    backend = result.backend
    warn = "" if measured.warning is None else f"; NOT honest here: {measured.warning}"
    line = _a2a_line(MeasuredComm(None, measured.warning, backend), plan)
    parts = [CommPart(ALL_TO_ALL, np.array(result.fwd_s), np.array(result.bwd_s), line)]
    got = iter(result.collectives)
    for name in (ROW_WISE, HOST_ROW_WISE, DATA_PARALLEL):
        if name not in sizes:
            continue
        c = next(got)
        what = "all-reduce" if c.name == "all_reduce" else "reduce-scatter and all-gather"
        how = f"measured: real {backend} {what}, a process per rank{warn}"
        parts.append(CommPart(name, np.array(c.fwd_s), np.array(c.bwd_s), how))
    if not sizes:
        parts += plan_kind_parts(plan, measured, batch_size_per_rank)
    return parts


def _declared(
    plans: Sequence[Plan],
    computes: Sequence[Sequence[Sequence[tuple[float, float]]]],
    errors: Sequence[str | None],
    batch_size_per_rank: int,
    comm: CommModel,
) -> list[list[list[CommPart]]]:
    """[plan][rep] → the comm parts from a declared comm model, each repeat's
    all-to-all with its own measured forward compute as the ranks' start delays, on
    the plan's hosts; the other kinds' collectives as the model's links price them."""
    out: list[list[list[CommPart]]] = []
    for i, plan in enumerate(plans):
        if errors[i] is not None or not computes[i]:
            out.append([])
            continue
        dims = np.array([rank_dims(plan)] * len(computes[i]), dtype=np.float64)
        fwd_compute = np.array([[f for f, _ in row] for row in computes[i]], dtype=np.float64)
        local_world = comm_local_world(comm, plan.topology)
        fwd, bwd = comm.all_to_all(dims, fwd_compute, batch_size_per_rank, local_world)
        others = plan_kind_parts(plan, comm, batch_size_per_rank)
        line = comm.describe()
        out.append(
            [[CommPart(ALL_TO_ALL, fwd[k], bwd[k], line), *others] for k in range(len(computes[i]))]
        )
    return out
