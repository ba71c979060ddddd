"""The evaluator measures plans for real: per-rank compute and all-to-all."""

from __future__ import annotations

import statistics

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.comm.model import AlphaBetaComm
from shardwise.planner.plan import table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.comm import rank_dims
from shardwise.profiler.evaluate import evaluate_plan, evaluate_side_by_side

pytestmark = pytest.mark.slow
TABLES = [t.model_copy(update={"rows": min(t.rows, 50_000)}) for t in make_tables(8, seed=2)]
TOPO = Topology(gpus=2, gpu_memory_bytes=2**34)
#: Eight alike tables, so the lopsided plan's rank holds exactly twice the even plan's
#: work: at 2,048 per rank about 60 ms against 27 ms of compute here, a gap that a
#: loaded host's gloo all-to-all (40 ms of swing seen beside two busy loops) does not
#: close. With varied small tables at 256 per rank the two plans' heaviest ranks
#: measured 37 and 38 ms: the gap was noise. Medians of 3 repeats: beside two busy
#: loops one repeat of the even plan once measured 95 ms.
ALIKE = [TableSpec(name=f"a{i}", rows=50_000, dim=64, pooling_factor=30.0) for i in range(8)]


#: A spread over repeats (CV) from which the evaluator's figures cannot order two plans
#: 2x apart: what a loaded host gives (a quiet one: 1-5 %).
NOISY = 0.10


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def test_lopsided_plan_costs_more_on_its_heavy_rank() -> None:
    """Everything on rank 0 vs an even split: measured, not modelled. Both plans are
    measured as `evaluate_plan` measures one (it is this call with one plan), their
    all-to-alls in one launch of the workers."""
    lopsided = table_wise_plan(ALIKE, [0] * 8, TOPO, "all-on-0")
    even = table_wise_plan(ALIKE, [i % 2 for i in range(8)], TOPO, "even")
    side = evaluate_side_by_side(
        [lopsided, even], ALIKE, batch_size_per_rank=2048, repeats=3, bound=False
    )
    assert side.errors == [None, None]
    a, b = side.evaluations
    assert a is not None and b is not None
    assert a.ranks[1].fwd_compute_s == 0 and a.ranks[1].bwd_compute_s == 0  # empty rank
    assert a.ranks[0].bwd_compute_s > 0 and b.max_over_mean >= 1.0
    # Quiet, the lopsided rank measures about 2x the even plan's heaviest (60 against
    # 27 ms here), with a spread over repeats of 1-5 %. Beside a loaded suite a burst of
    # other processes once lifted the even plan's figures as far (82 against 89 ms):
    # the evaluator's own spread over repeats then says the host could not tell them
    # apart, and the order is asserted only where it says it could.
    spread = max(
        a.repeat_cv, b.repeat_cv, _cv(a.max_compute_per_repeat), _cv(b.max_compute_per_repeat)
    )
    figures = (a.max_compute_per_repeat, b.max_compute_per_repeat, a.max_s, b.max_s)
    if spread < NOISY:
        assert a.max_compute_s > 1.5 * b.max_compute_s, figures
        assert a.max_s > b.max_s and a.max_over_mean > b.max_over_mean, figures
    # The idle rank waits for the busy one in the forward all-to-all (straggler wait).
    assert a.ranks[1].fwd_comm_s > a.ranks[0].fwd_comm_s
    assert len(a.max_per_repeat) == 3 and a.repeat_cv >= 0
    assert a.allocator_mitigated
    assert a.comm_kind == "measured" and a.comm.startswith("measured: real gloo all-to-alls")
    assert a.max_compute_s < a.max_s
    doc = a.to_json()
    assert doc["max_s"] == a.max_s and len(doc["ranks"]) == 2  # type: ignore[arg-type]


def test_plan_must_match_tables() -> None:
    plan = table_wise_plan(TABLES, [0] * 8, TOPO, "x")
    with pytest.raises(UserError, match="not in the plan"):
        evaluate_plan(plan, make_tables(9, seed=2), repeats=1)


def test_a_declared_comm_is_computed_from_each_repeats_measured_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No worker is launched; the transfer is the model's, the straggler wait real."""
    import shardwise.profiler.evaluate as evaluate

    def no_launch(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a declared comm must not launch all-to-all workers")

    monkeypatch.setattr(evaluate, "measure_comm_many", no_launch)
    declared = AlphaBetaComm(name="test", alpha_s=1e-3, bytes_per_s=1e6, source="made up")
    tables = TABLES[:4]
    lopsided = table_wise_plan(tables, [0] * 4, TOPO, "all-on-0")
    got = evaluate_plan(lopsided, tables, batch_size_per_rank=16, repeats=3, comm=declared)
    (per,) = declared.one(rank_dims(lopsided), [0.0, 0.0], 16)[1][:1]
    assert per == pytest.approx(1e-3 + 16 * 4 * sum(t.dim for t in tables) / 1e6)
    busy, idle = got.ranks
    assert busy.bwd_comm_s == idle.bwd_comm_s == pytest.approx(per)
    assert busy.fwd_comm_s == pytest.approx(per)  # the straggler waits for nobody
    # The idle rank waits for rank 0's forward compute, repeat by repeat (medians agree).
    assert idle.fwd_comm_s == pytest.approx(per + busy.fwd_compute_s)
    assert got.comm == declared.describe() and got.comm_kind == "modelled"
    assert len(got.max_compute_per_repeat) == 3
    # Each repeat's total is its busiest rank's compute, kept per rank, plus the comm.
    for total, compute in zip(got.max_per_repeat, got.max_compute_per_repeat, strict=True):
        assert total == pytest.approx(compute + 2 * per)
    assert got.max_compute_s == pytest.approx(busy.fwd_compute_s + busy.bwd_compute_s)
    doc = got.to_json()
    assert doc["comm"] == declared.describe() and doc["max_compute_s"] == got.max_compute_s
