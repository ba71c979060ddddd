"""How well can *any* compute model do here? Re-measure dataset samples and compare.

    python benchmarks/compute_noise_floor.py DATASET_DIR [--samples 100] [--passes 3]

Picks ``--samples`` records (with a reference timing) of a compute dataset at random,
rebuilds their fused kernels exactly (same tables, widths, batch and index streams)
and measures each ``--passes`` times (pass after pass, so minutes apart), timing the
reference kernel right before each. Prints, side by side from one run:

- pass vs pass: the repeatability of one measurement minutes apart, raw and divided
  by the reference timed beside it — the noise in every dataset label;
- stored vs now: the original collection's figure against the median of today's
  passes, both normalized by their references;
- the cost model's MAPE against the stored figure (what the pre-training report's
  test MAPE measures) and against the median of the passes (less noisy labels);
- the same, by kernel time, since tiny kernels are the noisiest.

A model's test MAPE cannot be expected much below the pass-vs-pass figure. CPU figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.planner.costmodel import CostModel, CostPredictor, load_bundled
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, measure_compute
from shardwise.profiler.runner import reference_seconds

BUCKETS = ((0.0, 5e-4), (5e-4, 5e-3), (5e-3, 1.0))


def _shards(record: dict[str, Any]) -> list[ShardLoad]:
    return [
        ShardLoad(
            TableSpec(
                name=t["name"],
                rows=t["rows"],
                dim=t["dim"],
                pooling_factor=t["pooling_factor"],
                access_hist=tuple(t["access_hist"]),
                dtype=t["dtype"],
            ),
            t["cols"],
        )
        for t in record["tables"]
    ]


def _mape(pred: list[float], true: list[float]) -> float:
    return float(np.mean([abs(p - t) / t for p, t in zip(pred, true, strict=True)]))


def _line(label: str, pred: list[float], true: list[float]) -> None:
    parts = [f"all {_mape(pred, true):6.1%}"]
    for lo, hi in BUCKETS:
        idx = [i for i, t in enumerate(true) if lo <= t < hi]
        if idx:
            sub = _mape([pred[i] for i in idx], [true[i] for i in idx])
            parts.append(f"{lo * 1e3:g}-{hi * 1e3:g} ms (n={len(idx)}) {sub:6.1%}")
    print(f"  {label:<38} " + " | ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset", type=Path, help="dataset root (with compute/) or compute dir")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args()
    root = args.dataset / "compute" if (args.dataset / "compute").is_dir() else args.dataset
    settings = json.loads((root / "dataset.json").read_text())["settings"]
    records = [json.loads(line) for line in (root / "records.jsonl").open()]
    records = [r for r in records if r.get("extra", {}).get("reference_s", 0) > 0]
    picked = random.Random(args.seed).sample(records, min(args.samples, len(records)))
    typical = statistics.median(r["extra"]["reference_s"] for r in records)

    raw: list[list[float]] = []
    norm: list[list[float]] = []
    for p in range(args.passes):
        raw.append([])
        norm.append([])
        for k, r in enumerate(picked):
            ref = reference_seconds()
            res = measure_compute(_shards(r), r["batch_size"], seed=settings["seed"] + r["index"])
            raw[p].append(res.total_s)
            norm[p].append(res.total_s * typical / ref)
            print(f"\rpass {p + 1}/{args.passes}: {k + 1}/{len(picked)}", end="", flush=True)
    print()
    stored = [r["total_s"] * typical / r["extra"]["reference_s"] for r in picked]
    now_raw = [float(np.median(x)) for x in zip(*raw, strict=True)]
    now = [float(np.median(x)) for x in zip(*norm, strict=True)]
    model = CostModel.load(args.model) if args.model else load_bundled()
    pred = CostPredictor(model)
    got = [
        float(pred.compute([[(s.spec, s.cols) for s in _shards(r)]], r["batch_size"]).sum())
        for r in picked
    ]
    print(f"{len(picked)} samples of {root}, {args.passes} passes; CPU figures")
    _line("pass 2 vs pass 1, raw", raw[1], raw[0])
    _line("pass 2 vs pass 1, reference-normalized", norm[1], norm[0])
    _line("stored vs median of passes (normalized)", stored, now)
    drift = statistics.median(n / s for n, s in zip(now, stored, strict=True))
    print(f"  now/stored median ratio: {drift:.3f}")
    _line("model vs stored (normalized)", got, stored)
    _line("model vs median of passes (normalized)", got, now)
    _line("model vs median of passes (raw)", got, now_raw)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "index": [r["index"] for r in picked],
                    "raw": raw,
                    "norm": norm,
                    "stored": stored,
                    "model": got,
                }
            )
        )


if __name__ == "__main__":
    main()
