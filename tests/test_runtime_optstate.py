"""Optimizer state from one plan to another: row-wise blocks as rectangles, the dense
sums of data-parallel tables, the notes a load returns, partial reads through DCP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_runtime_torchrun import TORCHRUN, _env, run

from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.topology import Topology
from shardwise.runtime.checkpoint import CheckpointMeta, mapping_notes
from shardwise.runtime.optstate import (
    Block,
    column_blocks,
    dense_from_rowwise,
    merge_ranges,
    remap_block,
    rowwise_from_dense,
)

HELPER = Path(__file__).parent / "runtime_helpers" / "rowread_worker.py"
ROWS, DIM = 10, 16
#: Squared gradients of 5 steps: what every optimizer state here is made from.
G2 = torch.rand(5, ROWS, DIM, generator=torch.Generator().manual_seed(0))


def truth(block: Block) -> torch.Tensor:
    """Row-wise Adagrad's state of ``block``: per row, the sum over steps of the mean
    squared gradient over the block's columns."""
    part = G2[:, block.row_offset : block.row_end, block.col_offset : block.col_end]
    return part.mean(dim=2).sum(dim=0)


def blocks(cuts: list[tuple[int, int, int, int]]) -> list[Block]:
    """Blocks (row_offset, rows, col_offset, cols), laid end to end."""
    out, at = [], 0
    for r, n, c, w in cuts:
        out.append(Block(offset=at, row_offset=r, rows=n, col_offset=c, cols=w))
        at += n
    return out


def grid(row_parts: int, col_cuts: list[tuple[int, int]]) -> list[Block]:
    return blocks([(r, n, c, w) for c, w in col_cuts for r, n in even_row_split(ROWS, row_parts)])


def saved(old: list[Block]) -> list[tuple[Block, torch.Tensor]]:
    return [(b, truth(b)) for b in old]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (grid(1, [(0, 16)]), grid(3, [(0, 16)])),  # table-wise → row-wise
        (grid(3, [(0, 16)]), grid(4, [(0, 16)])),  # row-wise, recut
        (grid(2, [(0, 8), (8, 8)]), grid(3, [(0, 8), (8, 8)])),  # grid, rows recut
        (grid(2, [(0, 8), (8, 8)]), grid(1, [(0, 16)])),  # grid → table-wise (a merge)
        (grid(4, [(0, 4), (4, 12)]), grid(3, [(0, 16)])),  # uneven columns, merged
    ],
)
def test_remap_is_exact_for_any_row_cut_when_columns_are_kept_or_merged(
    old: list[Block], new: list[Block]
) -> None:
    pieces = saved(old)
    for b in new:
        torch.testing.assert_close(remap_block(pieces, b), truth(b), rtol=1e-6, atol=0)


def test_a_narrower_cut_takes_the_parent_value() -> None:
    pieces = saved(grid(2, [(0, 16)]))
    for b in grid(3, [(0, 4), (4, 12)]):
        parent = truth(Block(offset=0, row_offset=b.row_offset, rows=b.rows, col_offset=0, cols=16))
        torch.testing.assert_close(remap_block(pieces, b), parent, rtol=1e-6, atol=0)


def test_remap_refuses_rows_the_saved_blocks_do_not_cover() -> None:
    pieces = saved(blocks([(0, 5, 0, 16)]))
    with pytest.raises(ValueError, match="row 5, columns 0..15"):
        remap_block(pieces, Block(offset=0, row_offset=3, rows=4, col_offset=0, cols=16))
    with pytest.raises(ValueError, match="cover 8 of its 16"):
        remap_block(saved(blocks([(0, 10, 0, 8)])), grid(1, [(0, 16)])[0])


def test_data_parallel_sums_map_to_row_wise_exactly_and_back_by_row() -> None:
    sums = G2.sum(dim=0)  # dense Adagrad: the element-wise sum of squared gradients
    for b in grid(3, [(0, 4), (4, 12)]):
        rows = sums[b.row_offset : b.row_end]
        torch.testing.assert_close(
            rowwise_from_dense(rows, b, b.row_offset), truth(b), rtol=1e-6, atol=0
        )
    old = grid(2, [(0, 8), (8, 8)])
    back = dense_from_rowwise(saved(old), ROWS, DIM, torch.float32)
    for b in old:  # each block's value on each of its cells: its mean is kept
        cells = back[b.row_offset : b.row_end, b.col_offset : b.col_end]
        torch.testing.assert_close(cells.mean(dim=1), truth(b))
    with pytest.raises(ValueError, match="cover the table once"):
        dense_from_rowwise(saved(old[:3]), ROWS, DIM, torch.float32)


