"""Neural cost models (design §7) and the batched, cached inference the planner uses.

Two models, both predicting log-seconds so that microsecond and 100-millisecond
kernels weigh alike in training:

``ComputeNet`` (NeuroShard's architecture)
    A shared MLP encodes each table (or column shard) of a rank's fused kernel into
    positive values; the encodings are *summed* over the kernel's tables (padding +
    mask for batching) and a head, reading their log and the global batch size, gives
    forward and backward seconds. Table features: the 17 access bins, log2 width, log
    pooling, log rows, fp16, log lookups and values pooled at the batch, and the
    unique rows read (derived from the histogram as the stream generator does).
    The sum makes the model indifferent to table order and lets it price any number
    of tables; the head can still learn that a fused kernel is not additive.
``CommNet`` (one model for every world size)
    A per-rank encoder sees the rank's own width, its start delay and its relation to
    the others (share of all widths, wait for the straggler); a pooled context (mean
    and max over ranks, sums, log W) describes the whole collective. A per-rank head
    predicts the backward all-to-all and the forward all-to-all *after* the straggler
    wait, which is added explicitly (``max delay - own delay``): the wait is known
    exactly, only the collective must be learnt. Nothing in it is sized by W, so it
    runs on world sizes it never saw.

Feature normalization (mean/std fitted on the training split) is stored with the
weights. The planner imports this module, never :mod:`shardwise.profiler`; training
lives in :mod:`shardwise.profiler.pretrain`.
"""

from __future__ import annotations

import itertools
import math
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from shardwise.planner.access import NUM_BINS
from shardwise.planner.errors import UserError
from shardwise.planner.plan import Plan, PlanCost, Predicted, RankCost
from shardwise.planner.streams import BIN_MEAN_COUNT
from shardwise.planner.tables import TableSpec

#: Bump when the file layout or a feature's meaning changes; loaders refuse others.
FORMAT_VERSION = 1
FORMAT_NAME = "shardwise-costmodel"
BUNDLED_MODEL = Path(__file__).with_name("data") / "costmodel-cpu.pt"

#: Per-table inputs of :class:`ComputeNet` (in this order).
TABLE_FEATURES: tuple[str, ...] = (
    *(f"hist{k}" for k in range(NUM_BINS)),
    "log2_cols",
    "log1p_pooling",
    "log_rows",
    "fp16",
    "log1p_pooling_x_cols",
    "log_batch",
    "log1p_lookups",  # batch × pooling: indices the kernel reads
    "log1p_elements",  # batch × pooling × cols: values it pools
    "log1p_unique",  # unique rows read per batch (what the optimizer updates)
    "log1p_unique_x_cols",  # … times the width: the backward's row-wise update work
)
#: Per-sample inputs of the compute head.
SET_FEATURES: tuple[str, ...] = ("log_batch", "log_tables")
#: Per-rank inputs of :class:`CommNet`.
RANK_FEATURES: tuple[str, ...] = (
    "log1p_send",  # elements this rank sends in all: W × batch × dim
    "log1p_recv",  # elements it receives: batch × sum of dims
    "log1p_moved",  # elements the whole collective moves: W × batch × sum of dims
    "share",  # dim / sum of dims
    "idle",  # dim == 0
    "delay_ms",
    "wait_ms",  # max delay - own delay: the straggler wait
    "log1p_max_send",
    "log_world",
    "rel_dim",  # dim / max dim
)

_Array = npt.NDArray[np.float32]
# A table (or shard) as the cost model sees it: (name, rows, cols, dtype, pooling).
TableKey = tuple[str, int, int, str, float]


# --------------------------------------------------------------------------- features


def table_features(
    access_hist: Sequence[float],
    cols: int,
    pooling_factor: float,
    rows: int,
    dtype: str,
    batch_size: int,
) -> list[float]:
    """Raw (unnormalized) :data:`TABLE_FEATURES` of one table or column shard."""
    lookups = batch_size * pooling_factor
    # Unique rows as the profiler's stream generator derives them from the histogram.
    mean_count = float(np.dot(np.asarray(access_hist, dtype=np.float64), BIN_MEAN_COUNT))
    unique = min(float(rows), lookups, lookups / mean_count if mean_count > 0 else lookups)
    return [
        *(float(x) for x in access_hist),
        math.log2(cols),
        math.log1p(pooling_factor),
        math.log(rows),
        1.0 if dtype == "fp16" else 0.0,
        math.log1p(pooling_factor * cols),
        math.log(batch_size),
        math.log1p(lookups),
        math.log1p(lookups * cols),
        math.log1p(unique),
        math.log1p(unique * cols),
    ]


