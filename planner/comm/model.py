"""How a plan's embedding all-to-all is costed: measured, learned or modelled (docs/comm.md).

The embedding cost of a plan (docs/design.md §6) has two parts: each rank's compute,
which every host can measure, and the all-to-all, which only a host that gives each
rank its own GPU or core can measure honestly (W gloo processes on 2 cores measure
the OS scheduler). A :class:`CommModel` is the one answer the planner, the evaluator,
refinement and the bench share, so they never disagree about the comm:

- :class:`MeasuredComm` (kind ``measured``): real all-to-alls; only the evaluator can
  run them.
- :class:`LearnedComm` (kind ``learned``): the cost model's all-to-all network.
- :class:`AlphaBetaComm` (kind ``modelled``): α + bytes/β per all-to-all, from a named
  interconnect preset (:data:`PRESETS`, each with its sources) or fitted to a comm
  dataset measured on the target (:func:`shardwise.planner.comm.fit.fit_alpha_beta`).
- :class:`~shardwise.planner.comm.hosts.HostPreset` (kind ``modelled``): a host
  preset, one link within a host and another between hosts (``hgx-h100``).

:func:`shardwise.planner.comm.choice.resolve_comm` turns a ``--comm`` value into one of
them, and ``describe()`` is the one line every command prints, so each figure says where
its comm came from.

This module stays free of torch at import time (the operator's process loads the
planner) and of the profiler (the layers point one way).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from shardwise.basics import UserError

Array = npt.NDArray[np.float64]

#: Pooled embedding outputs (and their gradients) travel as fp32, whatever the
#: tables' precision: TorchRec's default output dtype.
OUTPUT_BYTES = 4


class CommModel(ABC):
    """Per-rank forward and backward all-to-all seconds of an embedding exchange.

    ``kind`` is ``modelled``, ``learned`` or ``measured``; ``name`` the preset or model
    name; ``auto_reason`` is set by :func:`resolve_comm` when ``--comm auto`` chose
    this model, and says why.
    """

    kind: str
    name: str
    auto_reason: str | None = None

    @abstractmethod
    def summary(self) -> str:
        """What this model is, without its kind (e.g. ``nvlink preset (…)``)."""

    def describe(self) -> str:
        """One line for every command's output: kind, what, and why when chosen by auto."""
        line = f"{self.kind}: {self.summary()}"
        return line if self.auto_reason is None else f"auto → {line}; {self.auto_reason}"

    @abstractmethod
    def all_to_all(
        self,
        dims: Array,
        fwd_compute: Array,
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        """``M`` all-to-alls of one world size at once: each rank's output width
        ``dims[M, W]`` and forward compute seconds ``fwd_compute[M, W]`` (its start
        delay) → per-rank (fwd, bwd) seconds ``[M, W]``. The forward includes the
        straggler wait ``max(fwd_compute) - fwd_compute[r]``; W == 1 costs nothing.
        ``local_world``: ranks per host, for a model that knows hosts (a host preset;
        the others price every peer over their one link)."""

    def one(
        self,
        dims: Sequence[int],
        fwd_compute: Sequence[float],
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        """:meth:`all_to_all` for a single collective: ``(fwd[W], bwd[W])``."""
        fwd, bwd = self.all_to_all(
            np.asarray([dims], dtype=np.float64),
            np.asarray([fwd_compute], dtype=np.float64),
            batch_size_per_rank,
            local_world,
        )
        return fwd[0], bwd[0]


def _checked(
    dims: Array | Sequence[Sequence[float]],
    fwd_compute: Array | Sequence[Sequence[float]],
    batch_size_per_rank: int,
) -> tuple[Array, Array]:
    d = np.asarray(dims, dtype=np.float64)
    c = np.asarray(fwd_compute, dtype=np.float64)
    if d.ndim != 2 or d.shape != c.shape:
        raise ValueError(f"dims {d.shape} and fwd_compute {c.shape} must both be [M, W]")
    if batch_size_per_rank < 1:
        raise ValueError("batch_size_per_rank must be >= 1")
    return d, c


def straggler_wait(fwd_compute: Array) -> Array:
    """Each rank's wait in the forward all-to-all for the slowest rank's compute."""
    result: Array = fwd_compute.max(axis=1, keepdims=True) - fwd_compute
    return result


def exchange_bytes(dims: Array, batch_size_per_rank: int) -> Array:
    """``[M]``: the largest of every rank's sent and received bytes in one all-to-all.

    Rank ``r`` has ``dims[r]`` pooled columns for the global batch and sends each of the
    W-1 others its ``batch_size_per_rank`` rows of them; it receives every other
    rank's columns for its own rows. The backward sends the gradients back: the same
    sizes, the roles swapped, so the same maximum.
    """
    w = dims.shape[1]
    row = batch_size_per_rank * OUTPUT_BYTES
    sent = row * dims * (w - 1)
    received = row * (dims.sum(axis=1, keepdims=True) - dims)
    result: Array = np.maximum(sent, received).max(axis=1)
    return result


def ring_bytes(collective: str, size: float, ranks: int) -> float:
    """Bytes a rank moves in a ring ``collective`` of ``size`` bytes over ``ranks``:
    the input of a reduce-scatter (the output of an all-gather) ``(n-1)/n`` of it, an
    all-reduce ``2(n-1)/n``. What a fit of measured collectives is fitted on."""
    share = (ranks - 1) / ranks if ranks > 0 else 0.0
    return size * share * (2.0 if collective == "all_reduce" else 1.0)


# ------------------------------------------------------------------ α–β


def format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e3:.3g} ms"


def format_bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


@dataclass(frozen=True)
class AlphaBetaComm(CommModel):
    """α + bytes/β per all-to-all, the same for every rank (a collective ends together).

    Per all-to-all, each rank's time is ``alpha_s`` plus the largest of every rank's
    sent and received bytes (:func:`exchange_bytes`) over ``bytes_per_s``, the
    bandwidth one GPU gets in an all-to-all (what nccl-tests reports as bus
    bandwidth). The forward adds each rank's straggler wait; the backward is the same
    exchange without it. ``source`` says where the numbers come from.
    """

    name: str
    alpha_s: float
    bytes_per_s: float
    source: str
    #: What the numbers stand for, e.g. "NVLink 4 through NVSwitch (H100 HGX)".
    label: str = ""
    auto_reason: str | None = None
    kind: str = "modelled"
    #: α–β of other collectives fitted on the same target (``reduce_scatter``,
    #: ``all_reduce``: :func:`shardwise.planner.comm.fit.fit_collectives`), by name.
    collectives: tuple[tuple[str, AlphaBetaComm], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise UserError(f"comm model {self.name!r}: α must be ≥ 0 s, got {self.alpha_s}.")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise UserError(
                f"comm model {self.name!r}: β must be > 0 bytes/s, got {self.bytes_per_s}."
            )

    def short(self) -> str:
        """``nvlink (α 20 µs, 370 GB/s per GPU)``: the link as a host preset names it."""
        return (
            f"{self.name} (α {format_seconds(self.alpha_s)}, "
            f"{format_bandwidth(self.bytes_per_s)} per GPU)"
        )

    def summary(self) -> str:
        what = f"{self.name} preset" if self.name in PRESETS else self.name
        numbers = f"α {format_seconds(self.alpha_s)}, {format_bandwidth(self.bytes_per_s)} per GPU"
        return f"{what} ({self.label}; {numbers})" if self.label else f"{what} ({numbers})"

    def all_to_all(
        self,
        dims: Array,
        fwd_compute: Array,
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        d, c = _checked(dims, fwd_compute, batch_size_per_rank)
        m, w = d.shape
        if w < 2:
            return np.zeros((m, w)), np.zeros((m, w))
        per = self.alpha_s + exchange_bytes(d, batch_size_per_rank) / self.bytes_per_s
        bwd = np.repeat(per[:, None], w, axis=1)
        return bwd + straggler_wait(c), bwd


#: NCCL's developers put its protocol overhead on NVLink at about 20 % of the line
#: rate; the presets whose bandwidth is only published as a line rate take the same.
PROTOCOL_EFFICIENCY = 0.8

#: Interconnect classes, named for what carries a GPU's all-to-all traffic. The
#: bandwidth is per GPU and direction, as an all-to-all sees it.
PRESETS: dict[str, AlphaBetaComm] = {
    "nvlink": AlphaBetaComm(
        name="nvlink",
        label="NVLink 4 through NVSwitch, 8-GPU H100 HGX/DGX class",
        alpha_s=20e-6,
        bytes_per_s=370e9,
        source=(
            "β: NVIDIA's H100 SXM datasheet gives NVLink 900 GB/s per GPU, both directions "
            "together (450 GB/s each way); NCCL's developers put NCCL's effective NVLink "
            "bandwidth after its ~20 % protocol overhead at ~370 GB/s, the bus bandwidth "
            "nccl-tests reports for all-to-all on such a node. α: nccl-tests alltoall_perf "
            "takes 10–12 µs for its smallest messages on one 8-GPU node; doubled for "
            "torch.distributed's call and split-size exchange (our estimate)."
        ),
    ),
    "nvlink3": AlphaBetaComm(
        name="nvlink3",
        label="NVLink 3 through NVSwitch, 8-GPU A100 HGX/DGX class",
        alpha_s=20e-6,
        bytes_per_s=300e9 * PROTOCOL_EFFICIENCY,
        source=(
            "β: NVIDIA's A100 SXM datasheet gives NVLink 600 GB/s per GPU, both directions "
            "together (300 GB/s each way), less the ~20 % NCCL protocol overhead its "
            "developers quote for NVLink: 240 GB/s. α: as the nvlink preset."
        ),
    ),
    "infiniband": AlphaBetaComm(
        name="infiniband",
        label="NDR InfiniBand, one 400 Gb/s NIC per GPU, DGX H100 class",
        alpha_s=30e-6,
        bytes_per_s=48e9,
        source=(
            "β: NVIDIA's DGX H100 and ConnectX-7 specifications: one 400 Gb/s NDR port "
            "per GPU (50 GB/s line rate); NCCL's developers note that an all-to-all "
            "cannot aggregate several NICs, so a GPU gets one NIC, and that NDR "
            "reaches 48–49 GB/s per NIC in nccl-tests. Across nodes most of an "
            "all-to-all's bytes cross the network, so the NIC bounds it. α: the "
            "single-node figure plus a network round trip of ~10 µs (our estimate)."
        ),
    ),
    "pcie": AlphaBetaComm(
        name="pcie",
        label="PCIe Gen4 x16 between GPUs, no NVLink",
        alpha_s=20e-6,
        bytes_per_s=31.5e9 * PROTOCOL_EFFICIENCY,
        source=(
            "β: the PCI-SIG PCIe 4.0 base specification: 16 GT/s on 16 lanes with "
            "128b/130b encoding is 31.5 GB/s each way; less ~20 % protocol overhead "
            "(as NCCL on NVLink): 25 GB/s. GPUs behind one PCIe switch share its "
            "uplink and get less: fit one (fitted:DIR) for such a box. α: as nvlink."
        ),
    ),
    "ethernet": AlphaBetaComm(
        name="ethernet",
        label="100 Gb/s Ethernet (RoCE) per GPU",
        alpha_s=50e-6,
        bytes_per_s=12.5e9 * PROTOCOL_EFFICIENCY,
        source=(
            "β: IEEE 802.3 100GBASE: 100 Gb/s is 12.5 GB/s each way; less ~20 % "
            "protocol overhead: 10 GB/s per GPU. A NIC shared by k GPUs gives each "
            "1/k of it: fit one (fitted:DIR) for such a cluster. α: our estimate, "
            "above InfiniBand's for Ethernet's longer software path."
        ),
    ),
}


# ------------------------------------------------------------------ learned, measured


class ModelFile(Protocol):
    """What comm reads of a :class:`~shardwise.planner.costmodel.artifact.CostModel`:
    its metadata (the learned collectives) and where it came from. A protocol, so this
    module does not import the model file's module back."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def source(self) -> str: ...


class CommNetwork(Protocol):
    """What :class:`LearnedComm` asks of a
    :class:`~shardwise.planner.costmodel.predictor.CostPredictor`: a protocol, so the
    predictor (which prices comm through this module) is not imported back here."""

    @property
    def model(self) -> ModelFile: ...

    def comm(
        self, dims: Sequence[int], delays: Sequence[float], batch_size_per_rank: int = 128
    ) -> tuple[Array, Array]: ...

    def comm_many(
        self, dims: Array, delays: Array, batch_size_per_rank: int = 128
    ) -> tuple[Array, Array]: ...


class LearnedComm(CommModel):
    """The cost model's all-to-all network (:meth:`CommNetwork.comm_many`). The
    collectives the model learned besides are read by
    :func:`~shardwise.planner.comm.learned.model_collectives` (that module builds on
    this one, so this one does not import it back)."""

    kind = "learned"
    name = "model"

    def __init__(self, predictor: CommNetwork, auto_reason: str | None = None) -> None:
        self.predictor = predictor
        self.auto_reason = auto_reason

    def summary(self) -> str:
        return f"the cost model's all-to-all network ({self.predictor.model.source})"

    def all_to_all(
        self,
        dims: Array,
        fwd_compute: Array,
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        d, c = _checked(dims, fwd_compute, batch_size_per_rank)
        return self.predictor.comm_many(d, c, batch_size_per_rank)

    def one(
        self,
        dims: Sequence[int],
        fwd_compute: Sequence[float],
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        return self.predictor.comm(dims, fwd_compute, batch_size_per_rank)  # cached


class MeasuredComm(CommModel):
    """Real all-to-alls over ``torch.distributed``: only the evaluator runs them
    (:mod:`shardwise.profiler.evaluate`); pricing with it is an error."""

    kind = "measured"
    name = "measured"

    def __init__(
        self,
        auto_reason: str | None = None,
        warning: str | None = None,
        backend: str | None = None,
    ) -> None:
        self.auto_reason = auto_reason
        #: Why this host cannot measure it honestly, when measured anyway.
        self.warning = warning
        #: The backend that measured (nccl, gloo), once the evaluator has.
        self.backend = backend

    def summary(self) -> str:
        if self.backend is None:
            line = "real all-to-alls over torch.distributed (nccl on GPUs, gloo on CPU)"
        else:
            line = f"real {self.backend} all-to-alls over torch.distributed, a process per rank"
        return line if self.warning is None else f"{line}; NOT honest here: {self.warning}"

    def all_to_all(
        self,
        dims: Array,
        fwd_compute: Array,
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        raise UserError(
            "--comm measured: only the evaluator measures all-to-alls; a planner prices "
            "them with a model. Give --comm model, a preset or fitted:DIR (docs/comm.md)."
        )
