"""The names every part of Shardwise agrees on, defined once: the API group and the
DLRMJob resource, the labels and annotations on its children, the environment the
operator gives the workers, where the plan is mounted, and the children's names.

The operator writes them, the profiling pods and the worker runtime read them, and a
restarted operator finds what an earlier one created by them, so a name changed here
changes the contract with every running job (docs/architecture.md, "Names").
"""

from __future__ import annotations

import hashlib
import re

# --------------------------------------------------------------------------- the resource
GROUP = "shardwise.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DLRMJob"
PLURAL = "dlrmjobs"

# --------------------------------------------------------------------------- labels
#: Every child carries the job's name and its component.
LABEL_JOB = f"{GROUP}/job"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_GPU_TYPE = f"{GROUP}/gpu-type"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_PLAN_HASH = f"{GROUP}/plan-hash"

# --------------------------------------------------------------------------- Kueue
#: The label that puts a DLRMJob (and so its Jobs) in a Kueue LocalQueue.
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
#: Kueue's WorkloadPriorityClass label: copied from the DLRMJob onto its Jobs.
LABEL_KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"
#: The label Kueue puts on a Job's Workload: the Job's uid.
LABEL_KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"
#: On a Job: ask Kueue for elastic workload slices (its parallelism may change while it
#: runs, each change a new slice of quota) ...
ANN_KUEUE_ELASTIC = "kueue.x-k8s.io/elastic-job"
#: ... which Kueue's webhook answers, where the feature is on, with this scheduling gate
#: in the pod template (Kueue lifts it from each pod its admitted slice covers).
KUEUE_ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_WORKLOADS = "workloads"

COMPONENT_PROFILER = "profiler"
COMPONENT_PLAN = "plan"
COMPONENT_WORKER = "worker"
COMPONENT_COSTMODEL = "costmodel"
#: Rank 0's live summary of the running job (written by the workers, read by the operator).
COMPONENT_LIVE = "live"
#: An elastic job's plans by world size (``plans_configmap_name``).
COMPONENT_PLANS = "plans"
#: A plan the profiling pod refined by measurement on the job's GPU type.
COMPONENT_REFINED_PLAN = "refined-plan"

# --------------------------------------------------------------------------- annotations
ANN_INPUTS_HASH = f"{GROUP}/inputs-hash"
ANN_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANN_GENERATION = f"{GROUP}/generation"
ANN_WORKERS = f"{GROUP}/workers"
#: JSON summary of the plan and the model it was made with (on the plan ConfigMap).
ANN_PLAN = f"{GROUP}/plan"
ANN_PUBLISHED_AT = f"{GROUP}/published-at"
#: On a Job the operator gave up on (JSON: reason, message, at): a durable failure.
ANN_FAILURE = f"{GROUP}/failure"
#: On a profiling Job: the hash of its pod template (what a deterministic failure is about).
ANN_SETTINGS_HASH = f"{GROUP}/settings-hash"
#: On a profiling attempt Job: the hash of the table signatures it calibrates on.
ANN_TABLES_HASH = f"{GROUP}/tables-hash"
#: On each chunk of a published payload (a cost model, a dataset).
ANN_PAYLOAD = f"{GROUP}/payload"
ANN_CHUNK_INDEX = f"{GROUP}/chunk-index"
ANN_CHUNK_COUNT = f"{GROUP}/chunk-count"
ANN_CHUNK_SHA = f"{GROUP}/chunk-sha256"
ANN_SHA = f"{GROUP}/sha256"
ANN_SIZE = f"{GROUP}/size-bytes"
ANN_FINGERPRINT = f"{GROUP}/fingerprint"

