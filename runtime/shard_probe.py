"""Per-shard live cost: each shard of this rank timed on the real batch, on the real device.

The rank's measured compute (:mod:`.live_cost`) says *that* a rank is slow; to know
*which* tables to move, the re-planner needs each shard's own cost. One FBGEMM
``SplitTableBatchedEmbeddingBagsCodegen`` kernel runs many local tables at once
(TorchRec groups them), so the probe times each table through that very kernel:

1. On a probed step, a forward pre-hook keeps each kernel's input (``indices``,
   ``offsets``, ``per_sample_weights``): this rank's real batch, after the input
   all-to-all. Keeping references costs nothing; nothing is copied.
2. After the step's backward (and its fused optimizer update), so the weights are
   never touched mid-step, each kernel runs forward again under ``torch.no_grad()``:
   once with every bag empty (the kernel's fixed cost, also reported: a live fit
   weighs a rank's fixed part by it), then once per local table with
   only that table's bags non-empty (the offsets rewritten through the kernel's
   feature → table map, :func:`only_features`). Perf-counter on CPU; on GPU a CUDA
   event pair around each call, read after one synchronize.
3. Each call runs the forward *and* the backward, the backward on a zero output
   gradient: with the optimizers fused into our kernels (exact SGD and exact row-wise
   Adagrad, no weight decay) a zero gradient updates nothing, bit for bit (the weights
   move by ``lr × 0``, Adagrad's state by ``0²``), yet the backward does all its work
   (the sort of the indices, the gradient's gather, the optimizer's pass over the
   rows). A shard's cost is its call less the empty call. Forward alone would not do:
   on CPU a table read 8× as densely as its neighbours cost 32× their forward but 5×
   their forward + backward, so any one bwd/fwd ratio misprices one or the other. A
   kernel with another optimizer is timed forward only, its backward priced as forward
   × the rank's measured bwd/fwd compute ratio. Each shard keeps the median of its last
   ``window`` probe windows (single windows spike on shared machines), and reports how
   far that median may be off (:func:`median_spread`), which a re-plan weighs.

Each TBE table is one plan shard: TorchRec's grouped config lists the kernel's tables
in order with their name, row and column offsets (``local_metadata.shard_offsets``)
and local rows, so a column-wise table with two shards on this rank is two entries
and a row range is keyed by its first row too (:attr:`LocalShard.key`).

**Every kind.** TorchRec runs each sharding type in a lookup of its own, so a rank
with table-wise, row-wise and data-parallel tables has (at least) three kernels, each
probed on its own input. The input a hook keeps is the kernel's, after TorchRec's
input dist: a row range's kernel receives exactly the ids of the global batch that
fall in its range (TorchRec's row-wise bucketing sends id ``i`` to the range holding
it, made local to it), so its shard is timed with the lookups that really reach it;
a data-parallel table's kernel (TorchRec's ``dense`` kernel,
``DenseTableBatchedEmbeddingBagsCodegen``) receives the rank's own batch. The dense
kernel is timed forward only: its backward would accumulate a zero gradient into the
table, which DDP's hooks would all-reduce out of step with the training's. Its
backward is priced like another optimizer's, from the rank's measured bwd/fwd ratio.

**The overhead bound.** The probe's seconds stay within ``budget`` (1 %) of the
training seconds so far (the steps' wall time, the probe's own not included):

- a window starts only while the probe's seconds plus the estimate of one more window
  stay within 3/4 of the budget (:meth:`ShardProbe.allowed`). The estimate is the
  median of the last whole windows, else the sum of each call's recent median;
  before the first window, twice the rank's median compute of what a window replays
  (every table's forward, and backward where it is timed, once, plus one fixed cost
  per call);
- inside a window each call is made only while the probe's seconds, the window's so far
  and that call's estimate fit the whole budget, so a window the estimate got
  wrong (a slow call, a busy machine) stops early; the shards are taken in a fresh
  random order each window, so every one still gets early turns and none is always
  timed right after the same heavy one;
- every second of a window counts (input rewrites, synchronizes, restoring state).

So the share exceeds the budget only when one call is slower than its estimate by more
than the quarter kept in reserve, and the next windows wait until it is back
under. The live reporter (:mod:`.live_report`) asks every rank at each gathering and
probes the next step only if all agree, so the ranks' windows fall on the same step and
overlap instead of adding up. The probe changes no result: it runs after the step,
without gradients, and puts back the kernel's counters (``step``, ``iter``) that a
forward advances.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.planner.live.summary import ProbeStats, ShardCost
from shardwise.runtime.live_cost import make_clock

#: The probe's share of the training time it may take.
DEFAULT_BUDGET = 0.01
#: A window starts only while the probe's share would stay within this part of the
#: budget: the rest is room for a window that costs more than its estimate.
START_SHARE = 0.75
#: Probe windows behind each shard's median.
DEFAULT_WINDOW = 20
#: Before the first window, its cost is estimated as this × the median forward compute.
FIRST_WINDOW_FACTOR = 2.0
#: Kernel attributes a forward call changes; put back after the probe's calls.
_KERNEL_STATE = ("step", "_indices", "_offsets", "_vbe_B_offsets", "_vbe_max_B")
_KERNEL_COUNTERS = ("iter", "iter_cpu")


ShardKey = tuple[str, int, int]
"""A shard of this rank: (table, first row, first column)."""


@dataclass(frozen=True)
class LocalShard:
    """One table of a kernel on this rank: a shard of the plan."""

    table: str
    col_offset: int
    cols: int
    #: The kernel's features (positions in its feature → table map) that read it.
    features: tuple[int, ...]
    row_offset: int = 0
    #: The rows the shard holds (its kernel table's local rows).
    rows: int = 0

    @property
    def key(self) -> ShardKey:
        return (self.table, self.row_offset, self.col_offset)


@dataclass(frozen=True)
class ProbedKernel:
    """A fused kernel and the shards it holds, in its table order."""

    kernel: Any
    shards: tuple[LocalShard, ...]
    num_features: int
    #: A zero-gradient backward changes nothing in this kernel: time it too.
    backward: bool = False


def kernel_shards(sharded_collection: Any) -> list[ProbedKernel]:
    """Each kernel of a ``ShardedEmbeddingBagCollection`` with its shards.

    TorchRec 1.8 keeps a lookup's kernels in ``lookup._emb_modules`` (a data-parallel
    lookup is wrapped in DDP, its ``module``): each is a ``BatchedFusedEmbeddingBag``
    (or ``BatchedDenseEmbeddingBag``) whose ``_emb_module`` is the FBGEMM kernel and
    whose ``_config.embedding_tables`` are the kernel's tables in order. A kernel whose
    tables do not match that config (another TorchRec) is left out, not guessed at."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kinds = (SplitTableBatchedEmbeddingBagsCodegen, DenseTableBatchedEmbeddingBagsCodegen)
    out = []
    for lookup in getattr(sharded_collection, "_lookups", []):
        inner = getattr(lookup, "module", lookup)  # DDP around a data-parallel lookup
        for module in getattr(inner, "_emb_modules", []):
            kernel = getattr(module, "_emb_module", None)
            config = getattr(module, "_config", None)
            if not isinstance(kernel, kinds) or config is None:
                continue
            tables = list(config.embedding_tables)
            ftm = getattr(kernel, "feature_table_map", None)
            if ftm is None:  # the dense kernel keeps it only in TorchRec's module
                ftm = getattr(module, "_feature_table_map", None)
            if ftm is None:
                continue
            feature_table = [int(t) for t in ftm]
            specs = list(kernel.embedding_specs)
            if len(specs) != len(tables) or any(
                int(spec[1]) != int(t.local_cols) for spec, t in zip(specs, tables, strict=True)
            ):
                continue
            shards = []
            for index, table in enumerate(tables):
                meta = table.local_metadata
                shards.append(
                    LocalShard(
                        table=str(table.name),
                        col_offset=int(meta.shard_offsets[1]) if meta is not None else 0,
                        cols=int(table.local_cols),
                        features=tuple(f for f, t in enumerate(feature_table) if t == index),
                        row_offset=int(meta.shard_offsets[0]) if meta is not None else 0,
                        rows=int(table.local_rows),
                    )
                )
            out.append(
                ProbedKernel(kernel, tuple(shards), len(feature_table), zero_grad_is_noop(kernel))
            )
    return out


