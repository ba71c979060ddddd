"""Batched, cached inference over a cost model, for planners and ``evaluate --predict``.

:class:`CostPredictor` prices many candidate kernels (shard sets) and all-to-alls per
call and caches what it priced; :meth:`CostPredictor.predict_plan` gives a plan's
per-rank cost in the evaluator's shape (:class:`PlanPrediction`).

A calibrated model's speed factors (:class:`~shardwise.planner.costmodel.artifact.SpeedFactors`)
are applied here, to every second the predictor returns: forward and backward
compute, and the all-to-all's transfer (the forward's straggler wait is the other
ranks' forward compute, already scaled, so it is not scaled twice). Table encodings
(:meth:`CostPredictor.encodings`) are the networks' own and stay unscaled.

A model calibrated on a job's ranks carries a rank head
(:mod:`~shardwise.planner.costmodel.rankhead`): its tables measured alone and a fitted
fusion factor. The predictor then prices every kernel through it, and its
:meth:`CostPredictor.encodings` are the head's per-shard channels, so a search that sums
them prices exactly what :meth:`CostPredictor.compute` does.

A predictor prices a plan's all-to-all with its :attr:`CostPredictor.comm_model`
(docs/comm.md): the cost model's own network by default, or a declared model (an
interconnect preset, a fit) given at construction, which is declared, not learned,
and so not scaled by the speed factors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from shardwise.basics import UserError
from shardwise.planner.comm.collectives import (
    ALL_TO_ALL,
    CommPart,
    describe_parts,
    plan_kind_parts,
)
from shardwise.planner.comm.hosts import comm_local_world
from shardwise.planner.comm.model import CommModel, LearnedComm
from shardwise.planner.costmodel.anchored import AnchoredPricer
from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.features import (
    TableKey,
    rank_features,
    rank_features_many,
    set_features,
    table_features,
    table_key,
)
from shardwise.planner.costmodel.networks import comm_seconds
from shardwise.planner.costmodel.rankhead import (
    UNCALIBRATED_SIGMA,
    AnchoredHead,
    RankHead,
    rank_head_of,
)
from shardwise.planner.kinds import FUSED_GROUP, SHORT
from shardwise.planner.plan import Plan, PlanCost, Predicted, RankCost
from shardwise.planner.tables import TableSpec

# A table (or shard) as the cost model sees it: (name, rows, cols, dtype, pooling).
SetKey = frozenset[tuple[TableKey, int]]


class _InKernel(Protocol):
    """What :func:`kernel_order` reads of a shard (``KernelShard``, the profiler's
    ``ShardLoad``)."""

    @property
    def group(self) -> str: ...
    @property
    def local_batch(self) -> bool: ...
    @property
    def spec(self) -> TableSpec: ...


def kernel_order(shards: Sequence[_InKernel]) -> list[tuple[str, bool, str, list[int]]]:
    """The kernels a rank's ``shards`` run in: ``(group, local_batch, dtype, shard
    indices)``, the fused group first, then the other groups by name, fp32 before fp16
    (one TBE per group and precision, as DMP runs them). The one grouping both the
    predictor (:meth:`CostPredictor.plan_kernels`) and the evaluator's compute
    benchmark use, so a plan is priced with the kernels it is timed with."""
    keys = sorted(
        {(s.group, s.local_batch) for s in shards},
        key=lambda k: (k[0] != FUSED_GROUP, k[0], k[1]),
    )
    out = []
    for group, local in keys:
        for dtype in ("fp32", "fp16"):
            members = [
                k
                for k, s in enumerate(shards)
                if (s.group, s.local_batch) == (group, local) and s.spec.dtype == dtype
            ]
            if members:
                out.append((group, local, dtype, members))
    return out


def kernel_label(group: str) -> str:
    """The kinds a kernel group holds, as the per-rank tables say it."""
    return "TW/CW" if group == FUSED_GROUP else SHORT.get(group, group)


def kernel_json(
    group: str, dtype: str, batch_size: int, shards: Sequence[str], fwd_s: float, bwd_s: float
) -> dict[str, object]:
    """One kernel of a rank as ``rank_kernels`` holds it, predicted or measured."""
    return {
        "group": group,
        "kinds": kernel_label(group),
        "dtype": dtype,
        "batch_size": batch_size,
        "shards": list(shards),
        "fwd_s": fwd_s,
        "bwd_s": bwd_s,
    }


@dataclass(frozen=True)
class PlanPrediction(PlanCost):
    """The cost model's view of a plan, shaped like the measured ``Evaluation``."""

    model: dict[str, Any] = field(default_factory=dict)
    #: How the all-to-all was priced: ``CommModel.describe()`` and ``.kind``.
    comm: str = ""
    comm_kind: str = "learned"
    #: Per rank, each kernel priced (:func:`kernel_json`), as the evaluator times them.
    rank_kernels: list[list[dict[str, object]]] = field(default_factory=list)
    #: Each part of the comm with what priced it (``CommPart.to_json``).
    comm_parts: list[dict[str, object]] = field(default_factory=list)

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
            "comm": self.comm,
            "comm_kind": self.comm_kind,
            "max_compute_s": max(r.fwd_compute_s + r.bwd_compute_s for r in self.ranks),
            "max_compute_per_repeat": [],
            "compute_repeat_cv": None,
            "compute_per_repeat": [],
            "rank_kernels": self.rank_kernels,
            "comm_parts": self.comm_parts,
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

    Every network output is checked finite before it is cached or returned
    (:meth:`_finite`): a model that predicts NaN must stop the planner, never steer it
    (a NaN compares false with everything, and a search then piles all on rank 0).
    """

    def __init__(
        self, model: CostModel, comm: CommModel | None = None, *, max_cache: int = 1_000_000
    ) -> None:
        self.model = model
        self._comm_model = comm
        self.speed = model.speed_factors
        self._compute_scale = np.array([self.speed.fwd, self.speed.bwd], dtype=np.float64)
        #: The calibration's rank head, when the model has one (module docstring).
        self.rank_head: RankHead | None = rank_head_of(model.metadata, model.source)
        self._anchored = None if self.rank_head is None else AnchoredPricer(self, self.rank_head)
        self.anchored_head: AnchoredHead | None = (
            None if self._anchored is None else self._anchored.kernel_head
        )
        self.max_cache = max_cache
        self.net_calls = 0
        self._sets: dict[tuple[SetKey, int], tuple[float, float]] = {}
        self._nn_sets: dict[tuple[SetKey, int], tuple[float, float]] = {}
        self._enc: dict[tuple[TableKey, int], int] = {}  # -> row in self._enc_rows
        self._enc_rows = torch.zeros(0, model.compute.hidden)
        self._comm: dict[tuple[tuple[int, ...], tuple[float, ...], int], npt.NDArray[np.float64]]
        self._comm = {}

    def _finite(self, values: npt.NDArray[Any] | torch.Tensor, what: str) -> None:
        """A :class:`UserError` naming the model file when ``values`` holds NaN or inf."""
        if isinstance(values, torch.Tensor):
            ok = bool(torch.isfinite(values).all())
        else:
            ok = bool(np.isfinite(values).all())
        if not ok:
            raise UserError(
                f"{self.model.source} predicted a NaN or infinite {what}, so it cannot "
                "price plans (its weights or normalization overflow on these inputs). "
                "Re-train it with `shardwise pretrain`, or use another --model."
            )

    @property
    def comm_model(self) -> CommModel:
        """What prices the all-to-all (:meth:`predict_plan`, the planners): the one given
        at construction, else the cost model's network (:class:`LearnedComm`)."""
        if self._comm_model is None:
            self._comm_model = LearnedComm(self)
        return self._comm_model

    @comm_model.setter
    def comm_model(self, comm: CommModel) -> None:
        """Set after construction where the comm model needs this predictor
        (``resolve_comm(..., predictor=self)``)."""
        self._comm_model = comm

    @property
    def rank_sigma(self) -> float:
        """The log error spread of a rank this model prices from anchored tables: held
        out by the calibration, else :data:`UNCALIBRATED_SIGMA`."""
        return UNCALIBRATED_SIGMA if self.rank_head is None else self.rank_head.rank_sigma

    def clear_cache(self) -> None:
        self._sets.clear()
        self._nn_sets.clear()
        self._enc.clear()
        self._enc_rows = torch.zeros(0, self.model.compute.hidden)
        if self._anchored is not None:
            self._anchored.clear()
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
        self._finite(enc, "table encoding")
        start = self._enc_rows.shape[0]
        self._enc_rows = torch.cat([self._enc_rows, enc])
        for i, k in enumerate(missing):
            self._enc[k] = start + i

    def encodings(
        self, shards: Sequence[tuple[TableSpec, int]], batch_size: int
    ) -> npt.NDArray[np.float32]:
        """Each ``(table, cols)``'s encoding at ``batch_size`` (cached): what a search
        that keeps per-rank sums adds up itself, and gives to :attr:`anchored_head` (a
        calibrated model's channels ``[N, C]``) or the network's head (``[N, H]``)."""
        if self._anchored is not None:
            return self._anchored.channels(shards, batch_size)
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
        if self._anchored is not None:
            return self._kernels(shard_sets, batch_size, self._sets, self._price_anchored)
        return self._kernels(shard_sets, batch_size, self._sets, self._price)

    def network_compute(
        self, shard_sets: Sequence[Sequence[tuple[TableSpec, int]]], batch_size: int
    ) -> npt.NDArray[np.float64]:
        """:meth:`compute` by the network alone (with the speed factors), whatever head
        the model has: what prices a shard no calibration measured."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        return self._kernels(shard_sets, batch_size, self._nn_sets, self._price)

    def _kernels(
        self,
        shard_sets: Sequence[Sequence[tuple[TableSpec, int]]],
        batch_size: int,
        cache: dict[tuple[SetKey, int], tuple[float, float]],
        price: Any,
    ) -> npt.NDArray[np.float64]:
        """Each set → one or two kernels (one per precision), looked up in ``cache``
        first, the rest priced by ``price(todo, batch)`` in one call."""
        out = np.zeros((len(shard_sets), 2), dtype=np.float64)
        todo: dict[SetKey, list[tuple[TableSpec, int]]] = {}
        kernels_of: list[list[SetKey]] = []
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
                if (key, batch_size) not in cache:
                    todo[key] = group
            kernels_of.append(keys)
        # This call's results, so a cache cleared for size mid-call loses nothing.
        got = {k: cache[(k, batch_size)] for keys in kernels_of for k in keys if k not in todo}
        if todo:
            priced = price(todo, batch_size)
            if len(cache) + len(priced) > self.max_cache:
                cache.clear()
            for key, fb in priced.items():
                cache[(key, batch_size)] = fb
            got.update(priced)
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
            secs = torch.exp(log_s).double().numpy() * self._compute_scale
        self.net_calls += 1
        self._finite(secs, "compute cost")
        return {key: (f, b) for key, (f, b) in zip(todo, secs.tolist(), strict=True)}

    # ------------------------------------------------------------------ rank head

    def solo(
        self, shards: Sequence[tuple[TableSpec, int]], batch_size: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Each shard alone under the rank head, and its own log error spread
        (:meth:`AnchoredPricer.solo`)."""
        assert self._anchored is not None
        return self._anchored.solo(shards, batch_size)

    def _price_anchored(
        self, todo: Mapping[SetKey, list[tuple[TableSpec, int]]], batch_size: int
    ) -> dict[SetKey, tuple[float, float]]:
        assert self._anchored is not None
        secs = self._anchored.price(list(todo.values()), batch_size)
        self._finite(secs, "compute cost")
        return {key: (f, b) for key, (f, b) in zip(todo, secs.tolist(), strict=True)}

    def rank_sigmas(
        self, shard_sets: Sequence[Sequence[tuple[TableSpec, int]]], batch_size: int
    ) -> npt.NDArray[np.float64]:
        """Each set's log error spread: the rank head's (anchored ranks' σ, more for
        shards priced without an anchor), or :data:`UNCALIBRATED_SIGMA` without one."""
        if self._anchored is None:
            return np.full(len(shard_sets), UNCALIBRATED_SIGMA)
        return self._anchored.sigmas(shard_sets, batch_size)

    # ------------------------------------------------------------------ comm

    def _comm_seconds(
        self, log_out: torch.Tensor, wait: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fwd, bwd) seconds with the comm factor on the transfer, not on the wait."""
        fwd, bwd = comm_seconds(log_out.double(), torch.zeros_like(wait))
        return wait + self.speed.comm * fwd, self.speed.comm * bwd

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
                fwd, bwd = self._comm_seconds(log_out, wait)
            self.net_calls += 1
            hit = np.stack([fwd.numpy(), bwd.numpy()])
            self._finite(hit, "all-to-all cost")
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
            fwd, bwd = self._comm_seconds(log_out, wait)
        self.net_calls += 1
        self._finite(fwd, "all-to-all cost")
        self._finite(bwd, "all-to-all cost")
        return fwd.numpy(), bwd.numpy()

    # ------------------------------------------------------------------ plans

    def predict_plan(
        self, plan: Plan, tables: Sequence[TableSpec], batch_size_per_rank: int | None = None
    ) -> PlanPrediction:
        """Per-rank predicted cost of ``plan``, computed as the evaluator measures it:
        the kernels it times (:meth:`plan_kernels`), then the all-to-all of the
        table-wise and column-wise widths (:attr:`comm_model`, on the plan's hosts) with
        each rank's forward compute as its start delay, and the other kinds'
        collectives (:func:`~shardwise.planner.comm.collectives.plan_kind_parts`). The
        batch is the job's (``plan.topology.batch_size_per_rank``) unless given."""
        if batch_size_per_rank is None:
            batch_size_per_rank = plan.topology.batch_size_per_rank
        plan.validate_plan(tables, source=f"plan {plan.hash[:8] or '(unhashed)'}")
        world = plan.world_size
        comp, kernels = self.plan_kernels(plan, tables, batch_size_per_rank)
        dims = [
            sum(k.cols for k in shards if k.group == FUSED_GROUP)
            for shards in plan.kernel_shards(tables)
        ]
        comm = self.comm_model
        if world > 1:
            local_world = comm_local_world(comm, plan.topology)
            fwd_c, bwd_c = comm.one(dims, comp[:, 0].tolist(), batch_size_per_rank, local_world)
        else:
            fwd_c, bwd_c = np.zeros(1), np.zeros(1)
        parts = [CommPart(ALL_TO_ALL, np.asarray(fwd_c), np.asarray(bwd_c), comm.describe())]
        parts += plan_kind_parts(plan, comm, batch_size_per_rank)
        fwd_c = np.sum([p.fwd for p in parts], axis=0)
        bwd_c = np.sum([p.bwd for p in parts], axis=0)
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
                **({} if self.speed.identity else {"speed_factors": self.speed.to_dict()}),
            },
            comm=describe_parts(comm.describe(), parts[1:]),
            comm_kind=comm.kind,
            rank_kernels=kernels,
            comm_parts=[p.to_json() for p in parts],
        )

    def plan_compute(
        self, plan: Plan, tables: Sequence[TableSpec], batch_size_per_rank: int
    ) -> npt.NDArray[np.float64]:
        """(fwd, bwd) compute seconds ``[W, 2]`` of each rank: one kernel per kind group
        and precision (:func:`kernel_order`), each priced at its batch (the global
        batch, or the rank's own for data-parallel tables), summed."""
        return self.plan_kernels(plan, tables, batch_size_per_rank)[0]

    def plan_kernels(
        self, plan: Plan, tables: Sequence[TableSpec], batch_size_per_rank: int
    ) -> tuple[npt.NDArray[np.float64], list[list[dict[str, object]]]]:
        """:meth:`plan_compute` and each rank's kernels (:func:`kernel_json`): the
        kernels the evaluator times, each priced alone, one call per kernel key."""
        world = plan.world_size
        per_rank = plan.kernel_shards(tables)
        orders = [kernel_order(shards) for shards in per_rank]
        keys = sorted(
            {(g, local, dtype) for order in orders for g, local, dtype, _ in order},
            key=lambda k: (k[0] != FUSED_GROUP, k[0], k[1], k[2] != "fp32"),
        )
        priced: dict[tuple[str, bool, str], npt.NDArray[np.float64]] = {}
        for key in keys:
            sets = []
            for shards, order in zip(per_rank, orders, strict=True):
                members = next((m for g, lo, d, m in order if (g, lo, d) == key), [])
                sets.append([(shards[k].spec, shards[k].cols) for k in members])
            batch = batch_size_per_rank if key[1] else batch_size_per_rank * world
            priced[key] = self.compute(sets, batch)
        out = np.zeros((world, 2), dtype=np.float64)
        kernels: list[list[dict[str, object]]] = []
        for r, (shards, order) in enumerate(zip(per_rank, orders, strict=True)):
            mine = []
            for group, local, dtype, members in order:
                f, b = priced[(group, local, dtype)][r]
                out[r] += (f, b)
                batch = batch_size_per_rank if local else batch_size_per_rank * world
                names = [shards[k].spec.name for k in members]
                mine.append(kernel_json(group, dtype, batch, names, float(f), float(b)))
            kernels.append(mine)
        return out, kernels
