"""The GPUs a plan is made for: how many, their memory, device and batch.

Apart from :mod:`shardwise.planner.plan` because the memory rule
(:mod:`shardwise.planner.memory`) needs it and the plan needs the memory rule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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

    @property
    def usable_bytes(self) -> int:
        """Memory per rank a plan may fill: ``gpu_memory_bytes`` less the reserve."""
        return int(self.gpu_memory_bytes * (1.0 - self.memory_reserve))

    def describe_capacity(self) -> str:
        return (
            f"each GPU has {format_bytes(self.usable_bytes)} after a "
            f"{self.memory_reserve:.0%} reserve of {format_bytes(self.gpu_memory_bytes)}"
        )
