"""Host presets: a job as hosts × GPUs, one link within a host, another between hosts
(docs/comm.md).

A flat preset (:data:`~shardwise.planner.comm.model.PRESETS`) prices every byte on
one link. A job on several hosts is not like that: NVLink joins the GPUs of one host,
a NIC per GPU joins the hosts, an order of magnitude apart. A :class:`HostPreset`
holds both links and prices the pooled all-to-all in two levels: each rank's traffic
to the peers on its own host over the link within, to the other hosts' ranks over the
link between, both at once (separate links), so the slower of the two bounds it. The
other kinds' collectives use the same two links
(:mod:`shardwise.planner.comm.collectives`).

Ranks are numbered host by host (:class:`~shardwise.planner.topology.Topology`); a
plan's ``gpus_per_host`` says how many share a host, and without it a host preset's
own count does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from shardwise.basics import UserError
from shardwise.planner.comm.model import (
    OUTPUT_BYTES,
    PRESETS,
    PROTOCOL_EFFICIENCY,
    AlphaBetaComm,
    CommModel,
    _checked,
    straggler_wait,
)

if TYPE_CHECKING:
    from shardwise.planner.topology import Topology

Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HostPreset(CommModel):
    """Hosts of ``gpus_per_host`` GPUs: ``intra`` within a host, ``inter`` between."""

    name: str
    label: str
    intra: AlphaBetaComm
    inter: AlphaBetaComm
    gpus_per_host: int
    source: str
    auto_reason: str | None = None
    kind: str = "modelled"

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise UserError(f"host preset {self.name!r}: gpus_per_host must be ≥ 1.")

    def summary(self) -> str:
        return (
            f"{self.name} host preset ({self.label}; within a host {self.intra.short()}, "
            f"between hosts {self.inter.short()})"
        )

    def all_to_all(
        self,
        dims: Array,
        fwd_compute: Array,
        batch_size_per_rank: int,
        local_world: int | None = None,
    ) -> tuple[Array, Array]:
        """Two levels (module docstring): per rank, the larger of its sent and received
        bytes to its own host's peers over ``intra`` and to the other hosts' over
        ``inter``; the collective takes the slower link's time, every rank alike."""
        d, c = _checked(dims, fwd_compute, batch_size_per_rank)
        m, w = d.shape
        if w < 2:
            return np.zeros((m, w)), np.zeros((m, w))
        per_host = min(local_world or self.gpus_per_host, w)
        intra_b, inter_b = two_level_bytes(d, batch_size_per_rank, per_host)
        per = np.maximum(
            np.where(intra_b > 0, self.intra.alpha_s + intra_b / self.intra.bytes_per_s, 0.0),
            np.where(inter_b > 0, self.inter.alpha_s + inter_b / self.inter.bytes_per_s, 0.0),
        )
        # An exchange of no bytes still costs a call (as the flat model's α).
        per = np.where(per > 0, per, self.intra.alpha_s)
        bwd = np.repeat(per[:, None], w, axis=1)
        return bwd + straggler_wait(c), bwd


def two_level_bytes(dims: Array, batch_size_per_rank: int, local_world: int) -> tuple[Array, Array]:
    """``([M], [M])``: the largest of every rank's sent and received bytes within its
    host, and between hosts, in the all-to-all of ``dims[M, W]`` (ranks host by host,
    ``local_world`` a host; the last host may hold fewer)."""
    w = dims.shape[1]
    host = np.arange(w) // local_world
    size = np.bincount(host).astype(np.float64)  # ranks per host
    onehot = np.zeros((w, int(host.max()) + 1))
    onehot[np.arange(w), host] = 1.0
    host_sum = (dims @ onehot)[:, host]  # [M, W]: the width of each rank's host
    total = dims.sum(axis=1, keepdims=True)
    row = batch_size_per_rank * OUTPUT_BYTES
    peers = size[host]
    intra = row * np.maximum(dims * (peers - 1), host_sum - dims)
    inter = row * np.maximum(dims * (w - peers), total - host_sum)
    return intra.max(axis=1), inter.max(axis=1)


