"""What a user and the missing controllers do, over HTTP: nodes, DLRMJobs, Job and Pod
status. And :func:`wait_for`, the only way the operator tests synchronize."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from shardwise.names import LIVE_KEY, live_configmap_name
from shardwise.operator.config import OperatorConfig
from shardwise.operator.kube import ApiError, KubeApi
from shardwise.planner.live.summary import LiveSummary

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "dlrmjob.yaml"
NAMESPACE = "ml"
#: Short retries so that tests of retries take seconds.
TEST_CONFIG = OperatorConfig(
    error_backoff_seconds=0.2,
    max_error_backoff_seconds=2.0,
    tables_retry_seconds=1.0,
    max_tables_retry_seconds=4.0,
    publish_grace_seconds=5.0,
)
GPU_TYPE = "NVIDIA-A100-SXM4-80GB"
DJ = ("shardwise.dev/v1alpha1", "dlrmjobs")


def load_crd() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return crd


def wait_for(
    probe: Callable[[], T | None],
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except ApiError as err:  # e.g. not created yet
            last = err
        if last and not isinstance(last, ApiError):
            found: T = last
            return found
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {last!r}")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(
    name: str, gpu_type: str = GPU_TYPE, gpus: int = 8, memory_mib: int = 81920, **labels: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.product": gpu_type,
                "nvidia.com/gpu.memory": str(memory_mib),
                **labels,
            },
        },
    }


def add_node(kube: KubeApi, name: str, gpus: int = 8, **kwargs: Any) -> dict[str, Any]:
    """Create a node and report it Ready with ``gpus`` allocatable (as the kubelet does)."""
    kube.create(node(name, gpus=gpus, **kwargs))
    status = {
        "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "512Gi"},
        "capacity": {"nvidia.com/gpu": str(gpus)},
        "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": now()}],
    }
    return kube.patch("v1", "nodes", None, name, {"status": status}, "status")


def table(i: int, rows: int = 20_000, dim: int = 32, pooling: float = 4.0) -> dict[str, Any]:
    return {"name": f"t{i}", "rows": rows + 1000 * i, "dim": dim, "poolingFactor": pooling + i % 5}


def dlrmjob(
    name: str,
    namespace: str,
    tables: int | list[dict[str, Any]] = 6,
    *,
    gpus_per_worker: int = 2,
    workers: tuple[int, int] = (1, 2),
    policy: str = "Never",
    algorithm: str = "neuroshard",
    gpu_memory: str | None = "2Gi",
    **spec: Any,
) -> dict[str, Any]:
    entries = [table(i) for i in range(tables)] if isinstance(tables, int) else tables
    planner_block: dict[str, Any] = {"algorithm": algorithm, "batchSizePerRank": 4096}
    if gpu_memory is not None:
        planner_block["gpuMemory"] = gpu_memory
    body: dict[str, Any] = {
        "apiVersion": "shardwise.dev/v1alpha1",
        "kind": "DLRMJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "tables": {"inline": entries},
            "gpusPerWorker": gpus_per_worker,
            "workers": {"min": workers[0], "max": workers[1]},
            "template": {"image": "registry.example/shardwise:test"},
            "planner": planner_block,
            "profiling": {"policy": policy, "backoffSeconds": 1},
        },
    }
    for key, value in spec.items():
        body["spec"][key] = value
    return body


def get_job(kube: KubeApi, ns: str, name: str) -> dict[str, Any] | None:
    return kube.get(*DJ, ns, name)


def status_of(kube: KubeApi, ns: str, name: str) -> dict[str, Any]:
    obj = get_job(kube, ns, name) or {}
    return dict(obj.get("status") or {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def wait_phase(
    kube: KubeApi, ns: str, name: str, phase: str, timeout: float = 30.0, interval: float = 0.05
) -> dict[str, Any]:
    return wait_for(
        lambda: (s := status_of(kube, ns, name)).get("phase") == phase and s,
        timeout,
        interval,
        what=f"{name} in phase {phase} (status: {status_of(kube, ns, name)})",
    )


def set_job_status(kube: KubeApi, ns: str, name: str, **status: Any) -> dict[str, Any]:
    """What the Job controller reports: ``active``, ``ready``, ``conditions`` …"""
    return kube.patch("batch/v1", "jobs", ns, name, {"status": status}, "status")


def finish_job(
    kube: KubeApi, ns: str, name: str, ok: bool, reason: str = "", message: str = ""
) -> None:
    cond = {
        "type": "Complete" if ok else "Failed",
        "status": "True",
        "reason": reason or ("Completed" if ok else "BackoffLimitExceeded"),
        "message": message or ("" if ok else "Job has reached the specified backoff limit"),
        "lastTransitionTime": now(),
    }
    extra = {"completionTime": now(), "succeeded": 1} if ok else {"failed": 1}
    set_job_status(kube, ns, name, active=0, ready=0, conditions=[cond], **extra)


def failed_pod(
    kube: KubeApi,
    ns: str,
    name: str,
    labels: dict[str, str],
    exit_code: int,
    message: str,
    owner: dict[str, Any] | None = None,
    finished_at: str | None = None,
) -> None:
    """A pod the Job controller made, which the kubelet reports failed."""
    meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"], "controller": True}
        ]  # fmt: skip
    kube.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "worker", "image": "x"}], "restartPolicy": "Never"},
    })  # fmt: skip
    terminated = {
        "exitCode": exit_code,
        "reason": "Error",
        "message": message,
        "finishedAt": finished_at or now(),
    }
    container = {"name": "worker", "state": {"terminated": terminated}}
    status = {"phase": "Failed", "containerStatuses": [container]}
    kube.patch("v1", "pods", ns, name, {"status": status}, "status")


def events_for(kube: KubeApi, ns: str, name: str) -> list[dict[str, Any]]:
    """The Events about ``name``, oldest first."""
    found = [
        e
        for e in kube.list("v1", "events", ns)
        if (e.get("involvedObject") or {}).get("name") == name
    ]
    return sorted(found, key=lambda e: str(e.get("eventTime") or e.get("firstTimestamp") or ""))


# --------------------------------------------------------------------------- startup
# What the Job controller, the scheduler and the kubelet report when a pod cannot
# start, in the words a real control plane used (kube-apiserver, kube-controller-manager
# and kube-scheduler v1.36.2; the kubelet's from its v1.36 source, as no kubelet ran).


def forbidden_sa_message(job: str, ns: str, sa: str) -> str:
    """The Job controller's FailedCreate message when the pods' service account is missing."""
    return (
        f'Error creating: pods "{job}-" is forbidden: error looking up service account '
        f'{ns}/{sa}: serviceaccount "{sa}" not found'
    )


def exceeded_quota_message(pod: str, ns: str) -> str:
    """The Job controller's FailedCreate message when a ResourceQuota on GPUs is full
    (ResourceQuota admission sees the generated name)."""
    return (
        f'Error creating: pods "{pod}" is forbidden: exceeded quota: gpus, requested: '
        "requests.nvidia.com/gpu=2, used: requests.nvidia.com/gpu=8, limited: "
        "requests.nvidia.com/gpu=8"
    )


#: The scheduler's message for a pod no node has GPUs for (one node).
UNSCHEDULABLE_MESSAGE = (
    "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. no new claims to deallocate, "
    "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
)


def image_pull_backoff_message(image: str) -> str:
    """The kubelet's waiting message once it backs off: its own words, then the last
    pull error (the runtime's, here containerd's wording)."""
    return (
        f'Back-off pulling image "{image}": ErrImagePull: failed to pull and unpack image '
        f'"{image}": failed to resolve reference "{image}": {image}: not found'
    )


def failed_create_event(kube: KubeApi, job: dict[str, Any], message: str) -> dict[str, Any]:
    """The Warning Event the Job controller posts when it cannot create a pod."""
    meta = job["metadata"]
    stamp = now()
    return kube.create({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{abs(hash(stamp)) % 10**12:x}",
                     "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta["uid"],
                           "resourceVersion": meta["resourceVersion"]},
        "reason": "FailedCreate",
        "message": message,
        "type": "Warning",
        "source": {"component": "job-controller"},
        "reportingComponent": "job-controller",
        "reportingInstance": "",
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    })  # fmt: skip


def job_pod(kube: KubeApi, job: dict[str, Any], suffix: str = "x1y2z") -> dict[str, Any]:
    """A pod the Job controller creates from the Job's template (Pending, unscheduled)."""
    meta, template = job["metadata"], job["spec"]["template"]
    return kube.create({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{suffix}",
            "namespace": meta["namespace"],
            "labels": dict(template["metadata"]["labels"]),
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": template["spec"],
    })  # fmt: skip


