"""Checkpoints resume across plans of any kinds, with real ``torchrun`` and the trainer.

One run goes through three plans for the same three tables:

- a (2 ranks): ``t0`` and ``t1`` table-wise, ``t2`` data-parallel;
- b (2 ranks): ``t0`` row-wise (from table-wise), ``t1`` column-wise, ``t2`` table-wise
  (from data-parallel);
- c (3 ranks): ``t0`` row-wise over 3 (from 2), ``t1`` grid (from column-wise: the
  same column ranges, now cut in rows), ``t2`` data-parallel (from table-wise).

Each resume starts at the saved step + 1 with every table and dense layer equal to
what was saved (gathered in full before the save and after the load), and the
optimizer state is checked against what it must be, computed here from the saved
state alone: equal where the mapping is exact (rows recut, column ranges kept,
data-parallel → row-wise), each row's mean kept where it is not (row-wise →
data-parallel).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_resume_any_plan import Leg, _leg
from test_runtime_torchrun import small_tables

from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.runtime.checkpoint import CheckpointMeta, read_meta, weight_key
from shardwise.runtime.optstate import Block

pytestmark = pytest.mark.slow


def rows(n: int, ranks: list[int], cols: int, col_offset: int = 0) -> list[Shard]:
    return [
        Shard(rank=r, col_offset=col_offset, cols=cols, row_offset=o, rows=k)
        for r, (o, k) in zip(ranks, even_row_split(n, len(ranks)), strict=True)
    ]


def plans(specs: list[TableSpec]) -> list[Plan]:
    t0, t1, t2 = specs

    def plan(world: int, shards: list[list[Shard]], kinds: list[str]) -> Plan:
        topo = Topology(gpus=world, gpu_memory_bytes=2**30, device="cpu", batch_size_per_rank=256)
        return Plan.from_shards(specs, shards, topo, "test", kinds=kinds)  # type: ignore[arg-type]

    dp = [[Shard(rank=r, cols=t2.dim) for r in range(w)] for w in (2, 3)]
    return [
        plan(
            2,
            [[Shard(rank=0, cols=t0.dim)], [Shard(rank=1, cols=t1.dim)], dp[0]],
            ["table_wise", "table_wise", "data_parallel"],
        ),
        plan(
            2,
            [
                rows(t0.rows, [0, 1], t0.dim),
                [Shard(rank=1, cols=8), Shard(rank=0, col_offset=8, cols=t1.dim - 8)],
                [Shard(rank=1, cols=t2.dim)],
            ],
            ["row_wise", "column_wise", "table_wise"],
        ),
        plan(
            3,
            [
                rows(t0.rows, [0, 1, 2], t0.dim),
                rows(t1.rows, [0, 1, 2], 8) + rows(t1.rows, [0, 1, 2], t1.dim - 8, 8),
                dp[1],
            ],
            ["row_wise", "grid", "data_parallel"],
        ),
    ]


#: Each leg's last checkpoint description, read before the next leg prunes it.
METAS: dict[str, CheckpointMeta] = {}


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> list[Leg]:
    d = tmp_path_factory.mktemp("resume_kinds")
    specs = [s.model_copy(update={"name": f"t{i}"}) for i, s in enumerate(small_tables((16,) * 3))]
    save_tables(specs, d / "tables.yaml")
    out = []
    for (name, steps), plan in zip((("a", 6), ("b", 10), ("c", 12)), plans(specs), strict=True):
        leg = _leg(d, name, plan, steps)
        METAS[plan.hash] = read_meta(d / leg.summary["checkpoints"][-1])
        out.append(leg)
    return out


def _blocks(leg: Leg, name: str) -> list[Block]:
    """The row-wise state's blocks of ``name`` in ``leg``'s plan, from its checkpoint."""
    table = next(t for t in METAS[leg.plan.hash].tables if t.name == name)
    state = next(s for s in table.optimizer if s.kind == "rowwise")
    return state.blocks


def spread(blocks: list[Block], vector: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """Row-wise state as a table: each block's row value on each of its columns."""
    out = torch.full((rows, dim), float("nan"))
    for b in blocks:
        out[b.row_offset : b.row_end, b.col_offset : b.col_end] = vector[
            b.offset : b.offset + b.rows, None
        ]
    assert not out.isnan().any()
    return out


