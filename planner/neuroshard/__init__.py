"""NeuroShard's search (docs/design.md §8): a beam over column splits with a greedy
grid inside, a beam over kinds after it, the baselines priced as candidates, and a
local search to finish.

- :mod:`.problem`: what every candidate shares (tables, encodings, the full cost);
- :mod:`.greedy`: the table-wise greedy over a grid of width caps (inner loop);
- :mod:`.beam`: the beam search over splits (outer loop) and its knobs;
- :mod:`.local`: the local search on the predicted cost;
- :mod:`.base`, :mod:`.kindmoves`, :mod:`.explain`: the kinds besides table-wise and
  column-wise (what their tables hold per rank, the moves over them, the reasons);
- :mod:`.planner`: the planner, which also prices the baselines' plans.
"""

from shardwise.planner.neuroshard.beam import SearchConfig, SearchStats
from shardwise.planner.neuroshard.greedy import DEFAULT_GRID
from shardwise.planner.neuroshard.planner import NeuroShardPlanner, NeuroShardTwCwPlanner

__all__ = [
    "DEFAULT_GRID",
    "NeuroShardPlanner",
    "NeuroShardTwCwPlanner",
    "SearchConfig",
    "SearchStats",
]
