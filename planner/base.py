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
from shardwise.planner.plan import NonFiniteCostError, Plan, Topology
from shardwise.planner.tables import TableSpec

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor, PlanPrediction


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs common to planners; each planner reads the ones it understands."""

    seed: int = 0
    #: Planners that search with the cost model (NeuroShard) use this predictor (and
    #: its caches); ``None`` means the bundled CPU model.
    predictor: CostPredictor | None = None
    #: Per-rank batch the predictions are made at (the evaluator's default).
    batch_size_per_rank: int = 128


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
    it with ``predictor`` at the planner's ``batch_size_per_rank``.

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
        prediction = predictor.predict_plan(plan, tables, planner.options.batch_size_per_rank)
        plan = plan.model_copy(update={"predicted": prediction.predicted()})
    return PlannerRun(plan, prediction, seconds)


def check_capacity(
    tables: Sequence[TableSpec], topology: Topology, *, splittable: bool = False
) -> None:
    """Fail early, with the numbers, when no placement can exist.

    ``splittable`` planners may split a table column-wise across ranks, so only the
    narrowest legal shard (4 columns) must fit on one GPU.
    """
    cap = topology.usable_bytes
    for t in tables:
        need = t.column_bytes(4) if splittable else t.size_bytes
        if need > cap:
            what = "even a 4-column shard of it needs" if splittable else "needs"
            raise UserError(
                f"table {t.name} {what} {format_bytes(need)}; {topology.describe_capacity()}. "
                "Give more GPU memory (--gpu-memory), a smaller reserve, or shrink the table."
            )
    total = sum(t.size_bytes for t in tables)
    if total > cap * topology.gpus:
        raise UserError(
            f"the {len(tables)} tables need {format_bytes(total)} in total, but "
            f"{topology.gpus} GPUs hold {format_bytes(cap * topology.gpus)} "
            f"({topology.describe_capacity()}). Add GPUs (--gpus) or memory (--gpu-memory)."
        )
