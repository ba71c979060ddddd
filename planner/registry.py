"""Planners by name. Modules are imported only when their planner is asked for, so
``shardwise --help`` stays fast and TorchRec is loaded only by the planners using it."""

from __future__ import annotations

import importlib

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions

#: name -> (module, class).
_PLANNERS: dict[str, tuple[str, str]] = {
    "random": ("shardwise.planner.baselines.greedy", "RandomPlanner"),
    "size-greedy": ("shardwise.planner.baselines.greedy", "SizeGreedyPlanner"),
    "dim-greedy": ("shardwise.planner.baselines.greedy", "DimGreedyPlanner"),
    "lookup-greedy": ("shardwise.planner.baselines.greedy", "LookupGreedyPlanner"),
    "size-lookup-greedy": ("shardwise.planner.baselines.greedy", "SizeLookupGreedyPlanner"),
    "torchrec": ("shardwise.planner.baselines.torchrec", "TorchRecPlanner"),
    "torchrec-tw-cw": ("shardwise.planner.baselines.torchrec", "TorchRecTwCwPlanner"),
    "torchrec-measured": (
        "shardwise.planner.baselines.torchrec_measured",
        "TorchRecMeasuredPlanner",
    ),
    "torchrec-measured-tw-cw": (
        "shardwise.planner.baselines.torchrec_measured",
        "TorchRecMeasuredTwCwPlanner",
    ),
    "neuroshard": ("shardwise.planner.neuroshard", "NeuroShardPlanner"),
    "neuroshard-tw-cw": ("shardwise.planner.neuroshard", "NeuroShardTwCwPlanner"),
}


#: Planners that search with a cost model (``PlannerOptions.predictor``).
MODEL_PLANNERS = frozenset({"neuroshard", "neuroshard-tw-cw"})
#: Planners that plan from measured single-table costs: ``shardwise bench`` gives them,
#: and ``shardwise plan`` measures them itself when one is chosen, or with ``--measure``.
MEASURED_PLANNERS = frozenset({"torchrec-measured", "torchrec-measured-tw-cw"})


#: Planners restricted to table-wise and column-wise tables: measured refinement of
#: their plans keeps every table's kind.
TW_CW_PLANNERS = frozenset(name for name in _PLANNERS if name.endswith("-tw-cw"))


def planner_names() -> list[str]:
    return list(_PLANNERS)


def get_planner(name: str, options: PlannerOptions | None = None) -> Planner:
    try:
        module, cls = _PLANNERS[name]
    except KeyError:
        raise UserError(
            f"unknown planner {name!r}; choose one of: {', '.join(_PLANNERS)}."
        ) from None
    planner_cls: type[Planner] = getattr(importlib.import_module(module), cls)
    return planner_cls(options)
