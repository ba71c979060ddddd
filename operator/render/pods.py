"""What makes the operator's pods run on a production GPU cluster: Pod Security
"restricted" by default, writable paths as volumes, a memory-backed ``/dev/shm``, and
the pod fields a platform team sets (``spec.template.podOverrides``).

Pure functions over a rendered pod spec (docs/platform.md says the why of each):

- :func:`harden` gives the pod and every container the settings the Pod Security
  Standards' "restricted" level requires (run as the image's non-root user 10001,
  no privilege escalation, all capabilities dropped, seccomp ``RuntimeDefault``); the
  user's own ``securityContext`` (pod: ``podOverrides.spec.securityContext``; worker
  container: ``template.securityContext``; extra containers: their own) is laid over
  them key by key, so a stricter or a looser setting wins where the namespace allows it;
- :func:`scratch` mounts an ``emptyDir`` at ``/tmp`` (torchrun's and the launcher's
  temporary files), and for a pod of more than one rank :func:`shm` a memory-backed
  one at ``/dev/shm`` (NCCL's shared-memory transport, DataLoader workers): a path the
  user mounts a volume at is left to the user's;
- :func:`override` lays ``podOverrides`` over the pod: labels and annotations,
  scheduling (affinity, spread, priority, scheduler, runtime class), pull secrets,
  host networking for RDMA, init and extra containers. What the operator owns (the
  plan's volume, the rendezvous, the rank's command, the Job controller's labels) is
  refused at admission by the CRD and again by :func:`shardwise.operator.crd.parse_spec`.
"""

from __future__ import annotations

import copy
from typing import Any

from shardwise.basics import parse_quantity
from shardwise.operator.crd import DLRMJobSpec, PodOverrides

#: The image's user and group (the Dockerfile's ``USER 10001:10001``): numeric, so the
#: kubelet can prove ``runAsNonRoot``; the same on every pod, whatever image it runs.
IMAGE_UID = 10001
#: The pod-level defaults: non-root as the image's user, volumes writable by its group
#: (a checkpoint claim), chowned only when their root does not match already.
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": IMAGE_UID,
    "runAsGroup": IMAGE_UID,
    "fsGroup": IMAGE_UID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
#: The container-level defaults of every container of the pod.
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
TMP_VOLUME, TMP_PATH = "shardwise-tmp", "/tmp"
SHM_VOLUME, SHM_PATH = "shardwise-shm", "/dev/shm"
#: The volumes the operator adds (their names are refused in ``template.volumes``).
OPERATOR_VOLUMES = ("shardwise-plan", TMP_VOLUME, SHM_VOLUME)
#: ``/dev/shm`` per rank when the worker states no memory.
SHM_PER_RANK = 1 << 30
MIB = 1 << 20


def _laid_over(defaults: dict[str, Any], given: dict[str, Any] | None) -> dict[str, Any]:
    """``given`` over ``defaults``, key by key (a given key replaces the default's)."""
    return {**copy.deepcopy(defaults), **copy.deepcopy(given or {})}


def harden(
    pod: dict[str, Any], pod_security: dict[str, Any] | None, main: dict[str, Any] | None
) -> None:
    """Pod Security "restricted" for ``pod`` (in place): the pod's securityContext, the
    first container's with ``main`` laid over it, every other container's with its own."""
    pod["securityContext"] = _laid_over(POD_SECURITY, pod_security)
    for i, container in enumerate(pod.get("containers") or []):
        own = main if i == 0 else container.get("securityContext")
        container["securityContext"] = _laid_over(CONTAINER_SECURITY, own)
    for container in pod.get("initContainers") or []:
        container["securityContext"] = _laid_over(
            CONTAINER_SECURITY, container.get("securityContext")
        )


def _mounted(container: dict[str, Any], path: str) -> bool:
    return any(
        str(m.get("mountPath", "")).rstrip("/") == path for m in container.get("volumeMounts") or []
    )


def _mount(pod: dict[str, Any], name: str, path: str, source: dict[str, Any]) -> None:
    container = pod["containers"][0]
    if _mounted(container, path):
        return  # the user's own volume there wins
    pod.setdefault("volumes", []).append({"name": name, "emptyDir": source})
    container.setdefault("volumeMounts", []).append({"name": name, "mountPath": path})