def set_features(batch_size: int, n_tables: int) -> list[float]:
    return [math.log(batch_size), math.log(max(n_tables, 1))]


def rank_features(
    dims: Sequence[int], delays: Sequence[float], batch_size: int
) -> npt.NDArray[np.float64]:
    """Raw :data:`RANK_FEATURES` of every rank of one all-to-all, ``[W, F]``."""
    one: npt.NDArray[np.float64] = rank_features_many(
        np.asarray([dims], dtype=np.float64), np.asarray([delays], dtype=np.float64), batch_size
    )[0]
    return one


def rank_features_many(
    dims: npt.NDArray[np.float64], delays: npt.NDArray[np.float64], batch_size: int
) -> npt.NDArray[np.float64]:
    """:func:`rank_features` of ``M`` collectives of one world size: ``[M, W]`` → ``[M, W, F]``."""
    d, t = dims, delays
    m, w = d.shape
    total = d.sum(axis=1, keepdims=True)
    top = d.max(axis=1, keepdims=True) if w else np.zeros((m, 1))
    safe_total = np.where(total > 0, total, 1.0)
    safe_top = np.where(top > 0, top, 1.0)
    full = np.ones((m, w))
    return np.stack(
        [
            np.log1p(w * batch_size * d),
            full * np.log1p(batch_size * total),
            full * np.log1p(w * batch_size * total),
            np.where(total > 0, d / safe_total, 0.0),
            (d == 0).astype(np.float64),
            t * 1e3,
            (t.max(axis=1, keepdims=True) - t) * 1e3 if w else t,
            full * np.log1p(batch_size * top),
            full * math.log(max(w, 1)),
            np.where(top > 0, d / safe_top, 0.0),
        ],
        axis=2,
    )


