"""The live re-plan changes a table's kind (planner/live/kinds.py): a hot table-wise table
turned row-wise when the gain beats what the model's range/whole ratio leaves open, a
row-wise table turned back, and a kind change alone written by the planner process."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_planner_live import summary

from shardwise.planner.kinds import KindOption, row_slice
from shardwise.planner.live.kinds import RatioFn, SliceRatio
from shardwise.planner.live.replan import replan
from shardwise.planner.memory import kind_memory
from shardwise.planner.plan import Plan, Shard, load_plan, save_plan, table_wise_plan
from shardwise.planner.tables import TableSpec, save_tables, table_signature
from shardwise.planner.topology import Topology

TOPO = Topology(gpus=2, gpu_memory_bytes=2**34, device="cpu", batch_size_per_rank=64)
HOT = TableSpec(name="h", rows=100_000, dim=32, pooling_factor=20)
LIGHT = [TableSpec(name=f"l{i}", rows=1_000, dim=16, pooling_factor=2) for i in range(3)]


def fixed(rho: float, spread: float) -> RatioFn:
    """A model whose ranges each cost ``rho`` of the whole table, ± ``spread``."""

    def ratio(spec: TableSpec, option: KindOption) -> SliceRatio:
        return SliceRatio((rho,) * TOPO.gpus, spread, "the test's model")

    return ratio


def hot_case(lights: int = 3) -> tuple[list[TableSpec], Plan, dict[str, float]]:
    """The hot table (10 ms) alone on rank 0, the light ones (1 ms each) on rank 1: no
    placement of whole tables lowers the max below 10 ms."""
    tables = [HOT, *LIGHT[:lights]]
    plan = table_wise_plan(tables, [0] + [1] * lights, TOPO, "neuroshard")
    return tables, plan, {"h": 10.0, **{t.name: 1.0 for t in LIGHT}}


def test_a_hot_table_turns_row_wise_when_the_gain_beats_its_uncertainty() -> None:
    tables, plan, ms = hot_case()
    live = summary(plan, ms)
    got = replan(plan, tables, TOPO, live, ratios=fixed(0.6, 0.1))
    assert got.kind_changes == ["h: table-wise → row-wise over 2 ranks"]
    assert got.changed and got.kind_notes == []
    new = got.plan
    assert new.problems(tables, require_hash=True) == []
    h = next(t for t in new.tables if t.name == "h")
    assert h.kind == "row_wise"
    assert [(s.rank, s.row_offset, s.rows) for s in h.shards] == [
        (0, 0, 50_000),
        (1, 50_000, 50_000),
    ]
    # 6 ms of the hot table on each rank, the 3 ms of light tables balanced around it
    # (one moves to rank 0): 7 and 8 ms, and at the worst plausible price still well
    # below today's 10 ms.
    assert got.predicted_rank_ms == pytest.approx([7.0, 8.0], abs=0.05)
    assert got.gain == pytest.approx(10 / 8 - 1, abs=0.01)
    assert got.risk_gain > 0 and got.uncertainty < got.gain
    assert len(got.moves) == 1 and got.moves[0].from_rank == 1
    # The reshard carries the whole table's weights and optimizer state.
    whole = kind_memory("table_wise", HOT.rows, HOT.dim, HOT.dtype, None, 64, 2)
    assert got.moved_bytes >= whole.weights + whole.optimizer
    assert "turning h: table-wise → row-wise over 2 ranks" in got.describe()


def test_the_cut_is_declined_when_the_ratios_spread_swallows_the_gain() -> None:
    tables, plan, ms = hot_case()
    live = summary(plan, ms)
    got = replan(plan, tables, TOPO, live, ratios=fixed(0.6, 0.5))
    assert got.kind_changes == [] and not got.changed and got.moves == []
    assert got.plan.hash == plan.hash
    # It says what the cut predicts, what it may cost at worst, and against what.
    note = got.kind_notes[0]
    assert note.startswith("h: table-wise → row-wise over 2 ranks declined")
    assert "max-rank compute of 8.0 ms" in note and "against 10.0 ms without it" in note
    assert "ranges at 0.60, 0.60 of the whole by the test's model, ± 50 %" in note
    worst = float(note.split("ms at its worst")[0].rsplit(", ", 1)[1])
    assert worst > 10.0 * 0.99
    assert note in got.describe()
    # A cut whose ranges cost their whole table each is no gain at any spread.
    got = replan(plan, tables, TOPO, live, ratios=fixed(1.0, 0.0))
    assert got.kind_changes == [] and "declined" in got.kind_notes[0]
    # Without a model to price the ranges, no kind is changed.
    assert replan(plan, tables, TOPO, live).kind_notes == []


def test_a_row_wise_table_whose_ranges_cost_too_much_turns_table_wise() -> None:
    """``h`` runs row-wise and its ranges cost 4.5 ms each, where the model says the
    whole costs 0.5 of the two (ranges at 1.0 of the whole each): whole, it costs
    about 4.5 ms on rank 1, with the light tables on rank 0."""
    tables = [HOT, *LIGHT]
    plan = Plan.from_shards(
        tables,
        [
            [Shard(rank=r, cols=32, row_offset=50_000 * r, rows=50_000) for r in range(2)],
            *[[Shard(rank=r, cols=16)] for r in (0, 0, 1)],
        ],
        TOPO,
        "neuroshard",
        kinds=["row_wise", None, None, None],
    )
    live = summary(plan, {"h": 4.5, **{t.name: 1.0 for t in LIGHT}}, empty=1e-6)
    got = replan(plan, tables, TOPO, live, ratios=fixed(1.0, 0.05))
    assert got.current_max_ms == pytest.approx(6.5)
    assert got.kind_changes and got.kind_changes[0].startswith("h: row-wise → table-wise on rank")
    h = next(t for t in got.plan.tables if t.name == "h")
    assert h.kind == "table_wise" and h.shards[0].whole_rows
    assert got.plan.problems(tables, require_hash=True) == []
    assert got.predicted_rank_ms == pytest.approx([3.0, 4.5], abs=0.05)
    assert got.risk_max_ms < got.current_max_ms


def calibrated(tmp_path: Path) -> Path:
    """A model file whose rank head measured the hot table whole and each of its two
    ranges (0.5 of it each) at the job's global batch."""
    from test_planner_costmodel_rankhead import with_head

    from shardwise.planner.costmodel.rankhead import RankHead

    half = row_slice(HOT, 0, 50_000)
    anchors = {
        table_signature(HOT): {32: (4e-3, 6e-3)},
        table_signature(half): {32: (2e-3, 3e-3)},
        table_signature(LIGHT[0]): {16: (4e-4, 6e-4)},
    }
    path = tmp_path / "model.pt"
    with_head(RankHead(batch=128, anchors=anchors, sigma=0.05)).save(path)
    return path