def test_format_1_blocks_are_the_column_shards() -> None:
    assert column_blocks(10, [(8, 8), (0, 8)]) == blocks([(0, 10, 8, 8), (0, 10, 0, 8)])
    meta = CheckpointMeta.model_validate(
        {
            "format": 1,
            "step": 4,
            "world_size": 2,
            "plan_hash": "h",
            "planner": "p",
            "reason": "final",
            "saved_at": 0.0,
            "module_path": "m",
            "tables": [
                {
                    "name": "a",
                    "rows": 10,
                    "dim": 16,
                    "dtype": "fp32",
                    "weight_key": "m.embedding_bags.a.weight",
                    "columns": [[0, 8], [8, 8]],
                    "optimizer": [
                        {"key": "a.momentum1", "kind": "rowwise", "shape": [20],
                         "columns": [[8, 8], [0, 8]]}
                    ],
                }
            ],
        }
    )  # fmt: skip
    (table,) = meta.tables
    assert table.saved_kind == "column_wise" and table.shards == []
    state = table.state("rowwise")
    assert state is not None and state.block_list(10) == column_blocks(10, [(8, 8), (0, 8)])


def _meta_of(plan: Plan) -> CheckpointMeta:
    """A format-2 description of ``plan`` as save_checkpoint writes it (row-wise blocks
    for sharded tables, the dense sums for data-parallel ones)."""
    tables = []
    for t in plan.tables:
        if t.kind == "data_parallel":
            states = [{"key": "sum", "kind": "dense", "shape": [t.rows, t.dim]}]
        else:
            cut = [(s.row_offset, s.row_count(t.rows), s.col_offset, s.cols) for s in t.shards]
            states = [
                {
                    "key": f"{t.name}.momentum1",
                    "kind": "rowwise",
                    "shape": [sum(n for _, n, _, _ in cut)],
                    "blocks": [b.model_dump() for b in blocks(cut)],
                }
            ]
        tables.append(
            {
                "name": t.name,
                "rows": t.rows,
                "dim": t.dim,
                "dtype": t.dtype,
                "weight_key": t.name,
                "columns": sorted({(s.col_offset, s.cols) for s in t.shards}),
                "kind": t.kind,
                "shards": [s.model_dump() for s in t.shards],
                "optimizer": states,
            }
        )
    return CheckpointMeta.model_validate(
        {
            "step": 1,
            "world_size": plan.world_size,
            "plan_hash": plan.hash,
            "planner": "p",
            "reason": "final",
            "saved_at": 0.0,
            "module_path": "",
            "tables": tables,
        }
    )


def _plan(kinds: dict[str, tuple[str, list[Shard]]]) -> Plan:
    tables = [
        PlanTable(name=n, rows=ROWS, dim=DIM, kind=k, shards=s)  # type: ignore[arg-type]
        for n, (k, s) in kinds.items()
    ]
    topo = Topology(gpus=2, gpu_memory_bytes=2**30)
    return Plan(world_size=2, planner="p", topology=topo, tables=tables).with_hash()


def test_notes_name_every_approximation_and_nothing_else() -> None:
    whole = [Shard(rank=0, cols=DIM)]
    halves = [Shard(rank=0, cols=8), Shard(rank=1, col_offset=8, cols=8)]
    dp = [Shard(rank=0, cols=DIM), Shard(rank=1, cols=DIM)]
    rw = [Shard(rank=r, cols=DIM, row_offset=5 * r, rows=5) for r in range(2)]
    old = _plan(
        {"a": ("column_wise", halves), "b": ("table_wise", whole), "c": ("table_wise", whole),
         "d": ("data_parallel", dp)}
    )  # fmt: skip
    new = _plan(
        {"a": ("table_wise", whole), "b": ("column_wise", halves), "c": ("data_parallel", dp),
         "d": ("row_wise", rw)}
    )  # fmt: skip
    notes = mapping_notes(_meta_of(old), new)
    assert len(notes) == 3, notes
    assert notes[0].startswith("b: columns 0..7 cut the saved column range 0..15")
    assert notes[1].startswith("b: columns 8..15 cut")
    assert notes[2].startswith("c: now data-parallel") and "approximation" in notes[2]
    assert mapping_notes(_meta_of(new), new) == []


def test_merge_ranges() -> None:
    assert merge_ranges([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]


@pytest.mark.slow
def test_a_rank_reads_only_the_rows_it_asks_for(tmp_path: Path) -> None:
    """Two gloo ranks save a 1-D and a 2-D tensor with DCP, then each reads a few row
    ranges of them: the values are right and each rank holds only what it asked for."""
    proc = run([*TORCHRUN, "--nproc_per_node=2", HELPER, tmp_path], _env(), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["ok"], report
        assert report["elements"] == report["wanted"], report
