"""Checkpoints resume across plans of any kinds, with real ``torchrun`` and the default
entry, through one run that reshards 4 → 2 → 3 ranks.

**A table larger than a rank.** The job's largest table (``big``) needs more than 3× the
memory one rank of the 4-rank plan may fill (the planner's memory rule,
``topology.usable_bytes``), so it is row-wise over every rank; the ``s*`` tables are
table-wise. The same GPUs cannot hold it on 2 or 3 ranks (2 or 3 usable shares < 3.2
of them), so the 2- and 3-rank plans are for GPUs with 2× and 4/3× the memory (a
reshard onto another node pool): there the table is still 1.6× and 2.4× one rank's
memory, and still row-wise.

**Every kind to another.** Three more tables change kind at each reshard:

- w4 (4 ranks): ``t0`` and ``t1`` table-wise, ``t2`` data-parallel;
- w2 (2 ranks): ``t0`` row-wise (from table-wise), ``t1`` column-wise, ``t2`` table-wise
  (from data-parallel);
- w3 (3 ranks): ``t0`` row-wise over 3 (from 2), ``t1`` grid (from column-wise: the
  same column ranges, now cut in rows), ``t2`` data-parallel (from table-wise).

Each leg resumes from the last one's checkpoint: it must start at the saved step + 1
(0 steps lost) with every table and dense layer equal to what was saved (gathered in
full after the save and after the load), and the optimizer state is checked against
what it must be, computed here from the saved state alone: equal where the mapping is
exact (rows recut, column ranges kept, data-parallel → row-wise), each row's mean kept
where it is not (row-wise → data-parallel). Run with ``-s`` to see the big table's
figures::

    .venv/bin/pytest -s tests/test_runtime_resume_kinds.py
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_torchrun import ENTRY, TORCHRUN, _env, run

from shardwise.planner.kinds import Kind, even_row_split
from shardwise.planner.memory import gpu_memory_to_fit, table_bytes
from shardwise.planner.plan import Plan, Shard, save_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.runtime.checkpoint import CheckpointMeta, read_meta, weight_key
from shardwise.runtime.optstate import Block

pytestmark = pytest.mark.slow

BATCH = 64
BIG = TableSpec(name="big", rows=60_000, dim=16, pooling_factor=4.0)
SMALL = [TableSpec(name=f"s{i}", rows=1000 + 500 * i, dim=16, pooling_factor=2.0) for i in range(3)]
#: The tables that change kind (small, so that they fit beside the big one's shards).
KINDS = [TableSpec(name=f"t{i}", rows=100 * (i + 2), dim=16, pooling_factor=2.0) for i in range(3)]
SPECS = [BIG, *SMALL, *KINDS]
#: The big table's memory over one rank's usable memory in the 4-rank plan.
RATIO = 3.2
#: Each leg trains to this step: (world size, step).
LEGS = ((4, 4), (2, 6), (3, 8))
_SAVED = re.compile(r"checkpoint \S+ \((\w+)\) in ([\d.]+) s")


def rows(n: int, ranks: list[int], cols: int, col_offset: int = 0) -> list[Shard]:
    """TorchRec's even row cut of ``n`` rows over ``ranks`` (one column range)."""
    return [
        Shard(rank=r, col_offset=col_offset, cols=cols, row_offset=o, rows=k)
        for r, (o, k) in zip(ranks, even_row_split(n, len(ranks)), strict=True)
    ]


def kinds_for(world: int) -> tuple[list[list[Shard]], list[Kind]]:
    """The ``t*`` tables' shards and kinds on ``world`` ranks (the module docstring)."""
    t0, t1, t2 = KINDS
    if world == 4:
        dp = [Shard(rank=r, cols=t2.dim) for r in range(4)]
        return [[Shard(rank=0, cols=t0.dim)], [Shard(rank=0, cols=t1.dim)], dp], [
            "table_wise",
            "table_wise",
            "data_parallel",
        ]
    if world == 2:
        cw = [Shard(rank=1, cols=8), Shard(rank=0, col_offset=8, cols=t1.dim - 8)]
        return [rows(t0.rows, [0, 1], t0.dim), cw, [Shard(rank=1, cols=t2.dim)]], [
            "row_wise",
            "column_wise",
            "table_wise",
        ]
    grid = rows(t1.rows, [0, 1, 2], 8) + rows(t1.rows, [0, 1, 2], t1.dim - 8, 8)
    dp = [Shard(rank=r, cols=t2.dim) for r in range(3)]
    return [rows(t0.rows, [0, 1, 2], t0.dim), grid, dp], ["row_wise", "grid", "data_parallel"]


