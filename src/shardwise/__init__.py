"""Shardwise: sharding-aware placement of DLRM embedding tables.

Subpackages: :mod:`shardwise.planner` (tables, plans, planners),
:mod:`shardwise.profiler` (kernel measurements, cost models), :mod:`shardwise.runtime`
(the worker side: the plan drives TorchRec training under torchrun) and
:mod:`shardwise.operator` (the Kubernetes operator).
"""

__version__ = "0.1.0"
