"""Pre-training the cost models on profiler datasets (design §7, ``shardwise pretrain``).

Input: a directory holding ``compute/`` (required) and ``comm/`` cost datasets (or
a compute dataset itself). Output: a :class:`~shardwise.planner.costmodel.CostModel`
and a :class:`PretrainReport` with test-split metrics.

**Compute split, by table.** Augmented tables are grouped by ``TableFeatures.base``
(``t-d4`` … ``t-d128`` are one table) and the *base* tables are shuffled by the seed;
``TEST_TABLE_SHARE`` of them become test tables. A sample trains only if *all* its
tables are training tables; every sample holding at least one test table is a test
sample, so no test table is ever seen in training (its width variants included). The
validation split (early stopping) is a seeded share of the training-eligible samples.
Why not three disjoint table pools with "all tables of a sample in one pool": the
profiler draws 1–15 tables from the whole pool, so a sample whose tables all fall in
a 15 % pool has 1–2 tables (0.15^T), and the test set would measure single tables only. The
report also gives the metrics on the strict subset (every table unseen).

**Comm split, by sample,** with one world size (``holdout_world_size``, default 8)
held out entirely: the first model is trained without it and its metrics on that
world size are the honest generalization figure. The shipped comm model is then
re-fitted with that world size's samples added (same split shares), because the
evaluator runs such plans; the report shows both (``comm`` / ``comm_unseen_world``
for the first model, ``comm_final`` for the shipped one).

Training: Adam on the mean squared error of log-seconds, minibatches, early stopping
on the validation loss (best weights kept), deterministic for a seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

import shardwise
from shardwise.planner.costmodel import (
    FORMAT_VERSION,
    RANK_FEATURES,
    SET_FEATURES,
    TABLE_FEATURES,
    CommNet,
    ComputeNet,
    CostModel,
    Normalizer,
    comm_seconds,
    rank_features,
    set_features,
    table_features,
)
from shardwise.planner.errors import UserError
from shardwise.profiler.dataset import MANIFEST_FILE, CostDataset
from shardwise.profiler.fingerprint import Fingerprint

TEST_TABLE_SHARE = 0.10
VAL_SAMPLE_SHARE = 0.15
COMM_SPLIT = (0.70, 0.15, 0.15)
MIN_COMPUTE_SAMPLES = 40
MIN_COMM_SAMPLES = 20
#: Fewest samples a split may hold: below this its metrics are noise.
MIN_SPLIT = 5
DEFAULT_MAX_EPOCHS = 400
DEFAULT_PATIENCE = 40
_FLOOR_S = 1e-7  # measured zeros (never seen, but possible) become 0.1 µs in logs

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class EpochProgress:
    """Passed to ``on_epoch`` after every epoch (the CLI's progress bar)."""

    model: str  # "compute", "comm" or "comm-final"
    epoch: int
    max_epochs: int
    train_loss: float
    val_loss: float
    best_val_loss: float


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
    mape = float(np.mean(np.abs(p - y) / np.maximum(y, _FLOOR_S)))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - p) ** 2)) / ss_tot if ss_tot > 0 else math.nan
    if len(y) > 1:
        rp, ry = _ranks(p), _ranks(y)
        sd = float(rp.std() * ry.std())
        rho = float(np.mean((rp - rp.mean()) * (ry - ry.mean())) / sd) if sd > 0 else math.nan
    else:
        rho = math.nan
    return {"n": len(y), "mape": mape, "r2": r2, "spearman": rho}


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


# --------------------------------------------------------------------------- data


def _dataset_dirs(root: Path) -> tuple[Path, Path | None]:
    if (root / MANIFEST_FILE).exists():
        ds = CostDataset.open(root)
        if ds.kind != "compute":
            raise UserError(
                f"{root} is a {ds.kind} dataset; pre-training needs a compute dataset "
                "(DIR/compute, optionally with DIR/comm)."
            )
        return root, None
    compute = root / "compute"
    if not (compute / MANIFEST_FILE).exists():
        raise UserError(
            f"{root} holds no compute dataset ({compute} is missing or not a dataset). "
            "Collect one with `shardwise profile compute --out "
            f"{compute}` (and `shardwise profile comm --out {root / 'comm'}`)."
        )
    comm = root / "comm"
    return compute, comm if (comm / MANIFEST_FILE).exists() else None