def pod_unschedulable(
    kube: KubeApi, pod: dict[str, Any], message: str = UNSCHEDULABLE_MESSAGE
) -> None:
    """What the scheduler writes on a pod no node fits."""
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": message, "lastTransitionTime": now()}  # fmt: skip
    status = {"phase": "Pending", "conditions": [cond]}
    meta = pod["metadata"]
    kube.patch("v1", "pods", meta["namespace"], meta["name"], {"status": status}, "status")


def pod_image_pull_backoff(kube: KubeApi, pod: dict[str, Any], node: str = "gpu-1") -> None:
    """What the kubelet writes on a bound pod whose image it cannot pull."""
    meta, container = pod["metadata"], pod["spec"]["containers"][0]
    waiting = {"reason": "ImagePullBackOff",
               "message": image_pull_backoff_message(container["image"])}  # fmt: skip
    status = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}],
        "containerStatuses": [{"name": container["name"], "image": container["image"],
                               "ready": False, "restartCount": 0, "state": {"waiting": waiting}}],
    }  # fmt: skip
    kube.patch("v1", "pods", meta["namespace"], meta["name"], {"spec": {"nodeName": node}})
    kube.patch("v1", "pods", meta["namespace"], meta["name"], {"status": status}, "status")


# --------------------------------------------------------------------------- the chart
CHART = ROOT / "charts" / "shardwise"
HELM = Path(os.environ.get("HELM") or ROOT / ".tools" / "bin" / "helm")