#: NDR's achieved share of its line rate in nccl-tests (48 of 50 GB/s, the infiniband
#: preset's source), taken for HDR too: our assumption, stated.
_IB_EFFICIENCY = 48 / 50

_HDR = AlphaBetaComm(
    name="hdr",
    label="HDR InfiniBand, one 200 Gb/s NIC per GPU",
    alpha_s=30e-6,
    bytes_per_s=25e9 * _IB_EFFICIENCY,
    source=(
        "β: NVIDIA's DGX A100 datasheet: eight single-port ConnectX-6 200 Gb/s HDR "
        "InfiniBand adapters for the compute fabric, one per GPU (25 GB/s line rate), at "
        "the share of line rate NDR reaches in nccl-tests (48 of 50 GB/s): 24 GB/s. α: as "
        "the infiniband preset."
    ),
)
_EFA = AlphaBetaComm(
    name="efa",
    label="400 Gb/s EFA per 8-GPU instance, 50 Gb/s a GPU",
    alpha_s=50e-6,
    bytes_per_s=400e9 / 8 / 8 * PROTOCOL_EFFICIENCY,
    source=(
        "β: AWS's EC2 P4d instance page: 400 Gbps of Elastic Fabric Adapter networking "
        "per p4d.24xlarge, which holds 8 A100 GPUs: 50 Gb/s (6.25 GB/s) a GPU when all "
        "send at once, less ~20 % protocol overhead: 5 GB/s. α: as the ethernet preset "
        "(our estimate: EFA's libfabric path is longer than InfiniBand's)."
    ),
)

#: Host presets by name, selectable by ``--comm`` beside the flat :data:`PRESETS`.
HOST_PRESETS: dict[str, HostPreset] = {
    "hgx-h100": HostPreset(
        name="hgx-h100",
        label="8 H100 a host",
        intra=PRESETS["nvlink"],
        inter=PRESETS["infiniband"],
        gpus_per_host=8,
        source=(
            "NVIDIA's DGX H100 user guide: 8 H100 SXM GPUs on NVLink 4 through NVSwitch, "
            "and eight ConnectX-7 400 Gb/s NDR ports for the compute fabric, one per GPU; "
            "the links are the nvlink and infiniband presets, with their sources."
        ),
    ),
    "hgx-a100": HostPreset(
        name="hgx-a100",
        label="8 A100 a host",
        intra=PRESETS["nvlink3"],
        inter=_HDR,
        gpus_per_host=8,
        source=(
            "NVIDIA's DGX A100 datasheet: 8 A100 SXM GPUs on NVLink 3 through NVSwitch "
            "(the nvlink3 preset) and eight 200 Gb/s HDR InfiniBand adapters, one per "
            f"GPU. {_HDR.source}"
        ),
    ),
    "p4d": HostPreset(
        name="p4d",
        label="AWS p4d.24xlarge, 8 A100 an instance",
        intra=PRESETS["nvlink3"],
        inter=_EFA,
        gpus_per_host=8,
        source=(
            "AWS's EC2 P4d instance page: 8 A100 GPUs on NVSwitch (600 GB/s, the nvlink3 "
            f"preset) and 400 Gbps EFA an instance. {_EFA.source}"
        ),
    ),
}


def default_preset(world: int) -> AlphaBetaComm | HostPreset:
    """The interconnect a job of ``world`` GPUs most likely has: one NVLink host up to
    8 GPUs, H100 hosts of 8 (NVLink within, a 400 Gb/s NIC per GPU between) above."""
    return PRESETS["nvlink"] if world <= 8 else HOST_PRESETS["hgx-h100"]


def comm_local_world(comm: CommModel, topology: Topology) -> int:
    """Ranks per host as a plan's comm is priced: the plan's ``gpus_per_host``, else a
    host preset's own, else every rank on one host."""
    if topology.gpus_per_host is not None:
        return topology.gpus_per_host
    if isinstance(comm, HostPreset):
        return min(comm.gpus_per_host, topology.gpus)
    return topology.gpus


def hosts_of(world: int, local_world: int) -> int:
    """Hosts holding ``world`` ranks, ``local_world`` a host (the last may hold fewer)."""
    return max(1, math.ceil(world / max(local_world, 1)))