def _one_fingerprint(ds: CostDataset, records: list[dict[str, Any]]) -> None:
    keys = {str(r["fingerprint"]) for r in records} | set(ds.manifest.fingerprints)
    keys.add(ds.manifest.fingerprint_key)
    if len(keys) > 1:
        described = [
            Fingerprint.from_dict(fp).describe() for fp in ds.manifest.fingerprints.values()
        ]
        raise UserError(
            f"{ds.directory} mixes measurements from {len(keys)} hardware/software "
            f"fingerprints ({', '.join(sorted(keys))}: {'; '.join(described) or 'unknown'}). "
            "A cost model must be trained on one machine type: profile into a fresh "
            "directory on one kind of machine."
        )


def _check_same_hardware(compute: CostDataset, comm: CostDataset) -> None:
    a, b = compute.fingerprint, comm.fingerprint
    if not a.matches(b):
        raise UserError(
            f"{compute.directory} and {comm.directory} come from different hardware: "
            f"compute {a.describe()}, comm {b.describe()} "
            f"(differs in {', '.join(f for f, _, _ in a.differences(b))}). "
            "Profile both on the same kind of machine."
        )


@dataclass
class _ComputeData:
    tables: torch.Tensor  # [N, T, F]
    mask: torch.Tensor  # [N, T]
    sets: torch.Tensor  # [N, S]
    y: torch.Tensor  # [N, 2] log seconds
    bases: list[set[str]]
    batch_sizes: list[int]

    def take(self, idx: Sequence[int]) -> tuple[torch.Tensor, ...]:
        i = torch.tensor(list(idx), dtype=torch.long)
        return self.tables[i], self.mask[i], self.sets[i], self.y[i]


def drift_factors(records: list[dict[str, Any]]) -> list[float] | None:
    """Per-record factors that bring each sample to the median machine speed.

    The profiler times a fixed reference kernel every few samples
    (``extra.reference_s``); a sample measured while the reference ran 20 % slow is
    scaled down by 20 %. ``None`` when the records carry no reference.
    """
    refs = [float(r.get("extra", {}).get("reference_s", 0.0)) for r in records]
    if not all(x > 0 for x in refs):
        return None
    typical = float(np.median(refs))
    return [typical / x for x in refs]


def _compute_data(records: list[dict[str, Any]]) -> _ComputeData:
    tmax = max(len(r["tables"]) for r in records)
    n, f = len(records), len(TABLE_FEATURES)
    tables = np.zeros((n, tmax, f), dtype=np.float32)
    mask = np.zeros((n, tmax), dtype=np.float32)
    sets = np.zeros((n, len(SET_FEATURES)), dtype=np.float32)
    y = np.zeros((n, 2), dtype=np.float32)
    factors = drift_factors(records) or [1.0] * n
    for i, r in enumerate(records):
        b = int(r["batch_size"])
        for j, t in enumerate(r["tables"]):
            tables[i, j] = table_features(
                t["access_hist"], t["cols"], t["pooling_factor"], t["rows"], t["dtype"], b
            )
            mask[i, j] = 1.0
        sets[i] = set_features(b, len(r["tables"]))
        k = factors[i]
        y[i] = [math.log(max(k * r["fwd_s"], _FLOOR_S)), math.log(max(k * r["bwd_s"], _FLOOR_S))]
    return _ComputeData(
        torch.from_numpy(tables),
        torch.from_numpy(mask),
        torch.from_numpy(sets),
        torch.from_numpy(y),
        [{t["base"] for t in r["tables"]} for r in records],
        [int(r["batch_size"]) for r in records],
    )


@dataclass
class _CommData:
    ranks: torch.Tensor  # [N, W, F]
    mask: torch.Tensor  # [N, W]
    wait: torch.Tensor  # [N, W] seconds
    y: torch.Tensor  # [N, W, 2] log seconds
    world: list[int]

    def take(self, idx: Sequence[int]) -> tuple[torch.Tensor, ...]:
        i = torch.tensor(list(idx), dtype=torch.long)
        return self.ranks[i], self.mask[i], self.wait[i], self.y[i]