def render_chart(
    tmp_path: Path, values: dict[str, Any], namespace: str = "shardwise", release: str = "r"
) -> list[dict[str, Any]]:
    """``helm template`` of the chart (as tests/chart_helpers.py renders it)."""
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = subprocess.run(
        [str(HELM), "template", release, str(CHART), "-n", namespace, "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


# --------------------------------------------------------------------------- pods that run
# Nodes whose pods the local kubelet (k8s.kubelet, fixture ``local_cluster``) runs as
# local processes, and the small CPU DLRMJobs they train.

#: The annotation that marks a node as run by the local kubelet.
LOCAL_NODE = "shardwise.test/local-kubelet"
#: Tiny tables (examples/dlrmjob-cpu.yaml's): a step takes milliseconds on a CPU rank.
CPU_TABLES: list[dict[str, Any]] = [
    {"name": "user_id", "rows": 20000, "dim": 16, "poolingFactor": 1},
    {"name": "item_id", "rows": 10000, "dim": 16, "poolingFactor": 4},
    {"name": "category", "rows": 500, "dim": 8, "poolingFactor": 2},
    {"name": "query", "rows": 5000, "dim": 32, "poolingFactor": 3, "dtype": "fp16"},
]
#: The claim the CPU jobs keep their checkpoints on, and where it is mounted.
CKPT_CLAIM, CKPT_DIR = "dlrm-ckpt", "/ckpt"


def add_local_node(
    kube: KubeApi, name: str, cpu: str = "8", memory: str = "16Gi", gpus: int = 0, **labels: str
) -> dict[str, Any]:
    """A Ready node whose pods the local kubelet runs (as :func:`add_node`, annotated)."""
    body = node(name, gpus=gpus, **labels)
    body["metadata"]["annotations"] = {LOCAL_NODE: "true"}
    kube.create(body)
    status = {
        "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": cpu, "memory": memory},
        "capacity": {"nvidia.com/gpu": str(gpus), "cpu": cpu, "memory": memory},
        "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": now()}],
    }
    return kube.patch("v1", "nodes", None, name, {"status": status}, "status")


