"""The NeuroShard planner: beam search, baselines as candidates, local search.

1. The paper's search (:mod:`~shardwise.planner.neuroshard.beam`): a beam over column
   splits, each state placed by the greedy grid.
2. **Baselines are candidates** (docs/design.md §8): TorchRec's plan and the greedy
   heuristics' plans are priced by the same model and comm, so the search can only
   add to what a user would get from them; the reason is recorded when one wins.
3. The local search (:mod:`~shardwise.planner.neuroshard.local`) from the search's
   best and from the cheapest baseline; the cheaper result is the plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions, check_capacity
from shardwise.planner.costmodel import CostPredictor, load_bundled
from shardwise.planner.neuroshard.beam import SearchConfig, SearchStats, beam_search
from shardwise.planner.neuroshard.local import local_search
from shardwise.planner.neuroshard.problem import Placement, Problem, Shards, State
from shardwise.planner.plan import Plan, Topology
from shardwise.planner.tables import TableSpec

#: The heuristics whose plans are priced as candidates (cheap: milliseconds).
BASELINES = ("size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy", "torchrec")
#: TorchRec's planner is a candidate only up to this many tables: its enumeration takes
#: minutes beyond (and the search's own budget is 30 s).
TORCHREC_MAX_TABLES = 1000


class NeuroShardPlanner(Planner):
    """Beam search over column splits, greedy grid search over placements."""

    name = "neuroshard"
    summary = (
        "NeuroShard: cost-model-guided beam search over column splits and greedy "
        "placement, baselines priced as candidates, then a local search"
    )

    def __init__(
        self, options: PlannerOptions | None = None, config: SearchConfig | None = None
    ) -> None:
        super().__init__(options)
        self.config = config or SearchConfig()
        self.last_stats = SearchStats()
        #: The last search's runner-up plans, by where they came from: TorchRec's and the
        #: model-cheapest heuristic's (as their planners made them). Measured refinement
        #: times them beside the search's plan and starts from the fastest: the model
        #: ranks plans within its error, a measurement settles it (docs/refinement.md).
        self.last_alternatives: dict[str, Plan] = {}

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology, splittable=True)
        started = time.perf_counter()
        predictor = self.options.predictor
        if predictor is None:  # the bundled model, with the comm `--comm auto` picks
            from shardwise.planner.comm import planning_comm

            predictor = CostPredictor(load_bundled())
            predictor.comm_model = planning_comm(predictor, topology)
        problem = Problem(tables, topology, predictor)
        cfg, stats = self.config, SearchStats()
        self.last_alternatives = {}
        beam = beam_search(problem, cfg, stats)
        if not beam:
            raise UserError(
                f"no placement of the {len(tables)} tables fits {topology.gpus} GPUs "
                f"({topology.describe_capacity()}), even with column splits. "
                "Add GPUs or memory."
            )
        state, best = beam[0]
        if cfg.refine_moves > 0:
            refined = local_search(problem, problem.shards(state), best, cfg.refine_moves)
            stats.refine_gain = 1.0 - refined.score / best.score
            best = refined
        stats.priced["search"] = best.score
        if cfg.baselines:
            state, best = self._baselines(problem, state, best, stats)
        stats.best_scale = best.scale
        stats.split_tables = sum(1 for w in state if len(w) > 1)
        stats.seconds = time.perf_counter() - started
        self.last_stats = stats
        return problem.to_plan(state, best, self.name)

    def _baselines(
        self, problem: Problem, state: State, best: Placement, stats: SearchStats
    ) -> tuple[State, Placement]:
        """The search's best or a baseline's plan (after the local search), cheapest."""
        from shardwise.planner.registry import get_planner

        found: list[tuple[str, State, Shards, Placement]] = []
        raw: dict[str, Plan] = {}
        for name in BASELINES:
            if name == "torchrec" and len(problem.tables) > TORCHREC_MAX_TABLES:
                stats.baseline_errors[name] = f"more than {TORCHREC_MAX_TABLES} tables"
                continue
            try:
                plan = get_planner(name, PlannerOptions(seed=self.options.seed)).plan(
                    problem.tables, problem.topology
                )
            except UserError as err:
                stats.baseline_errors[name] = str(err).split(";")[0]
                continue
            got = problem.from_plan(plan)
            if got is None:
                stats.baseline_errors[name] = "two shards of one table on one rank"
                continue
            b_state, ranks = got
            sh = problem.shards(b_state)
            placed = problem.place(sh, ranks)
            stats.priced[name] = placed.score
            found.append((name, b_state, sh, placed))
            raw[name] = plan
        if not found:
            return state, best
        by_price = sorted(found, key=lambda x: x[3].score)
        cheapest_heuristic = next((f[0] for f in by_price if f[0] != "torchrec"), None)
        for runner_up in ("torchrec", cheapest_heuristic):
            if runner_up in raw:
                self.last_alternatives[runner_up] = raw[runner_up]
        # The cheapest baseline gets the local search too (one: each costs a search).
        name, b_state, sh, placed = by_price[0]
        if self.config.refine_moves > 0:
            placed = local_search(problem, sh, placed, self.config.refine_moves)
            stats.priced[f"{name}+local"] = placed.score
        if placed.score < best.score:
            stats.source = name
            return b_state, placed
        return state, best
