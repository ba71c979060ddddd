"""The small interface every planner implements, how a planner is run, and the
capacity checks planners share.

A planner turns table specs and a topology into a valid :class:`Plan`. Planners are
found by name through :mod:`shardwise.planner.registry`, so the CLI, the benchmark
and the operator treat them alike (as TorchRec's planner does with its proposers),
and all three run one through :func:`run_planner`: plan (timed), validate, price.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shardwise.basics import UserError, format_bytes
from shardwise.planner.kinds import even_row_split
from shardwise.planner.memory import (
    ShardMemory,
    kind_memory,
    memory_sum,
    shard_bytes,
    shard_memory,
    what_would_fit,
)
from shardwise.planner.oversized import is_oversized, row_shard_memory, too_big_message
from shardwise.planner.plan import NonFiniteCostError, Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import MAX_RANKS, Topology

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor, PlanPrediction


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs common to planners; each planner reads the ones it understands."""

    seed: int = 0
    #: Planners that search with the cost model (NeuroShard) use this predictor (and
    #: its caches); ``None`` means the bundled CPU model.
    predictor: CostPredictor | None = None


class Planner(ABC):
    """Places tables on ranks. Subclasses set ``name`` and ``summary``."""

    name: ClassVar[str]
    summary: ClassVar[str]

    def __init__(self, options: PlannerOptions | None = None) -> None:
        self.options = options or PlannerOptions()

    @abstractmethod
    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        """A valid, hashed plan for ``tables`` on ``topology``, or a :class:`UserError`."""


@dataclass(frozen=True)
class PlannerRun:
    """One planner run: the valid, hashed plan (its ``predicted`` filled in when it was
    priced), the cost model's per-rank prediction when :func:`run_planner` priced it,
    and the seconds ``Planner.plan`` took."""

    plan: Plan
    prediction: PlanPrediction | None
    seconds: float


def run_planner(
    planner: Planner,
    tables: Sequence[TableSpec],
    topology: Topology,
    predictor: CostPredictor | None = None,
) -> PlannerRun:
    """Plan ``tables`` on ``topology`` (timed), validate the plan against both, and price
    it with ``predictor`` at the job's batch (``topology.batch_size_per_rank``).

    A plan the planner priced itself (NeuroShard's search, with its own predictor) keeps
    its prediction. A planner that cannot plan raises its :class:`UserError`; a plan
    that breaks the rules raises :class:`~shardwise.planner.plan.InvalidPlanError`; a
    model that predicts NaN or infinity, a :class:`NonFiniteCostError` naming its file.
    """
    start = time.perf_counter()
    try:
        plan = planner.plan(tables, topology)
    except NonFiniteCostError as err:
        used = planner.options.predictor or predictor
        source = used.model.source if used is not None else "the bundled cost model"
        raise NonFiniteCostError(f"{source}: {err}") from None
    seconds = time.perf_counter() - start
    plan.validate_plan(tables, source=f"the {planner.name} planner's plan")
    prediction = None
    if predictor is not None and plan.predicted is None:
        prediction = predictor.predict_plan(plan, tables, topology.batch_size_per_rank)
        plan = plan.model_copy(update={"predicted": prediction.predicted()})
    return PlannerRun(plan, prediction, seconds)


def check_capacity(
    tables: Sequence[TableSpec], topology: Topology, *, splittable: bool = False
) -> None:
    """Fail early, with the numbers, when no placement can exist under the memory rule
    (weights + optimizer state + I/O buffers at the job's batch, docs/memory.md).

    A table no GPU holds whole is placed row-wise (:mod:`shardwise.planner.oversized`),
    so it must fit row-wise over every GPU; every table together must fit the GPUs'
    memory, each counted as it is cheapest to hold (whole, or row-wise when it must be).
    ``splittable`` is accepted for callers that predate row-wise placement and changes
    nothing: every planner may now split a table that needs it.
    """
    del splittable
    cap = topology.usable_bytes
    batch, world = topology.batch_size_per_rank, topology.gpus
    at_batch = f"at batch {batch} per rank x {world} ranks"
    for t in tables:
        if is_oversized(t, topology) and (
            row_shard_memory(t, "row_wise", world, topology).total > cap
        ):
            raise UserError(too_big_message(t, topology))
    total = memory_sum(_held(t, topology, batch) for t in tables)
    if total.total > cap * world:

        def per_rank(b: int) -> int:
            return -(-sum(_held(t, topology, b).total for t in tables) // world)

        raise UserError(
            f"the {len(tables)} tables need {total.describe()} in total {at_batch} (each shard "
            f"looks up the global batch), but {world} GPUs hold "
            f"{format_bytes(cap * world)} ({topology.describe_capacity()}). "
            f"{what_would_fit(per_rank, topology, _gpus_to_fit(tables, topology))}."
        )


def _held(t: TableSpec, topology: Topology, batch: int) -> ShardMemory:
    """What ``t`` holds in all, over every rank, placed as cheaply as it may be: whole,
    or row-wise over every GPU when no GPU holds it whole."""
    if not is_oversized(t, topology):
        return shard_memory(t, t.dim, batch, topology.gpus)
    return memory_sum(
        kind_memory(
            "row_wise", n, t.dim, t.dtype, t.pooling_factor, batch, topology.gpus, topology.gpus
        )
        for _, n in even_row_split(t.rows, topology.gpus)
    )


def _gpus_to_fit(tables: Sequence[TableSpec], topology: Topology) -> str:
    """``", or N GPUs"`` when more GPUs of this size hold the tables (each GPU adds its
    memory but also adds to every shard's global batch), else nothing."""
    cap, batch = topology.usable_bytes, topology.batch_size_per_rank
    fixed = sum(shard_bytes(t, t.dim, 0, 1) for t in tables)
    io_per_rank = sum(shard_bytes(t, t.dim, batch, 1) for t in tables) - fixed
    if io_per_rank >= cap:
        return ""
    first = max(topology.gpus + 1, -(-fixed // (cap - io_per_rank)))
    for gpus in range(first, first + 64):  # rounding: the exact sum decides
        if gpus > MAX_RANKS:
            return ""
        if sum(shard_bytes(t, t.dim, batch, gpus) for t in tables) <= cap * gpus:
            return f", or {gpus} GPUs (--gpus)"
    return ""