@dataclass
class Normalizer:
    """Per-feature mean and std (std of a constant feature is 1: it passes through)."""

    mean: list[float]
    std: list[float]

    @classmethod
    def fit(cls, x: npt.NDArray[np.floating[Any]]) -> Normalizer:
        mean = x.mean(axis=0)
        std = x.std(axis=0)
        std = np.where(std < 1e-6, 1.0, std)
        return cls([float(v) for v in mean], [float(v) for v in std])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return (x - torch.tensor(self.mean, dtype=x.dtype)) / torch.tensor(self.std, dtype=x.dtype)

    def to_dict(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Normalizer:
        return cls([float(v) for v in d["mean"]], [float(v) for v in d["std"]])


# --------------------------------------------------------------------------- networks


def _mlp(sizes: Sequence[int], final_act: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if final_act or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ComputeNet(nn.Module):
    """Shared table MLP, summed over the kernel's tables, then a head: log (fwd, bwd) s.

    The head has a linear skip next to its MLP, so "cost = sum of table costs" is
    the easy solution and the MLP learns the deviation (fused-kernel effects).
    """

    def __init__(self, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.hidden, self.layers = hidden, layers
        self.table_norm = Normalizer([0.0] * len(TABLE_FEATURES), [1.0] * len(TABLE_FEATURES))
        self.set_norm = Normalizer([0.0] * len(SET_FEATURES), [1.0] * len(SET_FEATURES))
        self.encoder = _mlp([len(TABLE_FEATURES)] + [hidden] * (layers + 1), final_act=False)
        self.head = _mlp([hidden + len(SET_FEATURES), hidden, hidden, 2], final_act=False)
        self.skip = nn.Linear(hidden + len(SET_FEATURES), 2)

    def encode(self, tables: torch.Tensor) -> torch.Tensor:
        """Raw table features ``[..., F]`` → positive encodings ``[..., H]``.

        Encodings are exponentials, so one channel can carry a table's own cost (the
        exponential of a linear function of log-features like the values it pools);
        their sum is then a fused kernel's additive part, and the head reads its log.
        """
        out: torch.Tensor = torch.exp(self.encoder(self.table_norm.apply(tables)).clamp(-30, 30))
        return out

    def head_from_sum(self, summed: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
        """Summed encodings ``[N, H]`` and raw set features ``[N, S]`` → log s ``[N, 2]``."""
        x = torch.cat([torch.log(summed + 1e-9), self.set_norm.apply(sets)], dim=1)
        out: torch.Tensor = self.head(x) + self.skip(x)
        return out

    def forward(self, tables: torch.Tensor, mask: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
        """``tables [N, T, F]``, ``mask [N, T]`` (1 = real table), ``sets [N, S]``."""
        enc = self.encode(tables) * mask.unsqueeze(-1)
        return self.head_from_sum(enc.sum(dim=1), sets)


class CommNet(nn.Module):
    """Per-rank encoder + pooled context → per-rank log (fwd after the wait, bwd) s."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = hidden
        self.rank_norm = Normalizer([0.0] * len(RANK_FEATURES), [1.0] * len(RANK_FEATURES))
        f = len(RANK_FEATURES)
        self.encoder = _mlp([f, hidden, hidden], final_act=True)
        self.head = _mlp([f + 3 * hidden, hidden, hidden, 2], final_act=False)
        # Linear in the (log) features: extrapolates to more ranks and wider
        # collectives as a power law; the MLP adds what is not.
        self.skip = nn.Linear(f, 2)

    def forward(self, ranks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ranks [N, W, F]`` raw, ``mask [N, W]`` → log-seconds ``[N, W, 2]``
        (channel 0 is the forward all-to-all *without* the straggler wait)."""
        x = self.rank_norm.apply(ranks)
        h = self.encoder(x) * mask.unsqueeze(-1)
        count = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        mean = h.sum(dim=1) / count
        top = h.masked_fill(mask.unsqueeze(-1) == 0, -1e9).max(dim=1).values
        own_vs_mean = h - mean.unsqueeze(1)
        ctx = torch.cat([mean, top], dim=1).unsqueeze(1).expand(-1, h.shape[1], -1)
        out: torch.Tensor = self.head(torch.cat([x, own_vs_mean, ctx], dim=-1)) + self.skip(x)
        return out


def comm_seconds(log_out: torch.Tensor, wait_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`CommNet` output → (fwd incl. the straggler wait, bwd) seconds."""
    out = log_out.clamp(-30.0, 15.0)  # an untrained net must not overflow
    return wait_s + torch.exp(out[..., 0]), torch.exp(out[..., 1])


# --------------------------------------------------------------------------- artifact


@dataclass
class CostModel:
    """Both networks, their normalization and where they came from (one torch file)."""

    compute: ComputeNet
    comm: CommNet | None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> dict[str, Any]:
        fp: dict[str, Any] = self.metadata.get("fingerprint", {})
        return fp

    def to_payload(self) -> dict[str, Any]:
        def net(n: nn.Module, norms: dict[str, Normalizer], config: dict[str, int]) -> Any:
            return {
                "config": config,
                "norm": {k: v.to_dict() for k, v in norms.items()},
                "state_dict": {k: v.detach().clone() for k, v in n.state_dict().items()},
            }

        c = self.compute
        payload: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "compute": net(
                c,
                {"table": c.table_norm, "set": c.set_norm},
                {"hidden": c.hidden, "layers": c.layers},
            ),
            "comm": None,
        }
        if self.comm is not None:
            payload["comm"] = net(
                self.comm, {"rank": self.comm.rank_norm}, {"hidden": self.comm.hidden}
            )
        return payload

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        torch.save(self.to_payload(), tmp)
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model file; any damage or foreign file is a :class:`UserError`."""
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{p}: no such cost model file.")
        try:
            payload = torch.load(p, map_location="cpu", weights_only=True)
        except (
            RuntimeError,
            EOFError,
            OSError,
            ValueError,
            pickle.UnpicklingError,
            zipfile.BadZipFile,
            AttributeError,
            KeyError,
            TypeError,
        ) as err:
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err)
            raise UserError(
                f"{p} is not a readable cost model file (truncated or corrupt?): {first}. "
                "Re-create it with `shardwise pretrain` (or `make pretrain`)."
            ) from None
        return cls.from_payload(payload, str(p))

    @classmethod
    def from_payload(cls, payload: Any, source: str = "<model>") -> CostModel:
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise UserError(
                f"{source} is a torch file but not a Shardwise cost model "
                f"(no format {FORMAT_NAME!r})."
            )
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise UserError(
                f"{source} is a cost model of format version {version!r}; this Shardwise "
                f"reads version {FORMAT_VERSION}. Re-train it with this version "
                "(`shardwise pretrain`) or use the Shardwise that wrote it."
            )
        try:
            cp = payload["compute"]
            compute = ComputeNet(int(cp["config"]["hidden"]), int(cp["config"]["layers"]))
            compute.load_state_dict(cp["state_dict"])
            compute.table_norm = Normalizer.from_dict(cp["norm"]["table"])
            compute.set_norm = Normalizer.from_dict(cp["norm"]["set"])
            comm: CommNet | None = None
            if payload.get("comm") is not None:
                mp = payload["comm"]
                comm = CommNet(int(mp["config"]["hidden"]))
                comm.load_state_dict(mp["state_dict"])
                comm.rank_norm = Normalizer.from_dict(mp["norm"]["rank"])
            metadata = dict(payload.get("metadata") or {})
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise UserError(
                f"{source} is a damaged cost model ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else ''})."
            ) from None
        compute.eval()
        if comm is not None:
            comm.eval()
        return cls(compute, comm, metadata)


def load_bundled() -> CostModel:
    """The pre-trained CPU model shipped in the package (works offline)."""
    if not BUNDLED_MODEL.is_file():
        raise UserError(
            f"the bundled cost model {BUNDLED_MODEL} is missing from this installation. "
            "Re-create it with `make pretrain` (or pass a model file trained with "
            "`shardwise pretrain`)."
        )
    return CostModel.load(BUNDLED_MODEL)


# --------------------------------------------------------------------------- inference


def table_key(spec: TableSpec, cols: int) -> TableKey:
    return (spec.name, spec.rows, cols, spec.dtype, spec.pooling_factor)


@dataclass(frozen=True)
class PlanPrediction(PlanCost):
    """The cost model's view of a plan, shaped like the measured ``Evaluation``."""

    model: dict[str, Any] = field(default_factory=dict)

    def predicted(self) -> Predicted:
        """For ``plan.json`` (whose imbalance is 1 - mean/max)."""
        return Predicted.from_costs([r.total_s for r in self.ranks])

    def to_json(self) -> dict[str, object]:
        """The keys of ``Evaluation.to_json()``; repeat statistics are null (nothing
        was repeated), ``source`` says it is a prediction and ``model`` by what."""
        return {
            **self.cost_json(),
            "repeats": 0,
            "max_per_repeat": [],
            "allocator_mitigated": None,
            "repeat_cv": None,
            "source": "predicted",
            "model": self.model,
        }


class CostPredictor:
    """Batched, cached inference over a :class:`CostModel`, for planners.

    ``compute`` prices many candidate shard sets in one call. Two caches make repeated
    candidates cheap: whole sets (keyed by their tables and the batch) and table
    encodings (keyed by table and batch), so a new set of known tables costs only a
    sum and the small head. ``net_calls`` counts network evaluations (tests use it).
    A table is known by (name, rows, cols, dtype, pooling factor): two different
    tables sharing all five would share a cache entry (their histograms are not
    hashed on every lookup, which keeps hits cheap).
    """

    def __init__(self, model: CostModel, max_cache: int = 1_000_000) -> None:
        self.model = model
        self.max_cache = max_cache
        self.net_calls = 0
        self._sets: dict[tuple[frozenset[tuple[TableKey, int]], int], tuple[float, float]] = {}
        self._enc: dict[tuple[TableKey, int], int] = {}  # -> row in self._enc_rows
        self._enc_rows = torch.zeros(0, model.compute.hidden)
        self._comm: dict[tuple[tuple[int, ...], tuple[float, ...], int], npt.NDArray[np.float64]]
        self._comm = {}

    def clear_cache(self) -> None:
        self._sets.clear()
        self._enc.clear()
        self._enc_rows = torch.zeros(0, self.model.compute.hidden)
        self._comm.clear()

    # ------------------------------------------------------------------ compute

    def _encode_missing(
        self, wanted: Mapping[tuple[TableKey, int], tuple[TableSpec, int]], batch_size: int
    ) -> None:
        missing = [k for k in wanted if k not in self._enc]
        if not missing:
            return
        feats = np.array(
            [
                table_features(
                    wanted[k][0].access_hist,
                    wanted[k][1],
                    wanted[k][0].pooling_factor,
                    wanted[k][0].rows,
                    wanted[k][0].dtype,
                    batch_size,
                )
                for k in missing
            ],
            dtype=np.float32,
        )
        with torch.inference_mode():
            enc = self.model.compute.encode(torch.from_numpy(feats))
        self.net_calls += 1
        start = self._enc_rows.shape[0]
        self._enc_rows = torch.cat([self._enc_rows, enc])
        for i, k in enumerate(missing):
            self._enc[k] = start + i

    def encodings(
        self, shards: Sequence[tuple[TableSpec, int]], batch_size: int
    ) -> npt.NDArray[np.float32]:
        """Each ``(table, cols)``'s table encoding ``[N, H]`` at ``batch_size`` (cached):
        what a search that keeps per-rank sums adds up itself."""
        wanted = {(table_key(spec, cols), batch_size): (spec, cols) for spec, cols in shards}
        self._encode_missing(wanted, batch_size)
        rows = [self._enc[(table_key(spec, cols), batch_size)] for spec, cols in shards]
        return self._enc_rows[torch.tensor(rows, dtype=torch.long)].numpy().astype(np.float32)

    def compute(
        self, shard_sets: Sequence[Sequence[tuple[TableSpec, int]]], batch_size: int
    ) -> npt.NDArray[np.float64]:
        """(fwd, bwd) seconds ``[N, 2]`` of each set's fused kernel at ``batch_size``.

        A set is ``(table, cols)`` pairs (``cols = table.dim`` for a whole table). An
        empty set costs 0. A set mixing fp32 and fp16 is priced as one kernel per
        precision, summed, as the profiler measures it.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        out = np.zeros((len(shard_sets), 2), dtype=np.float64)
        # Each set → one or two kernels (one per precision); look kernels up first.
        todo: dict[frozenset[tuple[TableKey, int]], list[tuple[TableSpec, int]]] = {}
        kernels_of: list[list[frozenset[tuple[TableKey, int]]]] = []
        for shards in shard_sets:
            by_dtype: dict[str, list[tuple[TableSpec, int]]] = {}
            for spec, cols in shards:
                by_dtype.setdefault(spec.dtype, []).append((spec, cols))
            keys = []
            for group in by_dtype.values():
                # Counted keys: a set listing one shard twice is priced with both.
                counts: dict[TableKey, int] = {}
                for spec, cols in group:
                    k = table_key(spec, cols)
                    counts[k] = counts.get(k, 0) + 1
                key = frozenset(counts.items())
                keys.append(key)
                if (key, batch_size) not in self._sets:
                    todo[key] = group
            kernels_of.append(keys)
        # This call's results, so a cache cleared for size mid-call loses nothing.
        got = {k: self._sets[(k, batch_size)] for keys in kernels_of for k in keys if k not in todo}
        if todo:
            got.update(self._price(todo, batch_size))
        for i, keys in enumerate(kernels_of):
            for key in keys:
                f, b = got[key]
                out[i, 0] += f
                out[i, 1] += b
        return out

    def _price(
        self,
        todo: Mapping[frozenset[tuple[TableKey, int]], list[tuple[TableSpec, int]]],
        batch_size: int,
    ) -> dict[frozenset[tuple[TableKey, int]], tuple[float, float]]:
        wanted: dict[tuple[TableKey, int], tuple[TableSpec, int]] = {}
        for group in todo.values():
            for spec, cols in group:
                wanted.setdefault((table_key(spec, cols), batch_size), (spec, cols))
        self._encode_missing(wanted, batch_size)
        set_index: list[int] = []
        rows: list[int] = []
        sizes: list[int] = []
        for n, group in enumerate(todo.values()):
            for spec, cols in group:
                rows.append(self._enc[(table_key(spec, cols), batch_size)])
                set_index.append(n)
            sizes.append(len(group))
        enc = self._enc_rows[torch.tensor(rows, dtype=torch.long)]
        summed = torch.zeros(len(todo), self._enc_rows.shape[1])
        summed.index_add_(0, torch.tensor(set_index, dtype=torch.long), enc)
        sets = torch.tensor([set_features(batch_size, s) for s in sizes], dtype=torch.float32)
        with torch.inference_mode():
            log_s = self.model.compute.head_from_sum(summed, sets).clamp(-30.0, 15.0)
            secs = torch.exp(log_s).double().numpy()
        self.net_calls += 1
        if len(self._sets) + len(todo) > self.max_cache:
            self._sets.clear()
        priced = {key: (f, b) for key, (f, b) in zip(todo, secs.tolist(), strict=True)}
        for key, fb in priced.items():
            self._sets[(key, batch_size)] = fb
        return priced

    # ------------------------------------------------------------------ comm

    def comm(
        self, dims: Sequence[int], delays: Sequence[float], batch_size_per_rank: int = 128
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per-rank (fwd incl. straggler wait, bwd) all-to-all seconds of one collective."""
        if self.model.comm is None:
            raise UserError(
                "this cost model has no communication model (it was trained without a "
                "comm dataset); pre-train with DATASET/comm to predict multi-rank plans."
            )
        if len(dims) != len(delays):
            raise ValueError("dims and delays need one entry per rank")
        if len(dims) < 2:
            return np.zeros(len(dims)), np.zeros(len(dims))
        key = (tuple(int(d) for d in dims), tuple(float(t) for t in delays), batch_size_per_rank)
        hit = self._comm.get(key)
        if hit is None:
            x = torch.from_numpy(rank_features(dims, delays, batch_size_per_rank)).float()
            wait = torch.tensor([max(delays) - t for t in delays], dtype=torch.float64)
            with torch.inference_mode():
                log_out = self.model.comm(x.unsqueeze(0), torch.ones(1, len(dims)))[0]
                fwd, bwd = comm_seconds(log_out.double(), wait)
            self.net_calls += 1
            hit = np.stack([fwd.numpy(), bwd.numpy()])
            if len(self._comm) >= self.max_cache:
                self._comm.clear()
            self._comm[key] = hit
        return hit[0].copy(), hit[1].copy()

    def comm_many(
        self,
        dims: npt.NDArray[np.float64],
        delays: npt.NDArray[np.float64],
        batch_size_per_rank: int = 128,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """:meth:`comm` for ``M`` collectives of one world size at once (``[M, W]`` in,
        two ``[M, W]`` out), uncached: what a local search scoring many moves needs."""
        if self.model.comm is None:
            return self.comm([0, 0], [0.0, 0.0])  # raises the explanation
        m, w = dims.shape
        if w < 2:
            return np.zeros((m, w)), np.zeros((m, w))
        x = torch.from_numpy(rank_features_many(dims, delays, batch_size_per_rank)).float()
        wait = torch.from_numpy(delays.max(axis=1, keepdims=True) - delays)
        with torch.inference_mode():
            log_out = self.model.comm(x, torch.ones(m, w))
            fwd, bwd = comm_seconds(log_out.double(), wait)
        self.net_calls += 1
        return fwd.numpy(), bwd.numpy()

    # ------------------------------------------------------------------ plans

    def predict_plan(
        self, plan: Plan, tables: Sequence[TableSpec], batch_size_per_rank: int = 128
    ) -> PlanPrediction:
        """Per-rank predicted cost of ``plan``, computed as the evaluator measures it:
        compute at the global batch, then the all-to-all with each rank's forward
        compute as its start delay."""
        plan.validate_plan(tables, source=f"plan {plan.hash[:8] or '(unhashed)'}")
        specs = {t.name: t for t in tables}
        per_rank = [
            [(specs[t.name], s.cols) for t, s in shards] for shards in plan.shards_per_rank()
        ]
        world = plan.world_size
        comp = self.compute(per_rank, batch_size_per_rank * world)
        dims = [sum(c for _, c in shards) for shards in per_rank]
        if world > 1:
            fwd_c, bwd_c = self.comm(dims, comp[:, 0].tolist(), batch_size_per_rank)
        else:
            fwd_c, bwd_c = np.zeros(1), np.zeros(1)
        fp = self.model.fingerprint
        return PlanPrediction(
            plan_hash=plan.hash,
            planner=plan.planner,
            world_size=world,
            batch_size_per_rank=batch_size_per_rank,
            device=str(fp.get("device_type", "cpu")),
            ranks=[
                RankCost(
                    rank=r,
                    fwd_compute_s=float(comp[r, 0]),
                    bwd_compute_s=float(comp[r, 1]),
                    fwd_comm_s=float(fwd_c[r]),
                    bwd_comm_s=float(bwd_c[r]),
                )
                for r in range(world)
            ],
            model={
                "fingerprint": fp,
                "created_at": self.model.metadata.get("created_at"),
                "code_version": self.model.metadata.get("code_version"),
            },
        )


__all__ = [
    "BUNDLED_MODEL",
    "FORMAT_VERSION",
    "CommNet",
    "ComputeNet",
    "CostModel",
    "CostPredictor",
    "Normalizer",
    "PlanPrediction",
    "load_bundled",
    "rank_features",
    "rank_features_many",
    "set_features",
    "table_features",
]