def _resumed(before: Leg, after: Leg) -> None:
    """0 steps lost, every weight and dense layer equal, the dense state of the dense
    layers equal, and it trained on."""
    s = after.summary
    assert s["start_step"] == before.summary["end_step"] == before.end["step"]
    assert s["losses"][0][0] == s["start_step"] + 1  # the step after the saved one
    assert s["resumed_world_size"] == before.world_size
    assert before.end["model"].keys() == after.start["model"].keys()
    for key, value in before.end["model"].items():
        assert torch.equal(value, after.start["model"][key]), key
    for key, state in before.end["dense_optimizer"].items():
        if "embedding_bags" in key:
            continue  # a data-parallel table's: checked per mapping
        for name, value in state.items():
            assert torch.equal(value, after.start["dense_optimizer"][key][name]), (key, name)
    changed = [
        k for k, v in after.end["model"].items() if not torch.equal(v, after.start["model"][k])
    ]
    assert all(weight_key(t.name) in changed for t in after.plan.tables)  # it trained on


def _rowwise(leg: Leg, which: str, name: str) -> torch.Tensor:
    state = leg.start if which == "start" else leg.end
    return state["embedding_optimizer"][weight_key(name)][f"{name}.momentum1"]


def _dense_sum(leg: Leg, which: str, name: str) -> torch.Tensor:
    state = leg.start if which == "start" else leg.end
    return state["dense_optimizer"][weight_key(name)]["sum"]


def test_table_wise_to_row_wise_and_data_parallel_to_table_wise(legs: list[Leg]) -> None:
    a, b, _ = legs
    _resumed(a, b)
    t0, t1, t2 = a.plan.tables
    # t0: table-wise → row-wise over 2 ranks: the same state, row by row (exact)
    old = spread(_blocks(a, "t0"), _rowwise(a, "end", "t0"), t0.rows, t0.dim)
    new = spread(_blocks(b, "t0"), _rowwise(b, "start", "t0"), t0.rows, t0.dim)
    assert float(old.sum()) > 0 and torch.equal(old, new)
    # t2: data-parallel → table-wise: each row's mean of the Adagrad sums (exact)
    sums = _dense_sum(a, "end", "t2")
    assert float(sums.sum()) > 0 and weight_key("t2") not in b.start["dense_optimizer"]
    torch.testing.assert_close(_rowwise(b, "start", "t2"), sums.mean(dim=1), rtol=1e-6, atol=0)
    assert b.plan.tables[2].kind == "table_wise" and t2.kind == "data_parallel"
    meta = METAS[a.plan.hash]
    assert {t.name: t.kind for t in meta.tables} == {
        "t0": "table_wise",
        "t1": "table_wise",
        "t2": "data_parallel",
    }
    assert next(t for t in meta.tables if t.name == "t2").state("dense") is not None
    assert t1.kind == "table_wise"


def test_row_wise_at_two_ranks_to_three_and_column_wise_to_grid(legs: list[Leg]) -> None:
    _, b, c = legs
    _resumed(b, c)
    t0, t1, t2 = b.plan.tables
    for t in (t0, t1):  # rows recut, column ranges kept: exact
        old = spread(_blocks(b, t.name), _rowwise(b, "end", t.name), t.rows, t.dim)
        new = spread(_blocks(c, t.name), _rowwise(c, "start", t.name), t.rows, t.dim)
        assert float(old.sum()) > 0 and torch.equal(old, new), t.name
    assert len(_blocks(c, "t1")) == 6  # 2 column ranges x 3 row ranges
    layout = {t.name: t for t in METAS[c.plan.hash].tables}
    assert [s.row_offset for s in layout["t0"].shards] == [o for o, _ in even_row_split(t0.rows, 3)]
    # t2: table-wise → data-parallel: each row's value on each of its columns (kept
    # row by row; how it spread over the columns is not known)
    old = _rowwise(b, "end", "t2")
    sums = _dense_sum(c, "start", "t2")
    assert torch.equal(sums, old[:, None].expand(-1, t2.dim))
    assert "approximation" in " ".join(c.summary["optimizer_notes"])


def test_the_chain_ends_where_it_should(legs: list[Leg]) -> None:
    assert [leg.summary["end_step"] for leg in legs] == [6, 10, 12]
    assert [leg.summary["world_size"] for leg in legs] == [2, 2, 3]
