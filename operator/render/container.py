"""What only the operator's rendering needs: the worker pod's container, ports and
entry. The names every part agrees on (group, labels, annotations, environment, the
plan's mount, children's names) are in :mod:`shardwise.names`."""

from __future__ import annotations

from shardwise.runtime.env import DEFAULT_METRICS_PORT

#: The plan ConfigMap's volume in the worker pod (mounted at ``names.PLAN_DIR``).
PLAN_VOLUME = "shardwise-plan"
WORKER_CONTAINER = "worker"
RDZV_PORT = 29500
METRICS_PORT = DEFAULT_METRICS_PORT
#: The default training entry: a module of the installed package, which torchrun runs
#: as ``python -m`` (TorchRec's DLRM on synthetic data over the plan's tables).
DEFAULT_ENTRY = "shardwise.runtime.train"
#: ``torchrun`` that exits 0 when SIGTERM ended every rank after a checkpoint.
LAUNCHER = ("python", "-m", "shardwise.runtime.launch")