def cpu_dlrmjob(
    name: str,
    namespace: str = NAMESPACE,
    *,
    args: Sequence[str] = (),
    steps: int = 100,
    workers: tuple[int, int] = (1, 2),
    ranks: int = 1,
    tables: list[dict[str, Any]] | None = None,
    batch: int = 256,
    env: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A DLRMJob of CPU workers of ``ranks`` gloo ranks each (``gpusPerWorker``) that
    really trains under the local kubelet: ``steps`` steps at ``batch`` samples per
    rank, checkpoints on the claim :data:`CKPT_CLAIM` at :data:`CKPT_DIR`, then the
    trainer options ``args`` (``template.args``: a flag given again wins); ``spec``:
    more DLRMJob spec fields (``resharding``, ``profiling`` …). One thread per rank
    (``OMP_NUM_THREADS``), as 2 cores must do."""
    env_vars = {"OMP_NUM_THREADS": "1", **(env or {})}
    template = {
        "image": "registry.example/shardwise:test",
        "args": ["--steps", str(steps), "--batch-size", str(batch), "--log-every", "10", *args],
        "env": [{"name": k, "value": v} for k, v in env_vars.items()],
        "checkpointDir": CKPT_DIR,
        "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": CKPT_CLAIM}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": CKPT_DIR}],
        "terminationGracePeriodSeconds": 30,
    }
    planner = {"device": "cpu", "gpuMemory": "1Gi", "batchSizePerRank": batch}
    return dlrmjob(
        name, namespace, tables if tables is not None else CPU_TABLES, gpus_per_worker=ranks,
        workers=workers, template=template, planner=planner, gpu_memory=None, **spec,
    )  # fmt: skip


def start_cpu_job(kube: KubeApi, name: str, **kwargs: Any) -> dict[str, Any]:
    """Create :func:`cpu_dlrmjob` ``name`` (its arguments) in :data:`NAMESPACE`."""
    return kube.create(cpu_dlrmjob(name, **kwargs))


def live_configmap(kube: KubeApi, ns: str, job: str) -> dict[str, Any] | None:
    """The job's live ConfigMap (rank 0's summary), or None before there is one."""
    return kube.get("v1", "configmaps", ns, live_configmap_name(job))


def live_summary(kube: KubeApi, ns: str, job: str) -> LiveSummary | None:
    """The live summary rank 0 last wrote, or None when there is none yet."""
    cm = live_configmap(kube, ns, job)
    text = ((cm or {}).get("data") or {}).get(LIVE_KEY)
    return LiveSummary.model_validate_json(text) if text else None


def job_view(kube: KubeApi, ns: str, job: str) -> tuple[dict[str, Any], LiveSummary | None]:
    """What a test watches of a running job: its status and its live summary."""
    return status_of(kube, ns, job), live_summary(kube, ns, job)


_STEP = re.compile(r"\[rank 0/\d+\] step (\d+) loss ([0-9.]+)")
_RESUMED = re.compile(r"\[rank 0/\d+\] resumed .*?step (\d+)")
_STOPPED = re.compile(r"\[rank 0/\d+\] stopped by \w+ after step (\d+)")


def logged_losses(log: str) -> list[tuple[int, float]]:
    """(step, loss) as rank 0 logs them (every ``--log-every`` steps)."""
    return [(int(s), float(v)) for s, v in _STEP.findall(log)]


def resumed_step(log: str) -> int | None:
    """The checkpoint step rank 0 says it resumed from, if it did."""
    hit = _RESUMED.search(log)
    return int(hit[1]) if hit else None


def stopped_step(log: str) -> int | None:
    """The step rank 0 says a stop signal ended the run after (it checkpointed it)."""
    hit = _STOPPED.search(log)
    return int(hit[1]) if hit else None
