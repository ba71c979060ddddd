"""The plan evaluator (docs/design.md §6): a plan's real embedding cost, measured, per rank.

Every planner is judged by this measurement, never by its own model. For each
repeat, each rank's compute is one fused kernel holding exactly that rank's shards,
timed one rank at a time (peak memory is one rank's shards), at the global batch
(``batch_size_per_rank × world_size``: in table-wise and column-wise sharding every
rank looks up its tables for all samples). Then one real all-to-all runs with the
plan's per-rank output widths at the per-rank batch, each rank starting after its
own forward compute, so a fast rank's forward communication includes the wait for
the straggler. A rank's cost is fwd + bwd compute + fwd + bwd all-to-all; the plan's
cost is the max over ranks. Repeats give the evaluator's own repeatability (CV of
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
from shardwise.planner.comm.model import CommModel, MeasuredComm
from shardwise.planner.plan import Plan, PlanCost, RankCost
from shardwise.planner.tables import TableSpec
from shardwise.profiler.comm import CommCase, measure_comm_many, rank_dims
from shardwise.profiler.compute import ShardLoad, measure_compute

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
    #: Each repeat's max over ranks of fwd + bwd compute alone.
    max_compute_per_repeat: list[float] = field(default_factory=list)

    @property
    def repeat_cv(self) -> float:
        """Coefficient of variation of the max-rank cost over repeats."""
        return _cv(self.max_per_repeat)

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
        }


def max_compute(cost: PlanCost) -> float:
    """Max over ranks of fwd + bwd compute: the plan's cost without its all-to-all."""
    return max(r.fwd_compute_s + r.bwd_compute_s for r in cost.ranks)


def _cv(xs: Sequence[float]) -> float:
    if len(xs) < 2 or statistics.fmean(xs) == 0:
        return 0.0
    return statistics.stdev(xs) / statistics.fmean(xs)


def rank_shards(plan: Plan, tables: Sequence[TableSpec]) -> list[list[ShardLoad]]:
    """Each rank's shards as the compute benchmark takes them (plan checked first)."""
    plan.validate_plan(tables, source=f"plan {plan.hash[:8] or '(unhashed)'}")
    specs = {t.name: t for t in tables}
    return [
        [ShardLoad(specs[t.name], s.cols) for t, s in shards] for shards in plan.shards_per_rank()
    ]


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
) -> Evaluation:
    """Per-repeat, per-rank (fwd, bwd) compute and all-to-all → the evaluation:
    per-rank medians per component, and each repeat's max over ranks (with and
    without the all-to-all)."""
    repeats, world = len(computes), plan.world_size
    max_compute_per_repeat = [
        max(computes[k][r][0] + computes[k][r][1] for r in range(world)) for k in range(repeats)
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
        max_compute_per_repeat=max_compute_per_repeat,
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
            try:
                for rank_loads in shards[entry]:
                    m = measure_compute(rank_loads, global_batch, seed=seed, device=device)
                    mitigated[entry] = mitigated[entry] and (
                        m.allocator_mitigated or not rank_loads
                    )
                    used_device[entry] = m.device
                    row.append((m.fwd_s, m.bwd_s))
            except UserError as err:  # e.g. a rank too big for this host's memory
                errors[entry] = str(err)
                continue
            computes[entry].append(row)
    if comm is None or comm.kind == "measured":
        comms, backend = _all_to_alls(
            plans, computes, errors, repeats, batch_size_per_rank, world, on_step
        )
        why = honest_comm_measurement(world, device) if comm is None else None
        measured = comm if isinstance(comm, MeasuredComm) else MeasuredComm(warning=why)
        used: CommModel = MeasuredComm(measured.auto_reason, measured.warning, backend)
    else:
        used = comm
        comms = _declared(plans, computes, errors, batch_size_per_rank, comm)
    evaluations: list[Evaluation | None] = []
    for i, plan in enumerate(plans):
        if errors[i] is not None:
            evaluations.append(None)
            continue
        evaluations.append(
            aggregate(
                plan,
                computes[i],
                comms[i],
                batch_size_per_rank=batch_size_per_rank,
                device=used_device[i],
                mitigated=mitigated[i],
                comm=used.describe(),
                comm_kind=used.kind,
            )
        )
    return SideBySide(evaluations, errors, bounds, heaviest, used.describe())


def _single_tables(
    tables: Sequence[TableSpec], global_batch: int, seed: int, device: str | None
) -> list[float]:
    """Each table's compute (fwd + bwd medians) whole and alone at the global batch."""
    out = []
    for t in tables:
        m = measure_compute([ShardLoad.whole(t)], global_batch, seed=seed, device=device)
        out.append(m.fwd_s + m.bwd_s)
    return out


def _all_to_alls(
    plans: Sequence[Plan],
    computes: Sequence[Sequence[Sequence[tuple[float, float]]]],
    errors: Sequence[str | None],
    repeats: int,
    batch_size_per_rank: int,
    world: int,
    on_step: Callable[[str], None] | None,
) -> tuple[list[list[list[tuple[float, float]]]], str | None]:
    """[plan][rep][rank] -> (fwd, bwd) all-to-all seconds, one launch for all cases;
    and the backend that measured them (None when nothing was)."""
    out: list[list[list[tuple[float, float]]]] = [
        [[(0.0, 0.0)] * world for _ in range(repeats)] for _ in plans
    ]
    live = [i for i in range(len(plans)) if errors[i] is None]
    if world < 2 or not live:
        return out, None
    order: list[tuple[int, int]] = []  # (plan, rep), rotating like the compute
    for rep in range(repeats):
        k = rep % len(live)
        order.extend((i, rep) for i in live[k:] + live[:k])
    cases = [
        CommCase(dims=rank_dims(plans[i]), delays=[f for f, _ in computes[i][rep]])
        for i, rep in order
    ]
    if on_step:
        on_step(f"all-to-all across {world} processes: {len(cases)} cases")
    backend = None
    for (i, rep), result in zip(order, measure_comm_many(cases, batch_size_per_rank), strict=True):
        out[i][rep] = list(zip(result.fwd_s, result.bwd_s, strict=True))
        backend = result.backend
    return out, backend


def _declared(
    plans: Sequence[Plan],
    computes: Sequence[Sequence[Sequence[tuple[float, float]]]],
    errors: Sequence[str | None],
    batch_size_per_rank: int,
    comm: CommModel,
) -> list[list[list[tuple[float, float]]]]:
    """[plan][rep][rank] -> (fwd, bwd) seconds from a declared comm model, each repeat
    with its own measured forward compute as the ranks' start delays."""
    out: list[list[list[tuple[float, float]]]] = []
    for i, plan in enumerate(plans):
        if errors[i] is not None or not computes[i]:
            out.append([])
            continue
        dims = np.array([rank_dims(plan)] * len(computes[i]), dtype=np.float64)
        fwd_compute = np.array([[f for f, _ in row] for row in computes[i]], dtype=np.float64)
        fwd, bwd = comm.all_to_all(dims, fwd_compute, batch_size_per_rank)
        out.append(
            [
                list(zip(fwd[k].tolist(), bwd[k].tolist(), strict=True))
                for k in range(len(computes[i]))
            ]
        )
    return out
