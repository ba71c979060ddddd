"""The NeuroShard planner: beam search, baselines as candidates, local search.

0. Tables no GPU holds whole start row-wise as the fixed rule places them
   (:mod:`shardwise.planner.oversized`); the search places the others around them.
1. The paper's search (:mod:`~shardwise.planner.neuroshard.beam`): a beam over column
   splits, each state placed by the greedy grid, and the local search on its best.
   This alone is ``neuroshard-tw-cw``.
2. With every kind, a second beam from the first's states moves tables between kinds
   (row-wise, table-row-wise on a host, data-parallel; an oversized table only among
   the splitting ones: :mod:`~shardwise.planner.neuroshard.kindmoves`), then kind
   rounds alternate with the local search. The first beam's best stays a candidate, so
   by the model the search with kinds is never worse than without.
3. **Baselines are candidates** (docs/design.md §8): TorchRec's plans (with every
   sharding kind, and restricted to table-wise/column-wise) and the greedy heuristics'
   plans are priced by the same model and comm, so the search can only add to what a
   user would get from them; the reason is recorded when one wins. A baseline plan the
   states cannot hold (a grid table, another cut, or any other kind when the search is
   restricted) is priced whole and may win as it is. The cheapest baseline gets the
   local search; where that is TorchRec at full strength, so does the cheapest other
   one, which is what the restricted twin gives it to (:func:`_local_search_picks`).
4. **The choice does not trust the model beyond its error**
   (:mod:`~shardwise.planner.neuroshard.risk`): every candidate (the beam's states,
   the local searches' results, each baseline) is scored by its risk-adjusted maximum
   under the model's error spread (one σ above the median), and the lowest wins. The
   candidates within the model's error of it are kept
   (:attr:`NeuroShardPlanner.last_alternatives`), so that measured refinement can time
   them and start from the fastest. One exception (:meth:`_refuse_unpaid`): what the
   kinds add must pay beyond what the model can tell. A plan that cuts tables by rows
   where the row-wise rule does not, or one only the kind search or TorchRec at full
   strength found, is refused when the restricted search's choice lies within the
   model's error of it; it is recorded with its prices and handed on as a runner-up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions, check_capacity
from shardwise.planner.costmodel import CostPredictor, load_bundled
from shardwise.planner.kinds import V1_KINDS
from shardwise.planner.neuroshard.base import Kinds, kinds_of
from shardwise.planner.neuroshard.beam import (
    SearchConfig,
    SearchStats,
    beam_search,
    initial_state,
    kind_search,
)
from shardwise.planner.neuroshard.explain import explain, explain_plan
from shardwise.planner.neuroshard.greedy import greedy
from shardwise.planner.neuroshard.kindmoves import kind_round
from shardwise.planner.neuroshard.local import local_search
from shardwise.planner.neuroshard.problem import Placement, Problem, Shards, State
from shardwise.planner.neuroshard.risk import Scored, ambiguous, score, within_error
from shardwise.planner.oversized import place_oversized
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: The heuristics whose plans are priced as candidates (cheap: milliseconds, TorchRec's
#: a second or two).
BASELINES = (
    "size-greedy",
    "dim-greedy",
    "lookup-greedy",
    "size-lookup-greedy",
    "torchrec",
    "torchrec-tw-cw",
)
#: The candidate label of the search's best table-wise/column-wise plan, when it searches
#: every kind.
TWIN_LABEL = "search#tw-cw"
#: TorchRec's planner is a candidate only up to these sizes (tables, tables × GPUs): its
#: enumeration grows with both, and offered every kind it takes minutes beyond.
#: Measured on 2 CPU cores (benchmarks/torchrec_planning_time.py), every kind: 80, 200
#: and 400 tables on 8 GPUs took 3.9, 9.8 and 55 s, 856 on 128 GPUs 144 s; restricted
#: to table-wise and column-wise, 0.2, 0.7 and 1.5 s, and 2.6 s for 856 on 128.
TORCHREC_LIMITS: dict[str, tuple[int, int]] = {
    "torchrec": (200, 1600),
    "torchrec-tw-cw": (1000, 131_072),
}


#: The candidates of TorchRec's plan with every kind (as made, and after the local
#: search): not in the restricted search's pool.
FULL_TORCHREC = frozenset({"torchrec", "torchrec+local"})
#: A baseline's plan as a candidate: its name, state, shards and placement.
_Found = tuple[str, State, Shards, Placement]


@dataclass(frozen=True)
class Offer:
    """What a candidate adds beyond the restricted search: the tables it cuts by rows
    where the row-wise rule does not, whether it holds a data-parallel table, and
    whether the search restricted to table-wise/column-wise holds it too."""

    rows_cut: tuple[str, ...]
    data_parallel: bool
    restricted: bool


class NeuroShardPlanner(Planner):
    """Beam search over column splits, greedy grid search over placements."""

    name = "neuroshard"
    summary = (
        "NeuroShard: cost-model-guided beam search over column splits, then over every "
        "table's kind (row-wise, table-row-wise, data-parallel), greedy placement, "
        "baselines priced as candidates, then a local search"
    )

    def __init__(
        self, options: PlannerOptions | None = None, config: SearchConfig | None = None
    ) -> None:
        super().__init__(options)
        self.config = config or SearchConfig()
        self.last_stats = SearchStats()
        #: The last search's runner-up plans, by where they came from: TorchRec's (as its
        #: planner made it) and every candidate within the model's error of the chosen
        #: plan. Measured refinement times them beside the chosen plan and starts from
        #: the fastest: the model ranks plans within its error, a measurement settles it
        #: (docs/refinement.md).
        self.last_alternatives: dict[str, Plan] = {}
        #: The last search's baseline plans priced whole (kinds its states do not hold).
        self._whole: list[tuple[str, Plan]] = []

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology, splittable=True)
        started = time.perf_counter()
        predictor = self.options.predictor
        if predictor is None:  # the bundled model, with the comm `--comm auto` picks
            from shardwise.planner.comm.choice import planning_comm

            predictor = CostPredictor(load_bundled())
            predictor.comm_model = planning_comm(predictor, topology)
        cfg, stats = self.config, SearchStats()
        oversized = place_oversized(tables, topology)
        problem = Problem(tables, topology, predictor, oversized, cfg.kinds)
        self.last_alternatives = {}
        self._whole = []
        if len(oversized.placed) == len(
            tables
        ):  # every table is placed row-wise: nothing to search
            fixed = problem.fixed_plan().model_copy(update={"planner": self.name})
            prediction = predictor.predict_plan(fixed, tables, topology.batch_size_per_rank)
            stats.source = "row-wise rule"
            stats.seconds = time.perf_counter() - started
            self.last_stats = stats
            return fixed.model_copy(update={"predicted": prediction.predicted()}).with_hash()
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
        pool: list[tuple[str, State, Placement]] = [("search", state, best)]
        pool += [(f"search#{i}", s, p) for i, (s, p) in enumerate(beam[1:], start=1)]
        #: The candidates only the search with kinds holds (:meth:`_refuse_unpaid`).
        kind_found: set[str] = set()
        if problem.searches_kinds:
            stats.priced["search-tw-cw"] = best.score
            pool[0] = (TWIN_LABEL, state, best)
            found = self._search_kinds(problem, [(state, best), *beam[1:]], stats)
            kind_found = {label for label, _, _ in found} | FULL_TORCHREC
            k_state, k_best = found[0][1], found[0][2]
            if k_state == state and np.array_equal(k_best.ranks, best.ranks):
                pool = pool[1:]  # the same plan: not a runner-up of itself
                kind_found.discard("search")  # ... and the restricted search holds it
            pool = found + pool
        if cfg.baselines:
            pool += self._baselines(problem, stats)
        chosen = self._choose(problem, pool, stats, frozenset(kind_found))
        stats.seconds = time.perf_counter() - started
        self.last_stats = stats
        if isinstance(chosen, Plan):
            stats.split_tables = sum(1 for t in chosen.tables if not t.is_table_wise)
            stats.kinds = explain_plan(chosen)
            return chosen
        _, state, best = chosen
        stats.best_scale = best.scale
        stats.split_tables = sum(1 for w in state if len(w) > 1)
        stats.kinds = explain(problem, state, best)
        stats.seconds = time.perf_counter() - started
        return problem.to_plan(state, best, self.name)

    def _search_kinds(
        self,
        problem: Problem,
        beam: list[tuple[State, Placement]],
        stats: SearchStats,
    ) -> list[tuple[str, State, Placement]]:
        """The kind beam from the split beam's states, then kind rounds with the local
        search on its best: the candidates it adds, its best as ``search``. The split
        beam's best stays in the pool (``search#tw-cw``)."""
        cfg = self.config
        lineages = [beam]
        start = initial_state(problem)
        if start not in {s for s, _ in beam}:
            first = greedy(problem, start, cfg.grid)
            lineages = [[(start, first)], beam] if first is not None else lineages
        kbeam = kind_search(problem, cfg, stats, lineages)
        state, best = kbeam[0]
        started = time.perf_counter()
        for _ in range(cfg.kind_rounds):
            got, priced = kind_round(problem, state, best)
            stats.kind_moves += priced
            if got is None:
                break
            state, best = got
            if cfg.refine_moves > 0:
                best = local_search(problem, problem.shards(state), best, cfg.refine_moves)
        stats.kind_seconds += time.perf_counter() - started
        stats.priced["search"] = best.score
        out = [("search", state, best)]
        out += [(f"search#kinds{i}", s, p) for i, (s, p) in enumerate(kbeam[1:], start=1)]
        return out

    def _choose(
        self,
        problem: Problem,
        pool: list[tuple[str, State, Placement]],
        stats: SearchStats,
        kind_found: frozenset[str],
    ) -> tuple[str, State, Placement] | Plan:
        """The candidate with the lowest risk-adjusted maximum (module docstring), unless
        what its kinds add does not pay beyond the model's error (:meth:`_refuse_unpaid`;
        ``kind_found``: the labels the restricted search does not hold); the others within
        the model's error of the best become runners-up. A baseline priced whole
        (:meth:`_price_whole`) that wins comes back as its plan."""
        scored = []
        kinds: list[Kinds] = []
        for label, st, placed in pool:
            sigma = problem.sigma(problem.shards(st), placed.ranks)
            scored.append(score(label, placed.compute.sum(axis=1), placed.comm.sum(axis=1), sigma))
            kinds.append(kinds_of(st))
        whole = {label: self._price_whole(problem, label, plan) for label, plan in self._whole}
        for label, (plan, priced) in whole.items():
            stats.priced[label] = priced.predicted_max
            scored.append(priced)
            kinds.append(problem.plan_kinds(plan))
        offers = [
            Offer(
                rows_cut=problem.rows_cut(k),
                data_parallel=any(opt.kind == "data_parallel" for _, opt in k),
                restricted=s.label not in kind_found,
            )
            for s, k in zip(scored, kinds, strict=True)
        ]
        chosen, refused = self._refuse_unpaid(scored, offers)
        cheapest = min(scored, key=lambda s: s.predicted_max)
        label = scored[chosen].label
        stats.choice = {
            "rule": "risk-adjusted max",
            "sigma": scored[chosen].straggler_sigma,
            "chosen": label,
            "predicted_max": scored[chosen].predicted_max,
            "risk": scored[chosen].risk,
            "cheapest_predicted": cheapest.label,
        }
        if refused is not None:
            stats.choice["refused"] = refused
        if chosen >= len(pool):
            stats.source = label
            stats.ambiguous = [s.label for s in ambiguous(scored) if s.label != label]
            plan = whole[label][0]
            return plan.model_copy(update={"planner": self.name}).with_hash()
        label, state, best = pool[chosen]
        stats.source = label.split("#")[0].removesuffix("+local")
        near = [s.label for s in ambiguous(scored) if s.label != label]
        # The search's best table-wise/column-wise plan is handed on whenever the model
        # cannot tell it from the chosen plan, past the cap on toss-ups: whether other
        # kinds pay is the question measurement settles (docs/refinement.md).
        twin = next((i for i, (lab, _, _) in enumerate(pool) if lab == TWIN_LABEL), None)
        if (
            twin is not None
            and label != TWIN_LABEL
            and TWIN_LABEL not in near
            and within_error(scored[chosen], scored[twin])
        ):
            near.append(TWIN_LABEL)
        stats.ambiguous = near
        by_label = {lab: (st, pl) for lab, st, pl in pool}
        seen = {problem.to_plan(state, best, self.name).hash}
        for lab in near:
            plan = problem.to_plan(*by_label[lab], self.name) if lab in by_label else whole[lab][0]
            if plan.hash not in seen:
                seen.add(plan.hash)
                self.last_alternatives[lab] = plan
        return label, state, best

    @staticmethod
    def _refuse_unpaid(
        scored: list[Scored], offers: list[Offer]
    ) -> tuple[int, dict[str, Any] | None]:
        """The index of the candidate to take: the lowest risk-adjusted max, unless what
        the kinds add is within the model's error of the restricted search's choice (the
        lowest among the candidates that search holds, :attr:`Offer.restricted`). Then
        the restricted choice is taken, and the refusal returned: the refused plan's
        label, tables cut by rows and prices (``_choose`` records it as
        ``stats.choice["refused"]``); measured refinement times the
        refused plan as a runner-up where the machine can measure.

        Refused so: a plan that cuts tables by rows where the rule does not (row-wise
        costs every rank of its group the global batch's bags, and the model's error on
        a kind is shared by every rank that holds it), and a table-wise/column-wise plan
        that only the kind search or TorchRec at full strength found (a placement the
        model cannot tell from the restricted one). Not refused: a plan whose only other
        kind is data-parallel, whose gain the declared comm prices, not the kernels."""
        best = min(range(len(scored)), key=lambda i: scored[i].risk)
        plain = [i for i, o in enumerate(offers) if o.restricted and not o.rows_cut]
        chosen = offers[best]
        if not plain or best in plain or (chosen.data_parallel and not chosen.rows_cut):
            return best, None
        alt = min(plain, key=lambda i: scored[i].risk)
        if not within_error(scored[best], scored[alt]):
            return best, None
        return alt, {
            "label": scored[best].label,
            "tables": list(chosen.rows_cut),
            "predicted_max": scored[best].predicted_max,
            "risk": scored[best].risk,
        }

    def _baselines(
        self, problem: Problem, stats: SearchStats
    ) -> list[tuple[str, State, Placement]]:
        """Every baseline's plan as a candidate, and the cheapest after a local search."""
        from shardwise.planner.registry import get_planner

        found: list[_Found] = []
        raw: dict[str, Plan] = {}
        for name in BASELINES:
            if name == "torchrec" and not problem.searches_kinds:
                # TorchRec at full strength chooses row-wise and data-parallel tables:
                # not a candidate of the search restricted to table-wise/column-wise
                # (its own restriction, torchrec-tw-cw, is).
                continue
            if name in TORCHREC_LIMITS:
                count = len(problem.all_tables)
                most, pairs = TORCHREC_LIMITS[name]
                if count > most or count * problem.world > pairs:
                    stats.baseline_errors[name] = (
                        f"{count} tables on {problem.world} GPUs: {name} takes minutes beyond "
                        f"{most} tables or {pairs} tables x GPUs"
                    )
                    continue
            try:
                plan = get_planner(name, PlannerOptions(seed=self.options.seed)).plan(
                    problem.all_tables, problem.topology
                )
            except UserError as err:
                stats.baseline_errors[name] = str(err).split(";")[0]
                continue
            got = problem.from_plan(plan)
            if got is None:
                # Kinds or placements the search does not hold: priced as a whole plan.
                self._whole.append((name, plan))
                raw[name] = plan
                continue
            b_state, ranks = got
            sh = problem.shards(b_state)
            placed = problem.place(sh, ranks)
            stats.priced[name] = placed.score
            found.append((name, b_state, sh, placed))
            raw[name] = plan
        # TorchRec's plan as its planner made it is always a runner-up: what a user
        # would get without Shardwise, timed beside ours wherever refinement measures.
        if "torchrec" in raw:
            self.last_alternatives["torchrec"] = raw["torchrec"]
        if not found:
            return []
        out = [(name, st, placed) for name, st, _, placed in found]
        if self.config.refine_moves > 0:
            for name, b_state, sh, placed in _local_search_picks(found):
                placed = local_search(problem, sh, placed, self.config.refine_moves)
                stats.priced[f"{name}+local"] = placed.score
                out.append((f"{name}+local", b_state, placed))
        return out

    def _price_whole(self, problem: Problem, label: str, plan: Plan) -> tuple[Plan, Scored]:
        """A baseline plan the search's states cannot hold, priced as the predictor
        prices any plan (every kind's kernels and collectives), scored like the rest;
        the plan comes back with that prediction."""
        predictor = problem.predictor
        prediction = predictor.predict_plan(plan, problem.all_tables, problem.batch_per_rank)
        compute = np.array([r.fwd_compute_s + r.bwd_compute_s for r in prediction.ranks])
        comm = np.array([r.fwd_comm_s + r.bwd_comm_s for r in prediction.ranks])
        sets = [
            [(k.spec, k.cols) for k in shards if not k.local_batch]
            for shards in plan.kernel_shards(problem.all_tables)
        ]
        sigma = predictor.rank_sigmas(sets, problem.global_batch)
        priced = plan.model_copy(update={"predicted": prediction.predicted()})
        return priced, score(label, compute, comm, sigma)