def zero_grad_is_noop(kernel: Any) -> bool:
    """A backward on a zero output gradient leaves this kernel's weights and optimizer
    state exactly as they were: exact SGD and exact (row-wise) Adagrad without weight
    decay, fused. Adam-like optimizers decay their moments even on a zero gradient; the
    dense kernel (no fused optimizer) would leave a gradient for DDP."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    safe = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD)
    decay = getattr(kernel, "weight_decay_mode", WeightDecayMode.NONE)
    return getattr(kernel, "optimizer", None) in safe and decay == WeightDecayMode.NONE


def only_features(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    features: Sequence[int],
    num_features: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A kernel's input with every bag outside ``features`` emptied.

    The kernel's bags are feature-major: bag ``b`` of feature ``f`` is
    ``indices[offsets[f·B + b] : offsets[f·B + b + 1]]``. The result has the same bags
    (same batch, same output shape) with the other features' lengths set to 0, and
    only the kept features' indices (and per-sample weights), in their order."""
    bags = offsets.numel() - 1
    if num_features < 1 or bags % num_features:
        raise ValueError(f"{bags} bags do not split into {num_features} features")
    batch = bags // num_features
    lengths = (offsets[1:] - offsets[:-1]).view(num_features, batch)
    keep = torch.zeros(num_features, dtype=torch.bool, device=offsets.device)
    keep[list(features)] = True
    kept = lengths * keep.unsqueeze(1).to(lengths.dtype)
    new_offsets = torch.zeros_like(offsets)
    torch.cumsum(kept.reshape(-1), 0, out=new_offsets[1:])
    mask = torch.repeat_interleave(keep, lengths.sum(dim=1))
    return (
        indices[mask],
        new_offsets,
        weights[mask] if weights is not None else None,
    )


