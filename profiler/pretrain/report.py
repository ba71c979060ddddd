"""How well the cost models predict: metrics, the host's drift, and the pre-training
report (text table, JSON for the model's metadata, scatter plot)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.profiler.pretrain.data import F64, FLOOR_S

# --------------------------------------------------------------------------- metrics


def _ranks(x: F64) -> F64:
    """Average ranks (ties share their mean rank), as Spearman's rho needs."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def metrics(pred: Sequence[float] | F64, true: Sequence[float] | F64) -> dict[str, float]:
    """MAPE (a fraction), R² (on seconds) and Spearman's rho; ``n`` samples."""
    p, y = np.asarray(pred, dtype=np.float64), np.asarray(true, dtype=np.float64)
    if len(y) == 0:
        return {"n": 0, "mape": math.nan, "r2": math.nan, "spearman": math.nan}
    mape = float(np.mean(np.abs(p - y) / np.maximum(y, FLOOR_S)))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - p) ** 2)) / ss_tot if ss_tot > 0 else math.nan
    if len(y) > 1:
        rp, ry = _ranks(p), _ranks(y)
        sd = float(rp.std() * ry.std())
        rho = float(np.mean((rp - rp.mean()) * (ry - ry.mean())) / sd) if sd > 0 else math.nan
    else:
        rho = math.nan
    return {"n": len(y), "mape": mape, "r2": r2, "spearman": rho}


DRIFT_BLOCK = 50


def block_drift(order: Sequence[int], pred: F64, true: F64) -> tuple[float, float] | None:
    """Lowest and highest median relative error over blocks of consecutive samples.

    Samples are measured in index order, so a block's median error that differs from
    the others' is the machine's speed at that time, not the model.
    """
    pos = np.argsort(np.asarray(order))
    ratio = np.log(pred[pos] / true[pos])
    blocks = [ratio[i : i + DRIFT_BLOCK] for i in range(0, len(ratio), DRIFT_BLOCK)]
    blocks = [b for b in blocks if len(b) >= DRIFT_BLOCK // 2]
    if len(blocks) < 3:
        return None
    medians = [math.expm1(float(np.median(b))) for b in blocks]
    return min(medians), max(medians)


# --------------------------------------------------------------------------- report


@dataclass
class PretrainReport:
    """What was trained on what, and how well it predicts data it never saw."""

    counts: dict[str, Any]
    epochs: dict[str, dict[str, Any]]
    metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    #: (panel, label) -> (predicted, measured) seconds, for the scatter plot only.
    points: dict[tuple[str, str], tuple[F64, F64]] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        out: dict[str, Any] = clean(
            {"counts": self.counts, "epochs": self.epochs, "metrics": self.metrics}
        )
        out["notes"] = list(self.notes)
        return out

    def format(self) -> str:
        """A short text table of the test metrics (CPU figures when trained on CPU)."""
        lines = [f"{'split / target':<40} {'n':>6} {'MAPE':>7} {'R²':>7} {'Spearman':>9}"]
        for name, m in self._rows():
            lines.append(
                f"{name:<40} {m['n']:>6} {_pct(m['mape']):>7} {_num(m['r2']):>7} "
                f"{_num(m['spearman']):>9}"
            )
        c = self.counts
        lines.append(
            "compute samples train/val/test: "
            f"{c['compute']['train']}/{c['compute']['val']}/{c['compute']['test']} "
            f"(test tables {c['compute']['test_tables']} of {c['compute']['tables']}, "
            f"{c['compute']['unused']} samples unused)"
            + (
                f"; the shipped network refit on all of them: train/val "
                f"{c['compute']['final']['train']}/{c['compute']['final']['val']}"
                if "final" in c["compute"]
                else ""
            )
        )
        if "comm" in c:
            cc = c["comm"]
            lines.append(
                f"comm samples train/val/test: {cc['train']}/{cc['val']}/{cc['test']}, "
                f"unseen world size {cc.get('holdout_world_size')}: {cc['holdout']}"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _rows(self) -> list[tuple[str, dict[str, Any]]]:
        rows = []
        m = self.metrics
        if "compute" in m:
            rows.append(("compute fwd+bwd, test (unseen tables)", m["compute"]["total"]))
            rows.append(("compute fwd+bwd, test, all tables unseen", m["compute"]["total_strict"]))
            rows.append(("compute fwd, test", m["compute"]["fwd"]))
            rows.append(("compute bwd, test", m["compute"]["bwd"]))
        for key, label in (
            ("comm", "comm"),
            ("comm_unseen_world", "comm, unseen world size"),
            ("comm_final", "comm (shipped, refit), test"),
        ):
            if key in m:
                for part in ("fwd", "bwd", "total"):
                    rows.append((f"{label} {part}", m[key][part]))
        return rows

    def scatter_png(self, path: str | Path) -> None:
        """Predicted vs measured seconds on log axes, one panel per model."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = sorted({p for p, _ in self.points}, key=["compute", "comm fwd", "comm bwd"].index)
        if not panels:
            raise UserError("the report has no predictions to plot.")
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.4), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            lo, hi = math.inf, 0.0
            for (p, label), (pred, true) in self.points.items():
                if p != panel or len(true) == 0:
                    continue
                ax.scatter(true, pred, s=6, alpha=0.5, label=f"{label} (n={len(true)})")
                lo = min(lo, float(true.min()), float(pred.min()))
                hi = max(hi, float(true.max()), float(pred.max()))
            if hi > 0:
                ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("measured seconds")
            ax.set_ylabel("predicted seconds")
            ax.set_title(panel)
            ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


def _num(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3f}"