def _local_search_picks(found: Sequence[_Found]) -> list[_Found]:
    """The baselines that get the local search (each costs a search): the cheapest, and,
    where that is TorchRec at full strength, the cheapest of the others too. The
    restricted search's twin gives it to the latter (it has no full TorchRec), so the
    every-kind pool holds every candidate the twin holds, and a refusal
    (:meth:`NeuroShardPlanner._refuse_unpaid`) falls back to the twin's own choice."""
    if not found:
        return []
    picks = [min(found, key=lambda x: x[3].score)]
    others = [f for f in found if f[0] not in FULL_TORCHREC]
    if picks[0][0] in FULL_TORCHREC and others:
        picks.append(min(others, key=lambda x: x[3].score))
    return picks


class NeuroShardTwCwPlanner(NeuroShardPlanner):
    """The search restricted to table-wise and column-wise tables (the oversized ones
    row-wise by the rule): the search as it was before kinds were searched."""

    name = "neuroshard-tw-cw"
    summary = (
        "NeuroShard restricted to table-wise and column-wise shards (tables no GPU holds "
        "whole go row-wise by the fixed rule)"
    )

    def __init__(
        self, options: PlannerOptions | None = None, config: SearchConfig | None = None
    ) -> None:
        super().__init__(options, dataclasses.replace(config or SearchConfig(), kinds=V1_KINDS))
