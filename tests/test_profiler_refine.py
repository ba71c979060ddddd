"""Measured refinement times kernels for real, keeps memory and TorchRec's rule, and
never returns a plan that the fresh re-measurement finds worse than its start."""

from __future__ import annotations

import pytest
from conftest import host_budget, make_tables

from shardwise.basics import UserError
from shardwise.planner.comm.model import PRESETS, MeasuredComm
from shardwise.planner.costmodel.artifact import load_bundled
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.memory import shard_bytes
from shardwise.planner.plan import Plan, Shard, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import torchrec_problems
from shardwise.profiler.refine.measured import (
    RefinementSkipped,
    _best_start,
    measurable,
    refine_measured,
)
from shardwise.profiler.refine.placement import (
    Key,
    Move,
    Timing,
    apply_move,
    equal_widths,
    objective,
    rank_sets,
    split_widths,
)
from shardwise.profiler.refine.search import MIN_GAIN

pytestmark = pytest.mark.slow
#: Small tables at a small batch: a kernel takes milliseconds, a test a few seconds.
TABLES = [t.model_copy(update={"rows": min(t.rows, 20_000)}) for t in make_tables(10, seed=3)]
BATCH = 64
BUDGET = 6.0


def budget() -> float:
    """:data:`BUDGET`, or 30 rounds of this module's kernels on this host now
    (:func:`conftest.host_budget`). Before it tries a candidate, refinement keeps free
    the closing re-measurement (3 repeats of both plans' changed ranks, about 8 rounds),
    and a loaded host's speed swings 2-3x within a test (12 rounds once left no
    candidate time)."""
    return host_budget(TABLES, BATCH * 4, BUDGET, rounds=30)


def topo(gpus: int = 4, memory: int = 2**34, batch: int = BATCH) -> Topology:
    return Topology(gpus=gpus, gpu_memory_bytes=memory, batch_size_per_rank=batch)


def rank_bytes(plan: Plan, tables: list[TableSpec]) -> list[int]:
    specs = {t.name: t for t in tables}
    batch = plan.topology.batch_size_per_rank
    used = [0] * plan.world_size
    for t in plan.tables:
        for s in t.shards:
            used[s.rank] += shard_bytes(specs[t.name], s.cols, batch, plan.world_size)
    return used


def check_result(
    start: Plan, out: Plan, tables: list[TableSpec], batch: int = BATCH, budget_s: float = BUDGET
) -> None:
    """What every refined plan must satisfy, whatever the timings were."""
    out.validate_plan(tables, source="refined")
    assert torchrec_problems(out) == []
    assert max(rank_bytes(out, tables)) <= out.topology.usable_bytes
    rec = out.refinement
    assert rec is not None and rec.start_hash == start.hash
    assert rec.batch_size_per_rank == batch and rec.device == "cpu"
    assert rec.kernels_measured >= start.world_size and 0 < rec.seconds < budget_s + 5
    assert len(rec.final_per_rank_compute_seconds) == start.world_size
    assert rec.final_max_compute_seconds == max(rec.final_per_rank_compute_seconds)
    if rec.moves or rec.started_from:  # kept only when the fresh re-measurement confirms it
        assert out.hash != start.hash
        assert rec.final_max_compute_seconds < rec.start_max_compute_seconds
    else:  # the start plan comes back, with its own figures
        assert out.hash == start.hash
        assert rec.final_max_compute_seconds == rec.start_max_compute_seconds


def test_refines_a_lopsided_plan_and_records_it() -> None:
    start = table_wise_plan(TABLES, [0] * 7 + [1, 2, 3], topo(), "lopsided")
    steps: list[str] = []
    given = budget()
    out = refine_measured(start, TABLES, comm=None, budget_s=given, on_step=steps.append)
    check_result(start, out, TABLES, budget_s=given)
    rec = out.refinement
    assert rec is not None and rec.comm == "none: compute only"
    # Seven tables on one of four ranks: the search measures a move that helps, and
    # keeps it unless the gain it measured is within the noise of its timings (beside
    # busy processes a timing's spread can exceed what one table's move gains): then
    # it says so, and only then.
    moved = any("move 1" in s for s in steps)
    refused = [float(s.rsplit("of ", 1)[1].split(" %")[0]) for s in steps if "not kept" in s]
    assert moved or refused, steps
    if not moved:
        assert min(refused) > 100 * MIN_GAIN, steps
        assert not any("fresh re-measurement" in s for s in steps)
    else:
        assert any("fresh re-measurement" in s for s in steps), steps
    # It is kept only when the fresh, interleaved re-measurement confirms it (then the
    # plan is faster: check_result). On a quiet machine it was, 5 of 5 (0.49-0.63x the
    # start's max); beside other work on 2 cores the same plan measured 14 ms and 29 ms
    # within seconds, more than a move's gain, and then the start plan comes back.
    assert out.planner == start.planner and out.predicted is None


