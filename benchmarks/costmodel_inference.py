"""Cost-model inference speed: shard predictions per second, cold and cached.

    python benchmarks/costmodel_inference.py [--model M.pt] [--sets 10000] [--threads 1]

Prices ``--sets`` random candidate shard sets of 1–15 tables (augmented widths of
200 generated tables, as the search's candidates look) in one batched call with
empty caches, then the same call again (every set a cache hit), then new sets of
already-encoded tables (only the head runs). A "shard prediction" is one table or
shard priced inside a set, so a cold rate of N/s prices N/avg-set-size sets a second.
One torch thread by default: the networks are small and the work is mostly Python
bookkeeping, so a second thread only adds synchronization (measured here: 357k/s on
one thread against 168k/s on two, beside a profiler using one core).
Without ``--model`` it uses the bundled model, or an untrained one of the same shape
when none is installed (speed does not depend on the weights).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from shardwise.basics import UserError
from shardwise.planner.costmodel import CommNet, ComputeNet, CostModel, CostPredictor, load_bundled
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec


def _model(path: Path | None) -> tuple[CostModel, str]:
    if path is not None:
        return CostModel.load(path), str(path)
    try:
        return load_bundled(), "bundled"
    except UserError:
        torch.manual_seed(0)
        return CostModel(ComputeNet(), CommNet(), {}), "untrained (no bundled model)"


def _sets(n: int, seed: int) -> list[list[tuple[TableSpec, int]]]:
    tables = generate_tables(200, seed=0)
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.integers(1, 16, size=n):
        picked = rng.choice(len(tables), size=int(k), replace=False)
        out.append([(tables[i], int(rng.choice([4, 8, 16, 32, 64, 128]))) for i in picked])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--sets", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, source = _model(args.model)
    sets = _sets(args.sets, seed=1)
    fresh = _sets(args.sets, seed=2)
    shards = sum(len(s) for s in sets)
    print(
        f"model: {source}; {args.sets} sets, {shards} shards "
        f"(mean {shards / args.sets:.1f} a set); {args.threads} torch threads"
    )
    cold, warm, head_only = [], [], []
    for _ in range(args.repeats):
        pred = CostPredictor(model)
        t0 = time.perf_counter()
        pred.compute(sets, 2048)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pred.compute(sets, 2048)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pred.compute(fresh, 2048)
        head_only.append(time.perf_counter() - t0)
    fresh_shards = sum(len(s) for s in fresh)
    for label, times, n in (
        ("cold (caches cleared)", cold, shards),
        ("all cache hits", warm, shards),
        ("new sets, tables cached", head_only, fresh_shards),
    ):
        best = min(times)
        print(
            f"{label:<26} {best * 1e3:8.1f} ms  {n / best:>12,.0f} shard predictions/s  "
            f"{args.sets / best:>10,.0f} sets/s"
        )


if __name__ == "__main__":
    main()