def plan_for(world: int, memory_scale: float) -> Plan:
    """The big table row-wise over every rank (TorchRec's even cut), the ``s*`` tables
    table-wise on the last ranks, the ``t*`` tables as :func:`kinds_for` says, on GPUs
    of ``memory_scale`` × the 4-rank plan's."""
    base = Topology(gpus=4, gpu_memory_bytes=2**30, device="cpu", batch_size_per_rank=BATCH)
    usable = int(table_bytes(BIG, base) / RATIO)
    topo = base.model_copy(
        update={
            "gpus": world,
            "gpu_memory_bytes": gpu_memory_to_fit(int(usable * memory_scale), base),
        }
    )
    big = [
        Shard(rank=r, cols=BIG.dim, row_offset=o, rows=n)
        for r, (o, n) in enumerate(even_row_split(BIG.rows, world))
    ]
    small = [[Shard(rank=world - 1 - i % world, cols=t.dim)] for i, t in enumerate(SMALL)]
    shards, kinds = kinds_for(world)
    plan = Plan.from_shards(
        SPECS,
        [big, *small, *shards],
        topo,
        "test",
        kinds=["row_wise", *[None] * len(SMALL), *kinds],
    )
    assert plan.problems(SPECS, require_hash=True) == [], plan.problems(SPECS)
    return plan


@dataclass
class Leg:
    world_size: int
    plan: Plan
    summary: dict[str, Any]
    start: dict[str, Any]  # the exported state before the first step (after the resume)
    end: dict[str, Any]  # ... and after the last step
    meta: CheckpointMeta  # its last checkpoint's description, read before the next prunes it
    save_seconds: float  # its final checkpoint's save
    wall_seconds: float  # the whole run, start-up included