def test_starts_from_an_alternative_that_measures_faster() -> None:
    """Baselines are candidates here too: an alternative plan that measures faster is
    where the search starts, and the fresh re-measurement still compares the result
    with the plan given. The two plans must be further apart than the noise of the
    choice: with 7 tables on rank 0 they measured 11.75 against 14.49 ms (19 % apart),
    and beside 2 busy processes the per-rank medians of 3 rounds once read 19.67
    against 13.65 ms. All 10 tables on rank 0 against 2-3 a rank is 2-3x: with 2
    busy processes the medians chose even 6 of 6 times, at 1.4-2.9x. (With one round
    per plan a burst of load once made the even plan measure 24.03 ms against 12.81 ms;
    the nvlink comm model put the plans' objectives 4 % apart: compute alone is what
    this test is about.)"""
    start = table_wise_plan(TABLES, [0] * 10, topo(), "lopsided")
    even = table_wise_plan(TABLES, [i % 4 for i in range(10)], topo(), "even")
    steps: list[str] = []
    given = budget()
    out = refine_measured(
        start,
        TABLES,
        comm=None,  # compute alone: the even plan's max is well below the lopsided one's
        budget_s=given,
        on_step=steps.append,
        alternatives={"even": even, "same": start},
    )
    check_result(start, out, TABLES, budget_s=given)
    rec = out.refinement
    assert any("even's plan measured" in s for s in steps), steps
    # 3 rounds each, or 2 when the budget allows no more on a busy host
    chose = [s for s in steps if "per-rank medians of" in s]
    assert chose and ("of 3 rounds" in chose[0] or "of 2 rounds" in chose[0]), steps
    assert chose[0].endswith("the search starts from even"), steps
    assert not any("same's plan" in s for s in steps)  # the given plan is not timed twice
    assert rec is not None and rec.final_objective_seconds is not None
    assert rec.start_objective_seconds is not None
    # The result is kept only when the fresh re-measurement confirms it; quiet it does.
    # Beside 2 busy processes on 2 cores it once did not (a kernel's time is then mostly
    # its wait for a core), and the plan given came back, as it must.
    if rec.started_from is not None:
        assert rec.started_from == "even"
        assert rec.final_objective_seconds < rec.start_objective_seconds
    else:
        assert any("keeping the start plan" in s for s in steps), steps


class BurstyBench:
    """Times a rank at 1 ms a shard, except that ``burst`` calls (counted from 0) take
    5× as long: a busy neighbour, scripted so the test is exact."""

    def __init__(self, burst: set[int]) -> None:
        self.burst, self.calls = burst, 0

    def time(self, keys: list[Key]) -> Timing:
        slow = 5.0 if self.calls in self.burst else 1.0
        self.calls += 1
        return Timing(0.4e-3 * len(keys) * slow, 0.6e-3 * len(keys) * slow)


@pytest.mark.parametrize("burst", [set(range(4)), {4, 5, 6, 7}, {9, 14}])
def test_a_burst_of_load_does_not_choose_the_start(burst: set[int]) -> None:
    """The even plan is faster (3 shards on its busiest rank against the lopsided 7);
    a burst 5× slower over its whole first round, or over scattered later timings,
    still leaves it the start: the choice is on per-rank medians of 3 rounds, the
    later ones interleaved. Calls 0-3 are the even plan's first round."""
    start = table_wise_plan(TABLES, [0] * 7 + [1, 2, 3], topo(), "lopsided")
    even = table_wise_plan(TABLES, [i % 4 for i in range(10)], topo(), "even")
    specs = list(TABLES)
    start_place = [list(t.shards) for t in start.tables]
    bench = BurstyBench(set())
    first = [bench.time(keys) for keys in rank_sets(start_place, 4)]
    bench.burst, bench.calls = burst, 0
    steps: list[str] = []
    name, _, timings = _best_start(
        start,
        {"even": even},
        specs,
        4,
        start_place,
        first,
        bench,  # type: ignore[arg-type]
        lambda ts, dims: objective(ts, dims, None, BATCH),
        steps.append,
    )
    assert name == "even", steps
    assert max(t.total for t in timings) == pytest.approx(3e-3), steps
    assert bench.calls == 4 + 2 * 8, "a round per rank per plan, rounds 2 and 3 for both"
    assert any("per-rank medians of 3 rounds" in s for s in steps), steps


