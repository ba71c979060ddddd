"""What a plan depends on (:class:`PlanInputs`): everything in the spec and the cluster
that changes the plan.

Its hash names "the plan for these inputs" (annotation on the plan ConfigMap), so a
spec change that alters any of it re-plans and one that does not (an image, a
profiling knob) does not. The decision, the refined plans' match and the planner
process all key on it.

Hosts: each worker pod is one host of ``gpus_per_worker`` ranks (torchrun's
``--nproc_per_node``, so its ``LOCAL_WORLD_SIZE``, which TorchRec reads to find a
rank's host), on CPU workers too. The topology says so whenever there are several
pods, and the hash covers it: a plan made before plans knew their hosts (one host
assumed) is not the plan for these inputs, so table-row-wise and grid shards and the
two-level comm are planned on the hosts the workers run. One pod is one host, written
as no ``gpus_per_host`` (the topology's default), so a one-pod job keeps its hash.
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

    @property
    def gpus_per_host(self) -> int | None:
        """Ranks per host: a worker pod's, when there are several pods (module docstring)."""
        return self.gpus_per_worker if self.workers > 1 else None

    def topology(self) -> Topology:
        return Topology(
            gpus=self.world_size,
            gpu_memory_bytes=self.gpu_memory_bytes,
            device="cpu" if self.device == "cpu" else "cuda",
            batch_size_per_rank=self.batch_size_per_rank,
            memory_reserve=self.memory_reserve,
            gpus_per_host=self.gpus_per_host,
        )

    def hash(self) -> str:
        body = asdict(self)
        if self.gpus_per_host is not None:
            body["gpus_per_host"] = self.gpus_per_host
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