# --------------------------------------------------------------------------- environment
#: The mounted plan file (the runtime also takes ``--plan``).
ENV_PLAN = "SHARDWISE_PLAN"
#: The hash the plan ConfigMap was created for: a worker refuses another plan.
ENV_PLAN_HASH = "SHARDWISE_PLAN_HASH"
#: "1": torchrun runs elastic (``--nnodes=MIN:MAX``), the world may change in place, and
#: ``SHARDWISE_PLAN`` names a directory of ``plan-<ranks>.json`` (docs/resharding.md).
ENV_ELASTIC = "SHARDWISE_ELASTIC"
#: Seconds an elastic worker waits for its world's plan to appear in the mount.
ENV_PLAN_WAIT = "SHARDWISE_PLAN_WAIT"
ENV_JOB = "SHARDWISE_JOB"
ENV_NAMESPACE = "SHARDWISE_NAMESPACE"
#: Prometheus port of local rank 0 (local rank r: this + r; 0 turns it off).
ENV_METRICS_PORT = "SHARDWISE_METRICS_PORT"
ENV_NNODES = "SHARDWISE_NNODES"
ENV_NPROC = "SHARDWISE_NPROC_PER_NODE"
ENV_RDZV_ENDPOINT = "SHARDWISE_RDZV_ENDPOINT"
ENV_RDZV_ID = "SHARDWISE_RDZV_ID"
#: The ConfigMap rank 0 writes its live summary to (unset: no summary is written).
ENV_LIVE_CONFIGMAP = "SHARDWISE_LIVE_CONFIGMAP"
#: Where the ranks leave their stop markers for the launcher.
ENV_STOP_DIR = "SHARDWISE_STOP_DIR"
ENV_STOP_TIMEOUT = "SHARDWISE_STOP_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "SHARDWISE_COLLECTIVE_TIMEOUT"
ENV_CHECKPOINT_TIMEOUT = "SHARDWISE_CHECKPOINT_TIMEOUT"
ENV_RDZV_TIMEOUT = "SHARDWISE_RDZV_TIMEOUT"
#: Threads of the profiler's CPU kernels.
ENV_CPU_THREADS = "SHARDWISE_CPU_THREADS"
#: The variables the operator sets on a worker (a template may not set them).
OPERATOR_ENV = frozenset(
    {
        ENV_PLAN,
        ENV_PLAN_HASH,
        ENV_ELASTIC,
        ENV_JOB,
        ENV_NAMESPACE,
        ENV_NNODES,
        ENV_LIVE_CONFIGMAP,
        ENV_NPROC,
        ENV_RDZV_ENDPOINT,
        ENV_RDZV_ID,
    }
)

# --------------------------------------------------------------------------- the plan's mount
PLAN_DIR = "/etc/shardwise"
PLAN_KEY = "plan.json"
PLAN_PATH = f"{PLAN_DIR}/{PLAN_KEY}"
TABLES_KEY = "tables.yaml"
TABLES_PATH = f"{PLAN_DIR}/{TABLES_KEY}"
#: The key of a published payload's chunk in ``binaryData``.
PAYLOAD_KEY = "payload.tar.gz"
#: The key of the live summary (``planner.live.summary.LiveSummary`` as JSON).
LIVE_KEY = "live.json"


def world_plan_key(ranks: int) -> str:
    """The key (and file) of an elastic job's plan for ``ranks`` ranks in its plans
    ConfigMap (:func:`plans_configmap_name`)."""
    return f"plan-{ranks}.json"


# --------------------------------------------------------------------------- children's names
#: Jobs, Services and pod hostnames are limited to a DNS label.
MAX_NAME = 63


def _digest(text: str, n: int = 5) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def slug(value: str, limit: int = 20) -> str:
    """A DNS-label-safe form of ``value`` (e.g. a GPU product name), unique by a hash
    suffix when it had to be shortened or changed."""
    s = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-") or "x"
    if s != value or len(s) > limit:
        s = f"{s[: max(1, limit - 5)].strip('-')}-{_digest(value, 4)}"
    return s


def child_name(job: str, *parts: str) -> str:
    """``<job>-<parts…>``, shortened with a hash when longer than a DNS label: the same
    job always maps to the same names, so a restarted operator duplicates nothing."""
    name = "-".join((job, *parts))
    if len(name) <= MAX_NAME:
        return name
    return f"{name[: MAX_NAME - 6].rstrip('-')}-{_digest(name)}"


def workers_name(job: str) -> str:
    """The worker Job and its headless Service share this name."""
    return child_name(job, "workers")


def plan_configmap_name(job: str, plan_hash: str) -> str:
    return child_name(job, "plan", plan_hash[:8])


def plans_configmap_name(job: str) -> str:
    """An elastic job's plans, one per world size it has been planned for, mounted on
    its workers: the world can change while they run (docs/resharding.md)."""
    return child_name(job, "plans")


def live_configmap_name(job: str) -> str:
    """The ConfigMap rank 0 of the running workers keeps its live summary in."""
    return child_name(job, "live")


def refined_plan_name(job: str, world_size: int, key: str) -> str:
    """A plan the profiling pod refined for ``world_size`` ranks (``key``: its inputs)."""
    return child_name(job, "refined", str(world_size), key[:8])


def profiling_job_name(job: str, gpu_type: str, attempt: int) -> str:
    return child_name(job, "profile", slug(gpu_type), str(attempt))


def costmodel_name(gpu_type: str) -> str:
    """The published cost model of a GPU type, shared by every job in the namespace
    (chunks are ``<name>-<i>``)."""
    return f"shardwise-costmodel-{slug(gpu_type, 40)}"