def test_moves_keep_every_rank_within_memory() -> None:
    """Memory fits three tables a rank: rank 0 is full, so nothing may go onto it, and
    the refined plan stays within the cap on every rank."""
    tables = [t.model_copy(update={"rows": 20_000, "dim": 64, "dtype": "fp32"}) for t in TABLES[:8]]
    sizes = sorted(shard_bytes(t, 64, BATCH, 4) for t in tables)
    tight = topo(memory=int((sum(sizes[-3:]) + 1024) / (1 - 0.15)))
    assert sum(sizes[-3:]) <= tight.usable_bytes < sum(sizes[:4])
    start = table_wise_plan(tables, [0, 0, 0, 1, 1, 2, 2, 3], tight, "tight")
    out = refine_measured(start, tables, comm=None, budget_s=BUDGET)
    check_result(start, out, tables)
    assert max(rank_bytes(out, tables)) <= tight.usable_bytes


def test_column_shards_keep_torchrecs_equal_width_rule() -> None:
    """A table split 16 + 8 + 8 columns: refinement may move its shards, but never lets
    shards of one table with different widths share a rank."""
    tables = [t.model_copy(update={"dim": 32}) for t in TABLES[:6]]
    shards = [
        [
            Shard(rank=0, col_offset=0, cols=16),
            Shard(rank=1, col_offset=16, cols=8),
            Shard(rank=2, col_offset=24, cols=8),
        ]
    ]
    shards += [[Shard(rank=r, col_offset=0, cols=32)] for r in (0, 0, 0, 0, 3)]
    start = Plan.from_shards(tables, shards, topo(), "split")
    out = refine_measured(start, tables, comm=None, budget_s=BUDGET)
    check_result(start, out, tables)


def test_with_a_comm_model_and_a_predictor() -> None:
    """The cost model ranks the candidates; the declared comm is in the objective and
    in the record, and the refined plan is priced again by the model."""
    comm = PRESETS["nvlink"]
    predictor = CostPredictor(load_bundled())
    start = table_wise_plan(TABLES, [0] * 6 + [1, 1, 2, 3], topo(), "lopsided")
    out = refine_measured(start, TABLES, comm=comm, predictor=predictor, budget_s=BUDGET)
    check_result(start, out, TABLES)
    rec = out.refinement
    assert rec is not None and rec.comm == comm.describe()
    if rec.moves:
        assert out.predicted is not None and out.predicted != start.predicted


def test_one_rank_has_nothing_to_move() -> None:
    start = table_wise_plan(TABLES[:3], [0, 0, 0], topo(gpus=1), "single")
    out = refine_measured(start, TABLES[:3], comm=None, budget_s=BUDGET)
    check_result(start, out, TABLES[:3])
    assert out.refinement is not None and out.refinement.moves == 0


def test_skipped_when_the_batch_does_not_fit_this_host() -> None:
    """The output alone at that global batch is terabytes: no host here measures it."""
    wide = [TableSpec(name="wide", rows=1000, dim=1024, pooling_factor=1.0)]
    huge = 2**24
    why = measurable(wide, huge, 8)
    assert why is not None and "global batch" in why and "more than half of" in why
    plan = table_wise_plan(
        wide, [0], Topology(gpus=1, gpu_memory_bytes=2**40, batch_size_per_rank=huge), "x"
    )
    with pytest.raises(RefinementSkipped, match="refinement skipped: timing rank 0") as err:
        refine_measured(plan, wide, comm=None, budget_s=BUDGET)
    assert isinstance(err.value, UserError)


def test_skipped_when_the_budget_allows_no_round() -> None:
    assert measurable(TABLES, BATCH, 4) is None
    why = measurable(TABLES, BATCH, 4, budget_s=0.001)
    assert why is not None and "budget" in why
    start = table_wise_plan(TABLES, [0] * 10, topo(), "x")
    with pytest.raises(RefinementSkipped, match="budget"):
        refine_measured(start, TABLES, comm=None, budget_s=0.001)


