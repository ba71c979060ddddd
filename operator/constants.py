"""Names the operator, its children and the worker runtime agree on (docs/operator.md)."""

from __future__ import annotations

from shardwise.profiler.publish import LABEL_COMPONENT as LABEL_COMPONENT
from shardwise.profiler.publish import LABEL_JOB as LABEL_JOB
from shardwise.runtime.env import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PLAN_PATH,
    JOB_ENV,
    NAMESPACE_ENV,
    PLAN_ENV,
    PLAN_HASH_ENV,
)

GROUP = "shardwise.dev"
VERSION = "v1alpha1"
PLURAL = "dlrmjobs"
KIND = "DLRMJob"
API_VERSION = f"{GROUP}/{VERSION}"

#: Every child carries LABEL_JOB and LABEL_COMPONENT; these add detail.
LABEL_GPU_TYPE = f"{GROUP}/gpu-type"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_PLAN_HASH = f"{GROUP}/plan-hash"

COMPONENT_PROFILER = "profiler"
COMPONENT_PLAN = "plan"
COMPONENT_WORKER = "worker"
COMPONENT_COSTMODEL = "costmodel"

ANN_INPUTS_HASH = f"{GROUP}/inputs-hash"
ANN_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANN_GENERATION = f"{GROUP}/generation"
ANN_WORKERS = f"{GROUP}/workers"
ANN_PLAN = f"{GROUP}/plan"  # JSON summary of the plan and the model it was made with
ANN_PUBLISHED_AT = f"{GROUP}/published-at"
#: On a Job the operator gave up on (JSON: reason, message, at): a durable failure.
ANN_FAILURE = f"{GROUP}/failure"
#: On a profiling Job: the hash of its pod template (what a deterministic failure is about).
ANN_SETTINGS_HASH = f"{GROUP}/settings-hash"

#: The plan ConfigMap is mounted here; ``plan.json`` is what ``SHARDWISE_PLAN`` names.
PLAN_DIR = DEFAULT_PLAN_PATH.rsplit("/", 1)[0]
PLAN_KEY = DEFAULT_PLAN_PATH.rsplit("/", 1)[1]
TABLES_KEY = "tables.yaml"
TABLES_PATH = f"{PLAN_DIR}/{TABLES_KEY}"
PLAN_VOLUME = "shardwise-plan"

WORKER_CONTAINER = "worker"
RDZV_PORT = 29500
METRICS_PORT = DEFAULT_METRICS_PORT
#: The default training entry: a module of the installed package, which torchrun runs
#: as ``python -m`` (TorchRec's DLRM on synthetic data over the plan's tables).
DEFAULT_ENTRY = "shardwise.runtime.train"
#: ``torchrun`` that exits 0 when SIGTERM ended every rank after a checkpoint.
LAUNCHER = ("python", "-m", "shardwise.runtime.launch")

ENV_PLAN = PLAN_ENV
ENV_PLAN_HASH = PLAN_HASH_ENV
ENV_JOB = JOB_ENV
ENV_NAMESPACE = NAMESPACE_ENV
ENV_NNODES = "SHARDWISE_NNODES"
ENV_NPROC = "SHARDWISE_NPROC_PER_NODE"
ENV_RDZV_ENDPOINT = "SHARDWISE_RDZV_ENDPOINT"
ENV_RDZV_ID = "SHARDWISE_RDZV_ID"
RESERVED_ENV = frozenset(
    {
        ENV_PLAN,
        ENV_PLAN_HASH,
        ENV_JOB,
        ENV_NAMESPACE,
        ENV_NNODES,
        ENV_NPROC,
        ENV_RDZV_ENDPOINT,
        ENV_RDZV_ID,
    }
)
