"""The GPUs a plan is made for: how many, on how many hosts, their memory, device and batch.

Ranks are numbered host by host (as torchrun numbers them): host ``h`` holds ranks
``h × gpus_per_host`` … ``(h + 1) × gpus_per_host - 1``. Without ``gpus_per_host``
every GPU is on one host. Table-row-wise and grid shards stay within one host, and
their comm runs first over the host's link, then between hosts
(:mod:`shardwise.planner.comm.links`).

Apart from :mod:`shardwise.planner.plan` because the memory rule
(:mod:`shardwise.planner.memory`) needs it and the plan needs the memory rule.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from shardwise.basics import MAX_BYTES, format_bytes

#: Share of each GPU's memory a plan leaves free for what the memory rule does not count
#: (planner/memory.py counts weights, optimizer state and the shards' I/O buffers): the
#: data-parallel side's activations and received embeddings, CUDA/NCCL context and
#: allocator fragmentation. TorchRec keeps the same 15% margin on top of the same
#: counts (docs/memory.md says why it did not shrink).
DEFAULT_MEMORY_RESERVE = 0.15
#: The most ranks a plan may have: bounds what reading a file may allocate (a
#: validation walks every rank), far above any cluster.
MAX_RANKS = 2**16


class Topology(BaseModel):
    """The GPUs a plan is made for."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(ge=1, le=MAX_RANKS)
    gpu_memory_bytes: int = Field(gt=0, le=MAX_BYTES)
    device: Literal["cuda", "cpu"] = "cuda"
    batch_size_per_rank: int = Field(default=65536, gt=0)
    memory_reserve: float = Field(default=DEFAULT_MEMORY_RESERVE, ge=0, lt=1)
    #: GPUs per host (``gpusPerWorker`` in a DLRMJob); ``None``: one host holds all.
    gpus_per_host: int | None = Field(default=None, ge=1, le=MAX_RANKS)

    @model_validator(mode="after")
    def _whole_hosts(self) -> Topology:
        if self.gpus_per_host is not None and self.gpus % self.gpus_per_host:
            raise ValueError(
                f"gpus {self.gpus} is not a whole number of hosts of gpus_per_host "
                f"{self.gpus_per_host}; give a multiple of it"
            )
        return self

    @model_serializer(mode="wrap")
    def _drop_default_hosts(self, handler: Any) -> Any:
        """One host is written as no ``gpus_per_host``, so plans and their hashes made
        before hosts existed stay as they were."""
        out = handler(self)
        if isinstance(out, dict) and out.get("gpus_per_host") is None:
            out.pop("gpus_per_host", None)
        return out

    @property
    def local_world(self) -> int:
        """GPUs per host."""
        return self.gpus_per_host or self.gpus

    @property
    def hosts(self) -> int:
        return self.gpus // self.local_world

    @property
    def usable_bytes(self) -> int:
        """Memory per rank a plan may fill: ``gpu_memory_bytes`` less the reserve."""
        return int(self.gpu_memory_bytes * (1.0 - self.memory_reserve))

    def describe_capacity(self) -> str:
        return (
            f"each GPU has {format_bytes(self.usable_bytes)} after a "
            f"{self.memory_reserve:.0%} reserve of {format_bytes(self.gpu_memory_bytes)}"
        )