def test_measured_comm_is_refused() -> None:
    start = table_wise_plan(TABLES, [0] * 10, topo(), "x")
    with pytest.raises(RefinementSkipped, match="declared comm"):
        refine_measured(start, TABLES, comm=MeasuredComm(), budget_s=BUDGET)


def test_a_split_keeps_the_plan_valid_and_torchrec_runnable() -> None:
    """A split leaves the left part on its rank and moves the right part, both widths
    multiples of 4; the equal-width rule refuses a split next to a wider shard."""
    tables = [TableSpec(name="hot", rows=1000, dim=96, pooling_factor=5.0)]
    place = [[Shard(rank=0, col_offset=0, cols=96)]]
    assert split_widths(96) == (48, 48) and split_widths(12) == (4, 8)
    assert split_widths(4) is None
    split = apply_move(place, Move((0, 0), 0, 1, split=True))
    plan = Plan.from_shards(tables, split, topo(gpus=2), "split").validate_plan(tables)
    assert sorted((s.rank, s.col_offset, s.cols) for s in plan.tables[0].shards) == [
        (0, 0, 48),
        (1, 48, 48),
    ]
    assert equal_widths(split, [0], [0, 1]) and torchrec_problems(plan) == []
    # Splitting the 48 on rank 1 again and moving its right half to rank 0 would put a
    # 24 beside the 48 there: TorchRec cannot run that.
    again = apply_move(split, Move((0, 1), 1, 0, split=True))
    assert not equal_widths(again, [0], [0, 1])


def test_a_plan_for_other_tables_is_refused() -> None:
    start = table_wise_plan(TABLES, [0] * 10, topo(), "x")
    with pytest.raises(UserError, match="not in the plan"):
        measurable(TABLES[:9] + make_tables(11, seed=4)[10:], BATCH, 4, plan=start)
    with pytest.raises(UserError, match="not in the plan"):
        refine_measured(start, TABLES[:9] + make_tables(11, seed=4)[10:], comm=None)


def test_row_wise_and_data_parallel_tables_stay_and_are_measured() -> None:
    """Refinement moves only table-wise and column-wise tables; the row-wise and DP
    tables keep their shards, and every rank's figures include their kernels."""
    from shardwise.planner.kinds import even_row_split
    from shardwise.planner.plan import PlanTable

    big = TableSpec(name="big", rows=40_000, dim=32, pooling_factor=8.0)
    dp = TableSpec(name="dp", rows=500, dim=16, pooling_factor=2.0)
    tables = [*TABLES[:6], big, dp]
    lopsided = table_wise_plan(TABLES[:6], [0] * 5 + [1], topo(), "kinds")
    rows = [
        Shard(rank=r, cols=32, row_offset=o, rows=n)
        for r, (o, n) in enumerate(even_row_split(big.rows, 4))
    ]
    start = Plan(
        world_size=4,
        planner="kinds",
        topology=topo(),
        tables=[
            *lopsided.tables,
            PlanTable(name="big", rows=big.rows, dim=32, kind="row_wise", shards=rows),
            PlanTable(
                name="dp",
                rows=dp.rows,
                dim=16,
                kind="data_parallel",
                shards=[Shard(rank=r, cols=16) for r in range(4)],
            ),
        ],
    ).with_hash()
    steps: list[str] = []
    out = refine_measured(
        start, tables, comm=PRESETS["nvlink"], budget_s=BUDGET, on_step=steps.append
    )
    out.validate_plan(tables, source="refined")
    kept = {t.name: t for t in out.tables}
    assert kept["big"].kind == "row_wise" and kept["big"].shards == rows
    assert kept["dp"].kind == "data_parallel" and len(kept["dp"].shards) == 4
    assert any("2 row-wise or data-parallel tables kept where they are" in s for s in steps)
    rec = out.refinement
    assert rec is not None and len(rec.final_per_rank_compute_seconds) == 4
    # Ranks 2 and 3 hold no table-wise table, yet their row shard and DP copy are timed.
    assert min(rec.final_per_rank_compute_seconds) > 0
    if rec.moves:
        assert rec.final_max_compute_seconds < rec.start_max_compute_seconds