def leg(d: Path, name: str, plan: Plan, steps: int) -> Leg:
    save_plan(plan, d / f"{name}.json")
    cmd = [
        *TORCHRUN, f"--nproc_per_node={plan.world_size}", *ENTRY,
        "--tables", "tables.yaml", "--batch-size", str(BATCH), "--steps", str(steps),
        "--checkpoint-dir", "ckpt", "--measure-every", "0", "--log-every", "0",
        "--export-start", f"{name}_start.pt", "--export-end", f"{name}_end.pt",
        "--summary", f"{name}.json",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = run(cmd, _env(SHARDWISE_PLAN=str(d / f"{name}.json")), d, timeout=300)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads((d / f"{name}.json").read_text())
    saves = [float(s) for reason, s in _SAVED.findall(proc.stdout) if reason == "final"]
    assert saves, proc.stdout[-4000:]
    return Leg(
        plan.world_size,
        plan,
        summary,
        torch.load(d / f"{name}_start.pt"),
        torch.load(d / f"{name}_end.pt"),
        read_meta(d / summary["checkpoints"][-1]),
        saves[-1],
        wall,
    )


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> list[Leg]:
    d = tmp_path_factory.mktemp("resume_kinds")
    save_tables(SPECS, d / "tables.yaml")
    scale = {4: 1.0, 2: 2.0, 3: 4 / 3}
    return [leg(d, f"w{world}", plan_for(world, scale[world]), step) for world, step in LEGS]


def _blocks(leg: Leg, name: str) -> list[Block]:
    """The row-wise state's blocks of ``name`` in ``leg``'s plan, from its checkpoint."""
    table = next(t for t in leg.meta.tables if t.name == name)
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


def _rowwise(leg: Leg, which: str, name: str) -> torch.Tensor:
    state = leg.start if which == "start" else leg.end
    return state["embedding_optimizer"][weight_key(name)][f"{name}.momentum1"]


def _dense_sum(leg: Leg, which: str, name: str) -> torch.Tensor:
    state = leg.start if which == "start" else leg.end
    return state["dense_optimizer"][weight_key(name)]["sum"]


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


def _kinds(leg: Leg, names: tuple[str, ...] = ("t0", "t1", "t2")) -> dict[str, str]:
    return {t.name: t.kind for t in leg.meta.tables if t.name in names}


# --------------------------------------------------------------------------- every kind


def test_table_wise_to_row_wise_and_data_parallel_to_table_wise(legs: list[Leg]) -> None:
    a, b, _ = legs
    _resumed(a, b)
    t0 = KINDS[0]
    # t0: table-wise → row-wise over 2 ranks: the same state, row by row (exact)
    old = spread(_blocks(a, "t0"), _rowwise(a, "end", "t0"), t0.rows, t0.dim)
    new = spread(_blocks(b, "t0"), _rowwise(b, "start", "t0"), t0.rows, t0.dim)
    assert float(old.sum()) > 0 and torch.equal(old, new)
    # t2: data-parallel → table-wise: each row's mean of the Adagrad sums (exact)
    sums = _dense_sum(a, "end", "t2")
    assert float(sums.sum()) > 0 and weight_key("t2") not in b.start["dense_optimizer"]
    torch.testing.assert_close(_rowwise(b, "start", "t2"), sums.mean(dim=1), rtol=1e-6, atol=0)
    assert _kinds(a) == {"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel"}
    assert _kinds(b) == {"t0": "row_wise", "t1": "column_wise", "t2": "table_wise"}
    assert next(t for t in a.meta.tables if t.name == "t2").state("dense") is not None


def test_row_wise_at_two_ranks_to_three_and_column_wise_to_grid(legs: list[Leg]) -> None:
    _, b, c = legs
    _resumed(b, c)
    t0, t1, t2 = KINDS
    for t in (t0, t1):  # rows recut, column ranges kept: exact
        old = spread(_blocks(b, t.name), _rowwise(b, "end", t.name), t.rows, t.dim)
        new = spread(_blocks(c, t.name), _rowwise(c, "start", t.name), t.rows, t.dim)
        assert float(old.sum()) > 0 and torch.equal(old, new), t.name
    assert len(_blocks(c, "t1")) == 6  # 2 column ranges x 3 row ranges
    layout = {t.name: t for t in c.meta.tables}
    assert [s.row_offset for s in layout["t0"].shards] == [o for o, _ in even_row_split(t0.rows, 3)]
    assert _kinds(c) == {"t0": "row_wise", "t1": "grid", "t2": "data_parallel"}
    # t2: table-wise → data-parallel: each row's value on each of its columns (kept
    # row by row; how it spread over the columns is not known)
    old = _rowwise(b, "end", "t2")
    sums = _dense_sum(c, "start", "t2")
    assert torch.equal(sums, old[:, None].expand(-1, t2.dim))
    assert "approximation" in " ".join(c.summary["optimizer_notes"])


def test_the_chain_ends_where_it_should(legs: list[Leg]) -> None:
    assert [leg.summary["end_step"] for leg in legs] == [step for _, step in LEGS]
    assert [leg.summary["world_size"] for leg in legs] == [world for world, _ in LEGS]
    assert [leg.meta.world_size for leg in legs] == [world for world, _ in LEGS]


# --------------------------------------------------------------------------- a big table


def test_a_table_three_times_a_rank_trains_row_wise_and_reshards_4_2_3(legs: list[Leg]) -> None:
    for plan in (leg.plan for leg in legs):
        need = table_bytes(BIG, plan.topology)
        assert need > plan.topology.usable_bytes  # no rank holds it: row-wise is a must
    four = legs[0].plan.topology
    assert table_bytes(BIG, four) >= 3 * four.usable_bytes
    assert [leg.world_size for leg in legs] == [4, 2, 3]
    assert all(_kinds(leg, ("big",)) == {"big": "row_wise"} for leg in legs)
    out = [
        f"big table {table_bytes(BIG, four) / four.usable_bytes:.2f}x one rank's usable "
        f"memory in the 4-rank plan ({table_bytes(BIG, four)} B vs {four.usable_bytes} B)"
    ]
    first = legs[0].summary
    assert (first["start_step"], first["end_step"]) == (0, LEGS[0][1])
    out.append(f"4 ranks: steps 1-{LEGS[0][1]}, final save {legs[0].save_seconds:.2f} s")
    for before, after in itertools.pairwise(legs):
        s = after.summary
        assert s["resumed_world_size"] == before.world_size
        assert s["start_step"] == before.summary["end_step"]
        assert s["losses"][0][0] == s["start_step"] + 1  # 0 steps lost
        diff = max(
            float((value - after.start["model"][key]).abs().max())
            for key, value in before.end["model"].items()
        )
        assert diff == 0.0
        assert before.end["model"].keys() == after.start["model"].keys()
        old = spread(
            _blocks(before, BIG.name), _rowwise(before, "end", BIG.name), BIG.rows, BIG.dim
        )
        new = spread(
            _blocks(after, BIG.name), _rowwise(after, "start", BIG.name), BIG.rows, BIG.dim
        )
        assert float(old.sum()) > 0 and torch.equal(old, new)
        changed = not torch.equal(
            after.end["model"][weight_key(BIG.name)], after.start["model"][weight_key(BIG.name)]
        )
        assert changed  # it trained on
        out.append(
            f"{before.world_size} -> {after.world_size} ranks: resumed at step "
            f"{s['start_step'] + 1} (saved {s['start_step']}, 0 steps lost), weights max "
            f"|diff| {diff:g}, row-wise state equal; reshard = save {before.save_seconds:.2f} s "
            f"+ load {s['load_seconds']:.2f} s; the new world's whole run "
            f"{after.wall_seconds:.1f} s (start-up included)"
        )
    print("\n" + "\n".join(out))