def _comm_data(records: list[dict[str, Any]]) -> _CommData:
    wmax = max(int(r["world_size"]) for r in records)
    n = len(records)
    ranks = np.zeros((n, wmax, len(RANK_FEATURES)), dtype=np.float32)
    mask = np.zeros((n, wmax), dtype=np.float32)
    wait = np.zeros((n, wmax), dtype=np.float32)
    y = np.zeros((n, wmax, 2), dtype=np.float32)
    for i, r in enumerate(records):
        w = int(r["world_size"])
        ranks[i, :w] = rank_features(r["dims"], r["delays_s"], int(r["batch_size"]))
        mask[i, :w] = 1.0
        d = np.asarray(r["delays_s"])
        wait[i, :w] = d.max() - d
        y[i, :w, 0] = np.log(np.maximum(r["fwd_s"], _FLOOR_S))
        y[i, :w, 1] = np.log(np.maximum(r["bwd_s"], _FLOOR_S))
    return _CommData(
        torch.from_numpy(ranks),
        torch.from_numpy(mask),
        torch.from_numpy(wait),
        torch.from_numpy(y),
        [int(r["world_size"]) for r in records],
    )


DRIFT_BLOCK = 50


def _drift(order: Sequence[int], pred: F64, true: F64) -> tuple[float, float] | None:
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


# --------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class ComputeSplit:
    train: list[int]
    val: list[int]
    test: list[int]
    test_strict: list[int]  # test samples whose every table is a test table
    train_tables: list[str]
    test_tables: list[str]
    unused: int = 0


def split_compute(bases: Sequence[set[str]], seed: int) -> ComputeSplit:
    """The by-table split of the module docstring, deterministic for ``seed``."""
    names = sorted(set().union(*bases))
    order = np.random.default_rng(seed).permutation(len(names))
    n_test = max(1, round(TEST_TABLE_SHARE * len(names))) if len(names) > 1 else 0
    test_tables = {names[i] for i in order[:n_test]}
    eligible = [i for i, b in enumerate(bases) if not (b & test_tables)]
    test = [i for i, b in enumerate(bases) if b & test_tables]
    strict = [i for i in test if bases[i] <= test_tables]
    shuffled = [eligible[i] for i in np.random.default_rng(seed + 1).permutation(len(eligible))]
    n_val = round(VAL_SAMPLE_SHARE * len(shuffled))
    return ComputeSplit(
        train=sorted(shuffled[n_val:]),
        val=sorted(shuffled[:n_val]),
        test=test,
        test_strict=strict,
        train_tables=sorted(set(names) - test_tables),
        test_tables=sorted(test_tables),
    )


def _split_samples(idx: Sequence[int], seed: int) -> tuple[list[int], list[int], list[int]]:
    perm = [idx[i] for i in np.random.default_rng(seed).permutation(len(idx))]
    n_tr = round(COMM_SPLIT[0] * len(perm))
    n_va = round(COMM_SPLIT[1] * len(perm))
    return sorted(perm[:n_tr]), sorted(perm[n_tr : n_tr + n_va]), sorted(perm[n_tr + n_va :])


# --------------------------------------------------------------------------- training

