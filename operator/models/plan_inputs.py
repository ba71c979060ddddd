"""What a plan depends on (:class:`PlanInputs`): everything in the spec and the cluster
that changes the plan.

Its hash names "the plan for these inputs" (annotation on the plan ConfigMap), so a
spec change that alters any of it re-plans and one that does not (an image, a
profiling knob) does not. The decision, the refined plans' match and the planner
process all key on it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from shardwise.planner.topology import Topology


@dataclass(frozen=True)
class PlanInputs:
    """What a plan depends on; ``tables`` is the spec's canonical form (inline specs or
    the ConfigMap reference: a referenced ConfigMap's later edits do not re-plan)."""

    tables: Any
    planner: str
    seed: int
    gpu_type: str
    workers: int
    gpus_per_worker: int
    gpu_memory_bytes: int
    memory_reserve: float
    batch_size_per_rank: int
    device: str

    @property
    def world_size(self) -> int:
        return self.workers * self.gpus_per_worker

    def topology(self) -> Topology:
        return Topology(
            gpus=self.world_size,
            gpu_memory_bytes=self.gpu_memory_bytes,
            device="cpu" if self.device == "cpu" else "cuda",
            batch_size_per_rank=self.batch_size_per_rank,
            memory_reserve=self.memory_reserve,
        )

    def hash(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
