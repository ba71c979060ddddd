"""A table larger than a rank: trained row-wise on 4 CPU ranks, then resharded 4 → 2 → 3.

The job's largest table needs more than 3× the memory one rank of the 4-rank plan may
fill (the planner's memory rule, ``topology.usable_bytes``), so it is row-wise over
every rank; the other tables are table-wise. The same GPUs cannot hold it on 2 or 3
ranks (2 or 3 usable shares < 3.2 of them), so the 2- and 3-rank plans are for GPUs
with 2× and 4/3× the memory (a reshard onto another node pool): there the table is
still 1.6× and 2.4× one rank's memory, and still row-wise.

Each leg is the worker image's entry under ``torchrun`` resuming from the last one's
checkpoint: it must start at the saved step + 1 (0 steps lost) with every table equal
to the saved one (gathered in full after the save and after the load) and the big
table's row-wise Adagrad state equal row by row (rows recut, columns kept: exact).
Run with ``-s`` to see the figures::

    .venv/bin/pytest -s tests/test_runtime_big_table.py
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

from shardwise.planner.kinds import even_row_split
from shardwise.planner.memory import gpu_memory_to_fit, table_bytes
from shardwise.planner.plan import Plan, Shard, save_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.runtime.checkpoint import read_meta, weight_key

pytestmark = pytest.mark.slow

BATCH = 64
BIG = TableSpec(name="big", rows=60_000, dim=16, pooling_factor=4.0)
SMALL = [TableSpec(name=f"s{i}", rows=1000 + 500 * i, dim=16, pooling_factor=2.0) for i in range(3)]
#: The big table's memory over one rank's usable memory in the 4-rank plan.
RATIO = 3.2
_SAVED = re.compile(r"checkpoint \S+ \((\w+)\) in ([\d.]+) s")


def plan_for(world: int, memory_scale: float) -> Plan:
    """The big table row-wise over every rank (TorchRec's even cut), the small ones
    table-wise on the last ranks, on GPUs of ``memory_scale`` × the 4-rank plan's."""
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
    plan = Plan.from_shards(
        [BIG, *SMALL], [big, *small], topo, "test", kinds=["row_wise", *[None] * len(SMALL)]
    )
    assert plan.problems([BIG, *SMALL], require_hash=True) == [], plan.problems([BIG, *SMALL])
    return plan


@dataclass
class Leg:
    world: int
    plan: Plan
    summary: dict[str, Any]
    start: dict[str, Any]
    end: dict[str, Any]
    blocks: list[Any]
    save_seconds: float
    wall_seconds: float


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
    meta = read_meta(d / summary["checkpoints"][-1])
    big = next(t for t in meta.tables if t.name == BIG.name)
    state = next(s for s in big.optimizer if s.kind == "rowwise")
    saves = [float(s) for reason, s in _SAVED.findall(proc.stdout) if reason == "final"]
    return Leg(
        plan.world_size,
        plan,
        summary,
        torch.load(d / f"{name}_start.pt"),
        torch.load(d / f"{name}_end.pt"),
        state.blocks,
        saves[-1],
        wall,
    )


def spread(leg: Leg, which: str) -> torch.Tensor:
    """The big table's row-wise state as a table (each row's value on its columns)."""
    vector = (leg.start if which == "start" else leg.end)["embedding_optimizer"][
        weight_key(BIG.name)
    ][f"{BIG.name}.momentum1"]
    out = torch.full((BIG.rows, BIG.dim), float("nan"))
    for b in leg.blocks:
        out[b.row_offset : b.row_end, b.col_offset : b.col_end] = vector[
            b.offset : b.offset + b.rows, None
        ]
    return out


def test_a_table_three_times_a_rank_trains_row_wise_and_reshards_4_2_3(tmp_path: Path) -> None:
    save_tables([BIG, *SMALL], tmp_path / "tables.yaml")
    plans = [plan_for(4, 1.0), plan_for(2, 2.0), plan_for(3, 4 / 3)]
    for plan in plans:
        need = table_bytes(BIG, plan.topology)
        assert need > plan.topology.usable_bytes  # no rank holds it: row-wise is a must
    four = plans[0].topology
    assert table_bytes(BIG, four) >= 3 * four.usable_bytes
    legs = [leg(tmp_path, "w4", plans[0], 4), leg(tmp_path, "w2", plans[1], 6)]
    legs.append(leg(tmp_path, "w3", plans[2], 8))
    rows = [
        f"big table {table_bytes(BIG, four) / four.usable_bytes:.2f}x one rank's usable "
        f"memory in the 4-rank plan ({table_bytes(BIG, four)} B vs {four.usable_bytes} B)"
    ]
    first = legs[0].summary
    assert (first["start_step"], first["end_step"]) == (0, 4)
    rows.append(f"4 ranks: steps 1-4, final save {legs[0].save_seconds:.2f} s")
    for before, after in itertools.pairwise(legs):
        s = after.summary
        assert s["resumed_world_size"] == before.world
        assert s["start_step"] == before.summary["end_step"]
        assert s["losses"][0][0] == s["start_step"] + 1  # 0 steps lost
        diff = max(
            float((value - after.start["model"][key]).abs().max())
            for key, value in before.end["model"].items()
        )
        assert diff == 0.0
        assert before.end["model"].keys() == after.start["model"].keys()
        old, new = spread(before, "end"), spread(after, "start")
        assert float(old.sum()) > 0 and torch.equal(old, new)
        changed = not torch.equal(
            after.end["model"][weight_key(BIG.name)], after.start["model"][weight_key(BIG.name)]
        )
        assert changed  # it trained on
        rows.append(
            f"{before.world} -> {after.world} ranks: resumed at step {s['start_step'] + 1} "
            f"(saved {s['start_step']}, 0 steps lost), weights max |diff| {diff:g}, "
            f"row-wise state equal; reshard = save {before.save_seconds:.2f} s + load "
            f"{s['load_seconds']:.2f} s; the new world's whole run {after.wall_seconds:.1f} s "
            f"(start-up included)"
        )
    print("\n" + "\n".join(rows))