def scratch(pod: dict[str, Any]) -> None:
    """An ``emptyDir`` at ``/tmp`` of the first container (in place)."""
    _mount(pod, TMP_VOLUME, TMP_PATH, {})


def memory_of(spec: DLRMJobSpec) -> int | None:
    """The worker container's memory: its limit, else its request (bytes)."""
    res = spec.template.resources
    for section in (res.limits, res.requests):
        if "memory" in section:
            return parse_quantity(section["memory"], "spec.template.resources.memory")
    return None


def shm_bytes(spec: DLRMJobSpec) -> int | None:
    """The size of the worker pods' ``/dev/shm``: ``template.shmSize``; else, for a pod
    of more than one rank, half of the worker's memory (limit, else request), else
    1 GiB per rank; ``None``: no ``/dev/shm`` volume (one rank, no ``shmSize``). The
    pages written there count against the container's memory (limit) like any other."""
    t = spec.template
    if t.shm_size is not None:
        return parse_quantity(t.shm_size, "spec.template.shmSize")
    if spec.gpus_per_worker < 2:
        return None
    memory = memory_of(spec)
    return memory // 2 if memory is not None else SHM_PER_RANK * spec.gpus_per_worker


def _size(n: int) -> str:
    """A ``sizeLimit``: whole GiB or MiB (rounded down to MiB), else bytes."""
    if n % (1 << 30) == 0:
        return f"{n >> 30}Gi"
    return f"{n // MIB}Mi" if n >= MIB else str(n)


def shm(pod: dict[str, Any], spec: DLRMJobSpec) -> None:
    """A memory-backed ``emptyDir`` at ``/dev/shm`` (in place), sized by :func:`shm_bytes`."""
    size = shm_bytes(spec)
    if size is not None:
        _mount(pod, SHM_VOLUME, SHM_PATH, {"medium": "Memory", "sizeLimit": _size(size)})


#: ``podOverrides.spec`` fields copied to the worker pods as given.
WORKER_FIELDS = (
    "affinity",
    "topologySpreadConstraints",
    "priorityClassName",
    "imagePullSecrets",
    "runtimeClassName",
    "schedulerName",
    "hostNetwork",
    "hostIPC",
    "dnsPolicy",
    "dnsConfig",
)
#: ... and to the profiling pods (one pod on one node: no spread, no host network).
PROFILING_FIELDS = (
    "affinity",
    "priorityClassName",
    "imagePullSecrets",
    "runtimeClassName",
    "schedulerName",
)


def override(template: dict[str, Any], overrides: PodOverrides, *, profiling: bool = False) -> None:
    """Lay ``overrides`` over a pod template (``{"metadata", "spec"}``, in place). The
    profiling pod takes what makes sense for one short pod on a GPU node: its metadata,
    placement, priority, pull secrets, runtime class and init containers."""
    meta, pod = template.setdefault("metadata", {}), template["spec"]
    given = overrides.metadata
    if given.labels:
        meta["labels"] = {**given.labels, **meta.get("labels", {})}
    if given.annotations:
        meta["annotations"] = {**given.annotations, **meta.get("annotations", {})}
    o = overrides.spec.model_dump(by_alias=True, exclude_none=True)
    for key in PROFILING_FIELDS if profiling else WORKER_FIELDS:
        if key in o and o[key] not in ([], {}):
            pod[key] = copy.deepcopy(o[key])
    if pod.get("hostNetwork") and "dnsPolicy" not in o:
        # the pods still find each other (and the rendezvous) by their Service's names
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    if o.get("initContainers"):
        pod["initContainers"] = copy.deepcopy(o["initContainers"])
    if not profiling and o.get("containers"):
        pod["containers"] = [*pod["containers"], *copy.deepcopy(o["containers"])]


def shape(
    template: dict[str, Any], spec: DLRMJobSpec, *, profiling: bool = False
) -> dict[str, Any]:
    """Everything of this module on a rendered pod template, in order: the overrides,
    ``/tmp`` (and for workers ``/dev/shm``), then the security settings over every
    container the pod now has. Returns ``template``."""
    t = spec.template
    override(template, t.pod_overrides, profiling=profiling)
    pod = template["spec"]
    scratch(pod)
    if not profiling:
        shm(pod, spec)
    harden(pod, t.pod_overrides.spec.security_context, t.security_context)
    return template
