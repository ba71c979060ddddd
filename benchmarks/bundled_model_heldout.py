"""How well do cost models predict kernels of tables they never trained on?

    python benchmarks/bundled_model_heldout.py datasets/cpu/heldout \\
        --model old=/tmp/old.pt --model new=planner/data/costmodel-cpu.pt \\
        [--trained-on datasets/cpu/compute]

The dataset is a compute dataset from ``shardwise profile compute --tables H.yaml``
over the held-out family (``shardwise tables generate --family heldout``, built
otherwise than the pools the bundled model trains on; docs/design.md §7), measured on
this machine. Every model predicts every measured kernel (fwd, bwd, and their sum) at
the kernel's own global batch, and the script prints side by side, overall and per
batch band:

- MAPE of the prediction against the measurement, as it comes;
- MAPE after one scale factor per model and kernel (the median measured/predicted
  ratio): what a per-machine speed fit would leave, so a model trained on another
  machine is judged on shape, not on that machine's speed;
- Spearman's rho (scale-free).

A sample of a rank of several kinds (``--row-wise-share``, ``--data-parallel-share``)
counts each of its kernels apart, at the batch that kernel ran; the ``kernel group``
lines (fused table-wise/column-wise, row_wise, data_parallel) judge each kind alone.

``--trained-on`` checks that no held-out table was in a training dataset. These are
CPU figures of one machine; compare models only within one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from shardwise.planner.costmodel import CostModel, load_bundled
from shardwise.planner.kinds import FUSED_GROUP
from shardwise.profiler.calibrate.speed import predict_compute
from shardwise.profiler.dataset.store import CostDataset
from shardwise.profiler.pretrain.data import kernel_records
from shardwise.profiler.pretrain.report import metrics

#: Batch bands: the evaluator's usual batches, the middle, and the large ones.
BANDS: tuple[tuple[str, int, int], ...] = (
    ("256-4096", 1, 4096),
    ("8192-16384", 4097, 16384),
    ("32768-65536", 16385, 1 << 30),
)
KERNELS = ("fwd", "bwd", "total")
#: Below any kernel measured here (the fastest take tens of microseconds).
COLLAPSED_S = 1e-6


def pct(x: float) -> str:
    """A fraction as a percentage; a model that is off by orders of magnitude shows >999%."""
    return f"{x:.1%}" if x < 10 else ">999%"


def scaled_mape(pred: np.ndarray, true: np.ndarray) -> float:
    k = float(np.median(true / pred))
    return float(np.mean(np.abs(k * pred - true) / true))


def bases(directory: Path) -> set[str]:
    return {t["base"] for r in CostDataset.open(directory).load() for t in r["tables"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path, help="compute dataset of held-out kernels")
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        help="LABEL=PATH of a cost model, or LABEL=bundled; repeat to compare",
    )
    ap.add_argument("--trained-on", type=Path, action="append", default=[])
    args = ap.parse_args()

    records = kernel_records(CostDataset.open(args.dataset).load())
    held = {t["base"] for r in records for t in r["tables"]}
    for d in args.trained_on:
        seen = held & bases(d)
        if seen:
            raise SystemExit(f"{len(seen)} held-out tables are in {d}, e.g. {sorted(seen)[:3]}")
    fwd = np.array([r["fwd_s"] for r in records])
    bwd = np.array([r["bwd_s"] for r in records])
    true = {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}
    batch = np.array([int(r["batch_size"]) for r in records])
    group = np.array([r["tables"][0].get("group", FUSED_GROUP) for r in records])
    print(
        f"{len(records)} held-out kernels of {len(held)} tables, batches "
        f"{sorted(set(batch.tolist()))}"
        + (f"; none in {', '.join(map(str, args.trained_on))}" if args.trained_on else "")
    )
    preds: dict[str, dict[str, np.ndarray]] = {}
    for spec in args.model:
        label, _, path = spec.partition("=")
        model = load_bundled() if path == "bundled" else CostModel.load(path)
        p = predict_compute(model, records)
        preds[label] = {"fwd": p[:, 0], "bwd": p[:, 1], "total": p.sum(axis=1)}

    head = f"{'cut':<14} {'n':>4} {'kernel':<6}"
    for label in preds:
        head += f" | {label + ' MAPE':>12} {'scaled':>7} {'rho':>6}"
    print(head)
    cuts = [(band, (batch >= lo) & (batch <= hi)) for band, lo, hi in BANDS]
    cuts += [(g, group == g) for g in sorted(set(group.tolist()))]
    for band, sel in [("all", np.ones(len(records), dtype=bool)), *cuts]:
        if sel.sum() < 2:
            continue
        for kernel in KERNELS:
            y = true[kernel][sel]
            line = f"{band:<14} {int(sel.sum()):>4} {kernel:<6}"
            for label in preds:
                p = preds[label][kernel][sel]
                m = metrics(p, y)
                line += f" | {pct(m['mape']):>12} {pct(scaled_mape(p, y)):>7} {m['spearman']:>6.3f}"
            print(line)
    for label, by_kernel in preds.items():
        # A kernel takes microseconds at least: far below, the model has collapsed.
        low = int((by_kernel["total"] < COLLAPSED_S).sum())
        print(
            f"{label}: {low} of {len(records)} kernels predicted under {COLLAPSED_S * 1e6:.0f} µs"
        )


if __name__ == "__main__":
    main()