def test_a_kind_change_alone_is_written_by_the_planner_process(tmp_path: Path) -> None:
    """The operator's planner process re-plans with the job's calibrated model: its
    rank head measured the hot table whole and each range, so the cut pays, moves no
    other shard, and the plan is written all the same."""
    from shardwise.operator.loop.planner_pool import LivePlanRequest, compute_live_plan

    tables, plan, ms = hot_case(lights=1)
    data = calibrated(tmp_path).read_bytes()
    live = summary(plan, ms)
    request = LivePlanRequest(
        plan.model_dump_json(),
        json.dumps([t.model_dump(mode="json") for t in tables]),
        TOPO.model_dump_json(),
        live.model_dump_json(),
        model=(data, hashlib.sha256(data).hexdigest()),
    )
    out = compute_live_plan(request)
    assert out.error is None and out.plan_json is not None, out.live
    assert out.live["moves"] == 0
    assert "turning h: table-wise → row-wise over 2 ranks" in out.live["describe"]
    new = out.plan()
    assert [t.kind for t in new.tables] == ["row_wise", "table_wise"]
    assert new.tables[1].shards == plan.tables[1].shards
    assert new.problems(tables, require_hash=True) == []


def test_cli_with_a_calibrated_model_prints_and_writes_the_kind_change(tmp_path: Path) -> None:
    from cli_helpers import shardwise

    tables, plan, ms = hot_case(lights=1)
    paths = {
        k: tmp_path / f"{k}.{e}"
        for k, e in (("plan", "json"), ("tables", "yaml"), ("live", "json"))
    }
    save_tables(tables, paths["tables"])
    save_plan(plan, paths["plan"])
    paths["live"].write_text(summary(plan, ms).to_json())
    new = tmp_path / "new.json"
    args = [a for k in ("plan", "tables", "live") for a in (f"--{k}", paths[k])]
    ran = shardwise("replan", *args, "--model", calibrated(tmp_path), "--out", new)
    assert ran.code == 0, ran.stderr
    text = " ".join(ran.stdout.split())
    assert "kind change: h: table-wise → row-wise over 2 ranks" in text
    assert "turning h: table-wise → row-wise over 2 ranks" in text
    written = load_plan(new)
    assert written.tables[0].kind == "row_wise" and written.hash != plan.hash
    assert ran.lines("wrote ") and "the same placement" not in text