LossFn = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def _compute_loss(net: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tables, mask, sets, y = batch
    pred: torch.Tensor = net(tables, mask, sets)
    return ((pred - y) ** 2).sum(dim=1).mean()


def _comm_loss(net: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ranks, mask, wait, y = batch
    out = net(ranks, mask)
    fwd, bwd = comm_seconds(out, wait)
    err = (torch.log(fwd) - y[..., 0]) ** 2 + (torch.log(bwd) - y[..., 1]) ** 2
    return (err * mask).sum() / mask.sum().clamp(min=1.0)


def _fit(
    net: nn.Module,
    loss_fn: LossFn,
    train: tuple[torch.Tensor, ...],
    val: tuple[torch.Tensor, ...],
    *,
    name: str,
    seed: int,
    max_epochs: int,
    patience: int,
    batch_size: int,
    lr: float,
    on_epoch: Callable[[EpochProgress], None] | None,
) -> dict[str, Any]:
    """Adam with early stopping on the validation loss; keeps the best weights."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    n = train[0].shape[0]
    best, best_epoch, best_state = math.inf, 0, None
    epoch = 0
    for epoch in range(1, max_epochs + 1):
        net.train()
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            loss = loss_fn(net, tuple(t[idx] for t in train))
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.detach()) * len(idx)
        net.eval()
        with torch.no_grad():
            val_loss = float(loss_fn(net, val))
        if val_loss < best - 1e-6:
            best, best_epoch = val_loss, epoch
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if on_epoch:
            on_epoch(EpochProgress(name, epoch, max_epochs, total / n, val_loss, best))
        if epoch - best_epoch >= patience:
            break
    if best_state is not None:
        net.load_state_dict(best_state)
    net.eval()
    return {
        "epochs": epoch,
        "best_epoch": best_epoch,
        "stopped_early": epoch < max_epochs,
        "best_val_loss": best,
    }


def _predict_compute(net: ComputeNet, batch: tuple[torch.Tensor, ...]) -> F64:
    with torch.no_grad():
        out: F64 = torch.exp(net(*batch[:3])).double().numpy()
    return out


def _predict_comm(net: CommNet, batch: tuple[torch.Tensor, ...]) -> tuple[F64, F64, F64, F64]:
    """Per real rank, flattened: predicted fwd, bwd and measured fwd, bwd seconds."""
    ranks, mask, wait, y = batch
    with torch.no_grad():
        fwd, bwd = comm_seconds(net(ranks, mask).double(), wait.double())
    m = mask.bool()
    true = torch.exp(y.double())
    return (
        fwd[m].numpy(),
        bwd[m].numpy(),
        true[..., 0][m].numpy(),
        true[..., 1][m].numpy(),
    )


def _comm_metrics(net: CommNet, batch: tuple[torch.Tensor, ...]) -> tuple[dict[str, Any], F64]:
    pf, pb, tf, tb = _predict_comm(net, batch)
    return {
        "fwd": metrics(pf, tf),
        "bwd": metrics(pb, tb),
        "total": metrics(pf + pb, tf + tb),
    }, np.stack([pf, pb, tf, tb])


# --------------------------------------------------------------------------- pretrain


def pretrain(
    dataset_root: Path,
    *,
    seed: int = 0,
    max_epochs: int = DEFAULT_MAX_EPOCHS,
    patience: int = DEFAULT_PATIENCE,
    holdout_world_size: int | None = 8,
    on_epoch: Callable[[EpochProgress], None] | None = None,
    tiny: bool = False,
) -> tuple[CostModel, PretrainReport]:
    """Train both cost models on ``dataset_root``; see the module docstring.

    ``tiny`` trains small networks (for CI and tests); the split and the report are
    the same. Training runs on one thread: the networks are small, a second thread
    mostly adds synchronization, and a profiler may be measuring on the other core.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _pretrain(
            Path(dataset_root),
            seed=seed,
            max_epochs=max_epochs,
            patience=patience,
            holdout_world_size=holdout_world_size,
            on_epoch=on_epoch,
            tiny=tiny,
        )
    finally:
        torch.set_num_threads(threads)


def _pretrain(
    root: Path,
    *,
    seed: int,
    max_epochs: int,
    patience: int,
    holdout_world_size: int | None,
    on_epoch: Callable[[EpochProgress], None] | None,
    tiny: bool,
) -> tuple[CostModel, PretrainReport]:
    compute_dir, comm_dir = _dataset_dirs(root)
    cds = CostDataset.open(compute_dir)
    crecs = cds.load()
    _one_fingerprint(cds, crecs)
    # Samples measured before the profiler timed a reference kernel cannot be
    # drift-normalized; when enough newer ones exist, train on those alone.
    with_reference = [r for r in crecs if r.get("extra", {}).get("reference_s", 0.0) > 0]
    dropped = len(crecs) - len(with_reference)
    if with_reference and dropped and len(with_reference) >= MIN_COMPUTE_SAMPLES:
        crecs = with_reference
    mds: CostDataset | None = None
    mrecs: list[dict[str, Any]] = []
    if comm_dir is not None:
        mds = CostDataset.open(comm_dir)
        mrecs = mds.load()
        _one_fingerprint(mds, mrecs)
        _check_same_hardware(cds, mds)
    if len(crecs) < MIN_COMPUTE_SAMPLES:
        raise UserError(
            f"{compute_dir} has {len(crecs)} compute samples; pre-training needs at least "
            f"{MIN_COMPUTE_SAMPLES} (thousands for a useful model). Collect more with "
            "`shardwise profile compute` (it resumes where it stopped)."
        )
    if mds is not None and len(mrecs) < MIN_COMM_SAMPLES:
        raise UserError(
            f"{mds.directory} has {len(mrecs)} all-to-all samples; pre-training needs at "
            f"least {MIN_COMM_SAMPLES}. Collect more with `shardwise profile comm`."
        )

    torch.manual_seed(seed)
    hidden = 16 if tiny else 64
    batch = 64 if tiny else 256
    lr = 1e-2 if tiny else 3e-3
    notes: list[str] = []
    if drift_factors(crecs) is not None:
        notes.append(
            "compute costs are normalized to the median machine speed with the reference "
            "kernel timed beside the samples"
            + (f" ({dropped} older samples without one were left out)" if dropped else "")
        )
    points: dict[tuple[str, str], tuple[F64, F64]] = {}
    epochs: dict[str, dict[str, Any]] = {}
    report_metrics: dict[str, Any] = {}

    # ---- compute
    cdata = _compute_data(crecs)
    split = split_compute(cdata.bases, seed)
    for part in ("train", "val", "test"):
        got = len(getattr(split, part))
        if got < MIN_SPLIT:
            raise UserError(
                f"{compute_dir}: the by-table split leaves {got} {part} samples "
                f"(of {len(crecs)} over {len(split.train_tables) + len(split.test_tables)} "
                f"tables); at least {MIN_SPLIT} are needed. Collect more samples or "
                "profile over more tables."
            )
    cnet = ComputeNet(hidden=hidden)
    train = cdata.take(split.train)
    # At least ~10 steps an epoch, so small datasets still train in few epochs.
    cbatch = min(batch, max(32, len(split.train) // 10))
    cnet.table_norm = Normalizer.fit(
        train[0][train[1].bool()].numpy()  # real tables only, not padding
    )
    cnet.set_norm = Normalizer.fit(train[2].numpy())
    epochs["compute"] = _fit(
        cnet,
        _compute_loss,
        train,
        cdata.take(split.val),
        name="compute",
        seed=seed,
        max_epochs=max_epochs,
        patience=patience,
        batch_size=cbatch,
        lr=lr,
        on_epoch=on_epoch,
    )
    test = cdata.take(split.test)
    pred = _predict_compute(cnet, test)
    true = torch.exp(test[3].double()).numpy()
    strict_pos = [split.test.index(i) for i in split.test_strict]
    report_metrics["compute"] = {
        "total": metrics(pred.sum(1), true.sum(1)),
        "total_strict": metrics(pred[strict_pos].sum(1), true[strict_pos].sum(1)),
        "fwd": metrics(pred[:, 0], true[:, 0]),
        "bwd": metrics(pred[:, 1], true[:, 1]),
        "constant_baseline_mape": metrics(
            np.full(len(true), float(np.median(torch.exp(train[3].double()).numpy().sum(1)))),
            true.sum(1),
        )["mape"],
    }
    points[("compute", "test")] = (pred.sum(1), true.sum(1))
    drift = _drift(split.test, pred.sum(1), true.sum(1))
    if drift is not None:
        report_metrics["compute"]["drift_block_median_error"] = list(drift)
        if drift[1] - drift[0] > 0.1:
            notes.append(
                "the host's speed drifted while the compute data was collected: the median "
                f"error of consecutive test samples (blocks of {DRIFT_BLOCK}) ranges from "
                f"{drift[0]:+.0%} to {drift[1]:+.0%}; no model of the kernel can predict "
                "that, so it bounds the MAPE (collect on a quiet machine)"
            )
    counts: dict[str, Any] = {
        "compute": {
            "samples": len(crecs),
            "train": len(split.train),
            "val": len(split.val),
            "test": len(split.test),
            "test_strict": len(split.test_strict),
            "unused": len(crecs) - len(split.train) - len(split.val) - len(split.test),
            "tables": len(split.train_tables) + len(split.test_tables),
            "test_tables": len(split.test_tables),
            "batch_sizes": sorted(set(cdata.batch_sizes)),
        }
    }
    if len(split.test_strict) < MIN_SPLIT:
        notes.append(
            f"only {len(split.test_strict)} test samples have every table unseen; "
            "their metrics are noisy"
        )

    # ---- comm
    mnet: CommNet | None = None
    if mds is not None:
        mnet, comm_counts = _train_comm(
            _comm_data(mrecs),
            holdout_world_size,
            seed=seed,
            hidden=hidden if tiny else 32,  # ~100s of noisy samples: a smaller net
            batch=max(8, batch // 8),
            lr=lr,
            max_epochs=max_epochs,
            patience=patience,
            on_epoch=on_epoch,
            epochs=epochs,
            report_metrics=report_metrics,
            points=points,
            notes=notes,
            source=str(mds.directory),
        )
        counts["comm"] = comm_counts
    else:
        notes.append("no comm dataset: the model has no all-to-all model")

    report = PretrainReport(counts, epochs, report_metrics, notes, points)
    metadata: dict[str, Any] = {
        "fingerprint": cds.fingerprint.to_dict(),
        "fingerprint_key": cds.manifest.fingerprint_key,
        "dataset_hashes": {
            "compute": cds.dataset_hash(),
            **({"comm": mds.dataset_hash()} if mds is not None else {}),
        },
        "metrics": report.to_json(),
        "code_version": shardwise.__version__,
        "format_version": FORMAT_VERSION,
        "batch_sizes": sorted(set(cdata.batch_sizes)),
        "comm_batch_sizes": sorted({int(r["batch_size"]) for r in mrecs}),
        "comm_world_sizes": sorted({int(r["world_size"]) for r in mrecs}),
        "seed": seed,
        "tiny": tiny,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    # Plain JSON types only, so torch.load(weights_only=True) reads it back.
    metadata = json.loads(json.dumps(metadata, default=float))
    return CostModel(cnet, mnet, metadata), report


def _train_comm(
    data: _CommData,
    holdout: int | None,
    *,
    seed: int,
    hidden: int,
    batch: int,
    lr: float,
    max_epochs: int,
    patience: int,
    on_epoch: Callable[[EpochProgress], None] | None,
    epochs: dict[str, dict[str, Any]],
    report_metrics: dict[str, Any],
    points: dict[tuple[str, str], tuple[F64, F64]],
    notes: list[str],
    source: str,
) -> tuple[CommNet, dict[str, Any]]:
    worlds = sorted(set(data.world))
    if holdout is not None and (holdout not in worlds or len(worlds) < 2):
        notes.append(
            f"world size {holdout} cannot be held out (the comm data has {worlds}); "
            "no unseen-world-size figure"
        )
        holdout = None
    held = [i for i, w in enumerate(data.world) if w == holdout]
    seen = [i for i, w in enumerate(data.world) if w != holdout]
    tr, va, te = _split_samples(seen, seed)
    if min(len(tr), len(va), len(te)) < 1 or len(tr) < MIN_SPLIT:
        raise UserError(
            f"{source}: {len(seen)} all-to-all samples outside the held-out world size "
            f"give train/val/test {len(tr)}/{len(va)}/{len(te)}; at least {MIN_SPLIT} "
            "training samples and one of each other split are needed. Collect more."
        )

    def train_one(name: str, tr: list[int], va: list[int], s: int) -> CommNet:
        torch.manual_seed(s)
        net = CommNet(hidden=hidden)
        part = data.take(tr)
        net.rank_norm = Normalizer.fit(part[0][part[1].bool()].numpy())
        epochs[name] = _fit(
            net,
            _comm_loss,
            part,
            data.take(va),
            name=name,
            seed=s,
            max_epochs=max_epochs,
            patience=patience,
            batch_size=batch,
            lr=lr,
            on_epoch=on_epoch,
        )
        return net

    net = train_one("comm", tr, va, seed)
    report_metrics["comm"], arr = _comm_metrics(net, data.take(te))
    points[("comm fwd", "test")] = (arr[0], arr[2])
    points[("comm bwd", "test")] = (arr[1], arr[3])
    counts: dict[str, Any] = {
        "samples": len(data.world),
        "train": len(tr),
        "val": len(va),
        "test": len(te),
        "holdout_world_size": holdout,
        "holdout": len(held),
        "world_sizes": worlds,
    }
    if not held:
        return net, counts
    report_metrics["comm_unseen_world"], arr = _comm_metrics(net, data.take(held))
    points[("comm fwd", f"unseen W={holdout}")] = (arr[0], arr[2])
    points[("comm bwd", f"unseen W={holdout}")] = (arr[1], arr[3])
    # Refit with the held-out world size split like the others (see the docstring).
    htr, hva, hte = _split_samples(held, seed + 7)
    final = train_one("comm-final", sorted(tr + htr), sorted(va + hva), seed)
    report_metrics["comm_final"], _ = _comm_metrics(final, data.take(sorted(te + hte)))
    counts["final"] = {"train": len(tr) + len(htr), "val": len(va) + len(hva)}
    counts["final"]["test"] = len(te) + len(hte)
    return final, counts


__all__ = [
    "DEFAULT_MAX_EPOCHS",
    "DEFAULT_PATIENCE",
    "ComputeSplit",
    "EpochProgress",
    "PretrainReport",
    "metrics",
    "pretrain",
    "split_compute",
]