def _inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The (indices, offsets, per-sample weights) of a kernel call, or None for a call
    the probe cannot replay (variable batch per feature)."""
    names = ("indices", "offsets", "per_sample_weights")
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    if kwargs.get("batch_size_per_feature_per_rank") is not None or len(args) > 3:
        return None
    indices, offsets = bound.get("indices"), bound.get("offsets")
    if not isinstance(indices, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        return None
    weights = bound.get("per_sample_weights")
    return indices, offsets, weights if isinstance(weights, torch.Tensor) else None


class ShardProbe:
    """Times this rank's shards on sampled steps, within a budget of the training time.

    Per step: :meth:`start_step` before the forward (capture this step's input or not:
    the caller decides, from :meth:`allowed`), :meth:`finish_step` after the backward
    and the optimizer step (it runs the window). :attr:`train_seconds` is the caller's
    training time so far. :meth:`shard_costs` gives the medians as :class:`ShardCost`."""

    def __init__(
        self,
        sharded_collection: Any,
        *,
        rank: int,
        cuda: bool = False,
        budget: float = DEFAULT_BUDGET,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.rank = rank
        self.budget = budget
        self.window = window
        self.kernels = [k for k in kernel_shards(sharded_collection) if not _has_cache(k.kernel)]
        self._clock = make_clock(cuda)
        self._cuda = cuda
        self._capturing = False
        self._captured: dict[int, tuple[Any, Any]] = {}
        self._fwd: dict[ShardKey, deque[float]] = {}
        self._shards: dict[ShardKey, LocalShard] = {}
        #: Shards whose figure is forward + backward (the rest: forward only).
        self._whole: set[ShardKey] = set()
        #: Whole windows' seconds, and each call's last few (by kernel and shard, None:
        #: the empty call): a window cut short is no estimate of a whole one, its calls are.
        self._whole_windows: deque[float] = deque(maxlen=5)
        #: Each kernel's empty call (every bag empty: its own fixed work), seconds.
        self._empty: dict[int, deque[float]] = {}
        self._calls: dict[tuple[int, ShardKey | None], deque[float]] = {}
        self.seconds = 0.0
        self.train_seconds = 0.0
        self.windows = 0
        self._handles = [
            k.kernel.register_forward_pre_hook(self._on_kernel_call, with_kwargs=True)
            for k in self.kernels
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ the loop
    @property
    def times_backward(self) -> bool:
        """A window runs backward calls too (see the module docstring)."""
        return any(k.backward for k in self.kernels)

    def _call_estimate(self, key: tuple[int, ShardKey | None]) -> float | None:
        """A call's seconds: the median of its last ones, else of every call's last."""
        recent = self._calls.get(key)
        if recent:
            return statistics.median(recent)
        known = [r[-1] for r in self._calls.values() if r]
        return statistics.median(known) if known else None

    def estimate(self, compute: float | None) -> float | None:
        """Seconds one more window will take: the median of the last whole windows, else
        the sum of its calls' estimates (each call's recent median: one heavy table's
        call is not every call's); before any call, :data:`FIRST_WINDOW_FACTOR` ×
        ``compute``, the rank's median compute of what a window replays (forward, and
        backward where it is timed; None: no figure yet)."""
        if self._whole_windows:
            return statistics.median(self._whole_windows)
        if self._calls:
            keys = [
                (k, key)
                for k, probed in enumerate(self.kernels)
                for key in (None, *(s.key for s in probed.shards))
            ]
            return sum(self._call_estimate(key) or 0.0 for key in keys)
        return FIRST_WINDOW_FACTOR * compute if compute else None

    def allowed(self, compute: float | None) -> bool:
        """One more window keeps the probe within its budget of :attr:`train_seconds`
        (vacuously true for a rank with nothing to probe)."""
        if not self.kernels:
            return True
        estimate = self.estimate(compute)
        limit = START_SHARE * self.budget * self.train_seconds
        return estimate is not None and self.seconds + estimate <= limit

    def start_step(self, capture: bool) -> None:
        """Before the forward: keep this step's kernel inputs if it is to be probed."""
        self._captured.clear()
        self._capturing = capture and bool(self.kernels)

    def finish_step(self) -> bool:
        """Run the window of a probed step (after its backward); True if one ran.

        Each call is made only while the probe's seconds, this window's so far and the
        call's estimate fit the budget, so a window the estimate got wrong
        stops early (its shards are probed in a fresh random order each window, so
        every shard still gets its turn)."""
        if not self._capturing:
            return False
        self._capturing = False
        if not self._captured:
            return False
        if self._cuda:
            torch.cuda.synchronize()  # the step's own work is not the probe's
        t0 = time.perf_counter()
        limit = self.budget * self.train_seconds - self.seconds
        n = len(self.kernels)
        whole = True
        with torch.no_grad():
            for k in range(n):
                index = (k + self.windows) % n
                call = self._captured.get(id(self.kernels[index].kernel))
                inputs = _inputs(*call) if call is not None else None
                if inputs is not None and not self._time_kernel(index, *inputs, t0, limit):
                    whole = False
                    break
        self._captured.clear()
        spent = time.perf_counter() - t0
        self.seconds += spent
        if whole:
            self._whole_windows.append(spent)
        self.windows += 1
        return True

    def _time_kernel(
        self,
        index: int,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        t0: float,
        limit: float,
    ) -> bool:
        """The empty call, then each shard's call while the budget allows; records the
        shards' forward seconds. False when the budget stopped it."""
        probed = self.kernels[index]
        kernel, n = probed.kernel, len(probed.shards)
        # A fresh order each window (seeded by the window, so a run repeats): in a
        # rotating one the shard after a heavy one is timed right after it in most
        # windows, and that call reads high (caches and the heavy call's tail).
        order = random.Random(self.windows).sample(probed.shards, n)
        saved = {a: getattr(kernel, a) for a in _KERNEL_STATE if hasattr(kernel, a)}
        counters = {
            a: getattr(kernel, a).clone()
            for a in _KERNEL_COUNTERS
            if isinstance(getattr(kernel, a, None), torch.Tensor)
        }
        marks: list[tuple[LocalShard | None, Any, Any]] = []
        fits = True
        try:
            for shard in [None, *order]:
                key = (index, None if shard is None else shard.key)
                guess = self._call_estimate(key)
                if guess is not None:
                    fits = time.perf_counter() - t0 + guess <= limit
                    if not fits:
                        break
                c0 = time.perf_counter()
                if shard is None:
                    i, o = indices[:0], torch.zeros_like(offsets)
                    w = None if weights is None else weights[:0]
                else:
                    i, o, w = only_features(
                        indices, offsets, weights, shard.features, probed.num_features
                    )
                start = self._clock.stamp()
                if probed.backward:
                    with torch.enable_grad():
                        out = kernel(indices=i, offsets=o, per_sample_weights=w)
                        out.backward(torch.zeros_like(out))
                else:
                    kernel(indices=i, offsets=o, per_sample_weights=w)
                marks.append((shard, start, self._clock.stamp()))
                self._clock.sync()
                self._calls.setdefault(key, deque(maxlen=3)).append(time.perf_counter() - c0)
        except ValueError:  # a batch the kernel's features do not divide: not replayable
            return True
        finally:
            for name, value in saved.items():
                setattr(kernel, name, value)
            for name, tensor in counters.items():
                getattr(kernel, name).copy_(tensor)
        if marks and marks[0][0] is None:
            recent_empty = self._empty.setdefault(index, deque(maxlen=self.window))
            recent_empty.append(self._clock.seconds(marks[0][1], marks[0][2]))
        if len(marks) > 1:
            empty = self._clock.seconds(marks[0][1], marks[0][2])
            for shard, a, b in marks[1:]:
                assert shard is not None
                recent = self._fwd.setdefault(shard.key, deque(maxlen=self.window))
                recent.append(max(0.0, self._clock.seconds(a, b) - empty))
                self._shards[shard.key] = shard
                if probed.backward:
                    self._whole.add(shard.key)
        return fits

    def _on_kernel_call(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._capturing:
            self._captured[id(module)] = (tuple(args), dict(kwargs))

    # ------------------------------------------------------------------ results
    def forward_seconds(self) -> dict[ShardKey, float]:
        """Each shard's median timed seconds, by :attr:`LocalShard.key`: forward and
        backward where the kernel allows a zero-gradient backward, else forward."""
        return {key: statistics.median(v) for key, v in self._fwd.items() if v}

    def shard_costs(self, bwd_over_fwd: float) -> list[ShardCost]:
        """Each probed shard's forward + backward in ms: as timed, or for a kernel timed
        forward only, the backward priced as forward × ``bwd_over_fwd`` (the rank's
        measured compute ratio)."""
        out = []
        for key, recent in sorted(self._fwd.items()):
            if not recent:
                continue
            fwd = statistics.median(recent)
            shard = self._shards[key]
            scale = 1e3 * (1.0 if key in self._whole else 1 + bwd_over_fwd)
            out.append(
                ShardCost(
                    table=shard.table,
                    rank=self.rank,
                    col_offset=shard.col_offset,
                    cols=shard.cols,
                    row_offset=shard.row_offset,
                    rows=shard.rows,
                    ms=scale * fwd,
                    samples=len(recent),
                    spread_ms=scale * median_spread(list(recent)),
                )
            )
        return out

    def empty_ms(self, bwd_over_fwd: float) -> float:
        """The rank's kernels with every bag empty, in ms (their medians summed): what
        they cost whatever they hold. A kernel timed forward only has its backward
        priced as forward × ``bwd_over_fwd``, as its shards are."""
        total = 0.0
        for index, recent in self._empty.items():
            if recent:
                whole = self.kernels[index].backward
                total += 1e3 * statistics.median(recent) * (1.0 if whole else 1 + bwd_over_fwd)
        return total

    def stats(self) -> ProbeStats:
        return ProbeStats(
            seconds=self.seconds, train_seconds=self.train_seconds, windows=self.windows
        )


def median_spread(values: Sequence[float]) -> float:
    """How far the median of ``values`` may be off (its standard error, from their
    median absolute deviation: robust to the one window a busy machine disturbed);
    with fewer than 3 values, the median itself (nothing says better)."""
    if len(values) < 3:
        return float(statistics.median(values)) if values else 0.0
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return float(1.2533 * 1.4826 * mad / math.sqrt(len(values)))


def _has_cache(kernel: Any) -> bool:
    """A kernel with a UVM cache: a forward would prefetch rows and change the cache's
    contents, so the probe leaves it alone."""
    cache = getattr(kernel, "lxu_cache_weights", None)
    return isinstance(cache, torch.Tensor) and cache.numel() > 0
