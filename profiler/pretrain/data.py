"""Pre-training's inputs: the cost datasets, their tensors and the train/val/test splits.

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

**Comm split, by sample,** with one world size held out entirely (see
:func:`~shardwise.profiler.pretrain.training.train_comm`); :func:`split_samples`
shares the samples out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from shardwise.basics import UserError
from shardwise.planner.costmodel.features import (
    RANK_FEATURES,
    SET_FEATURES,
    TABLE_FEATURES,
    rank_features,
    set_features,
    table_features,
)
from shardwise.profiler.dataset.records import KERNELS_KEY
from shardwise.profiler.dataset.store import MANIFEST_FILE, CostDataset
from shardwise.profiler.fingerprint import Fingerprint

TEST_TABLE_SHARE = 0.10
VAL_SAMPLE_SHARE = 0.15
COMM_SPLIT = (0.70, 0.15, 0.15)
MIN_COMPUTE_SAMPLES = 40
MIN_COMM_SAMPLES = 20
#: Fewest samples a split may hold: below this its metrics are noise.
MIN_SPLIT = 5
FLOOR_S = 1e-7  # measured zeros (never seen, but possible) become 0.1 µs in logs

F64 = npt.NDArray[np.float64]


# --------------------------------------------------------------------------- datasets


@dataclass
class Datasets:
    """The records pre-training uses, checked: one fingerprint, enough samples."""

    compute_dir: Path
    compute: CostDataset
    compute_records: list[dict[str, Any]]
    #: Older compute samples left out because they carry no reference timing.
    dropped: int
    comm: CostDataset | None
    comm_records: list[dict[str, Any]]


def load_datasets(root: Path) -> Datasets:
    """Open ``root`` (``compute/`` and optional ``comm/``, or a compute dataset itself)."""
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
    return Datasets(compute_dir, cds, crecs, dropped, mds, mrecs)


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


# --------------------------------------------------------------------------- tensors


def _take(idx: Sequence[int], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    i = torch.tensor(list(idx), dtype=torch.long)
    return tuple(t[i] for t in tensors)


@dataclass
class ComputeData:
    """One training example per measured kernel (:func:`compute_data`)."""

    tables: torch.Tensor  # [N, T, F]
    mask: torch.Tensor  # [N, T]
    sets: torch.Tensor  # [N, S]
    y: torch.Tensor  # [N, 2] log seconds
    bases: list[set[str]]
    batch_sizes: list[int]
    #: The record each example comes from (a record with several kernels gives several).
    record_of: list[int] = field(default_factory=list)

    def take(self, idx: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return _take(idx, self.tables, self.mask, self.sets, self.y)


#: One kernel to learn from: its tables (record entries), its batch, fwd and bwd seconds.
Example = tuple[list[dict[str, Any]], int, float, float]


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


def kernel_examples(record: dict[str, Any]) -> list[Example]:
    """The examples one compute record teaches: ``(tables, batch, fwd_s, bwd_s)`` of
    each kernel it lists in ``extra["kernels"]`` (a rank of several kinds runs one
    kernel per kind, each at its own batch: the network prices one kernel), or of the
    whole record, one fused kernel, when it lists none."""
    kernels = record.get("extra", {}).get(KERNELS_KEY)
    if not kernels:
        return [(record["tables"], int(record["batch_size"]), record["fwd_s"], record["bwd_s"])]
    return [
        (
            [record["tables"][i] for i in k["tables"]],
            int(k["batch_size"]),
            float(k["fwd_s"]),
            float(k["bwd_s"]),
        )
        for k in kernels
    ]


def kernel_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with each one that lists its kernels replaced by one record per
    kernel (its tables, batch and medians; the rest, ``extra`` without the kernels,
    kept): for code that prices a record as one fused kernel at its batch (held-out
    checks, speed factors), so a rank of several kinds is priced as it ran."""
    out = []
    for r in records:
        if not r.get("extra", {}).get(KERNELS_KEY):
            out.append(r)
            continue
        extra = {k: v for k, v in r["extra"].items() if k != KERNELS_KEY}
        for tables, batch, fwd, bwd in kernel_examples(r):
            out.append(
                {
                    **r,
                    "tables": tables,
                    "batch_size": batch,
                    "fwd_s": fwd,
                    "bwd_s": bwd,
                    "total_s": fwd + bwd,
                    "extra": extra,
                }
            )
    return out


def compute_data(records: list[dict[str, Any]], drift: bool = True) -> ComputeData:
    """The examples of ``records`` (:func:`kernel_examples`), drift-normalized unless
    ``drift`` is off."""
    factors = (drift_factors(records) if drift else None) or [1.0] * len(records)
    examples = [(i, ex) for i, r in enumerate(records) for ex in kernel_examples(r)]
    tmax = max(len(ex[0]) for _, ex in examples)
    n, f = len(examples), len(TABLE_FEATURES)
    tables = np.zeros((n, tmax, f), dtype=np.float32)
    mask = np.zeros((n, tmax), dtype=np.float32)
    sets = np.zeros((n, len(SET_FEATURES)), dtype=np.float32)
    y = np.zeros((n, 2), dtype=np.float32)
    for e, (i, (members, b, fwd, bwd)) in enumerate(examples):
        for j, t in enumerate(members):
            tables[e, j] = table_features(
                t["access_hist"], t["cols"], t["pooling_factor"], t["rows"], t["dtype"], b
            )
            mask[e, j] = 1.0
        sets[e] = set_features(b, len(members))
        k = factors[i]
        y[e] = [math.log(max(k * fwd, FLOOR_S)), math.log(max(k * bwd, FLOOR_S))]
    return ComputeData(
        torch.from_numpy(tables),
        torch.from_numpy(mask),
        torch.from_numpy(sets),
        torch.from_numpy(y),
        [{t["base"] for t in ex[0]} for _, ex in examples],
        [ex[1] for _, ex in examples],
        [i for i, _ in examples],
    )


@dataclass
class CommData:
    ranks: torch.Tensor  # [N, W, F]
    mask: torch.Tensor  # [N, W]
    wait: torch.Tensor  # [N, W] seconds
    y: torch.Tensor  # [N, W, 2] log seconds
    world: list[int]

    def take(self, idx: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return _take(idx, self.ranks, self.mask, self.wait, self.y)


def comm_data(records: list[dict[str, Any]]) -> CommData:
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
        y[i, :w, 0] = np.log(np.maximum(r["fwd_s"], FLOOR_S))
        y[i, :w, 1] = np.log(np.maximum(r["bwd_s"], FLOOR_S))
    return CommData(
        torch.from_numpy(ranks),
        torch.from_numpy(mask),
        torch.from_numpy(wait),
        torch.from_numpy(y),
        [int(r["world_size"]) for r in records],
    )


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


def split_samples(idx: Sequence[int], seed: int) -> tuple[list[int], list[int], list[int]]:
    """``COMM_SPLIT`` shares of ``idx``, shuffled by ``seed``: (train, val, test)."""
    perm = [idx[i] for i in np.random.default_rng(seed).permutation(len(idx))]
    n_tr = round(COMM_SPLIT[0] * len(perm))
    n_va = round(COMM_SPLIT[1] * len(perm))
    return sorted(perm[:n_tr]), sorted(perm[n_tr : n_tr + n_va]), sorted(perm[n_tr + n_va :])
