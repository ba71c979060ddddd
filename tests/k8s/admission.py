"""What the API server's admission plugins refuse when a pod is created, with their
words (a 403 ``Forbidden``): the Priority plugin (an unknown PriorityClass), PodSecurity
(:mod:`k8s.podsecurity`) and ResourceQuota.

A refusal names the pod as the server does: a mutating plugin (Priority) runs before
the name is generated, so a pod created with ``generateName`` is named by its prefix
(``pods "job-0-" is forbidden``), as the Job controller's FailedCreate Events quote it;
the validating ones (PodSecurity, then ResourceQuota, always last) see the generated
name.

ResourceQuota, as its admission counts: ``pods`` and ``count/pods``, ``cpu``/``memory``
and their ``requests.``/``limits.`` forms, ``ephemeral-storage`` and extended resources
(``requests.nvidia.com/gpu``), summed over the namespace's pods that are not terminal
(requests default to limits, an init container counts at its largest), plus the new
pod; a quota on cpu or memory makes every container state it (``must specify``). The
quota's ``status`` (``hard``, ``used``) is written when it is created and after each pod
it admits: the emulator counts from the pods themselves, so it is never unknown or
stale. Not done: quota scopes and scope selectors, pod-level resources, the
``status unknown`` refusal, other kinds' object counts, the ServiceAccount plugin (a
pod naming a missing account is admitted here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from k8s import podsecurity
from k8s.quantity import Quantity, parse

#: Priority classes every cluster has, which the admission knows without an object.
SYSTEM_PRIORITY_CLASSES = frozenset({"system-cluster-critical", "system-node-critical"})
_STANDARD = ("cpu", "memory", "ephemeral-storage")
_CONSTRAINED = frozenset(
    {"cpu", "memory", "requests.cpu", "requests.memory", "limits.cpu", "limits.memory"}
)


def forbidden(name: str, why: str) -> str:
    """``errors.NewForbidden``'s message for a pod."""
    return f'pods "{name}" is forbidden: {why}'


def pod_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "")


# --------------------------------------------------------------------------- Priority
def priority_refusal(pod: Mapping[str, Any], known: Iterable[str]) -> str | None:
    """The Priority plugin's refusal of a pod naming a PriorityClass that does not exist
    (``known``: the names that do), before the pod's name is generated."""
    wanted = str((pod.get("spec") or {}).get("priorityClassName") or "")
    if not wanted or wanted in SYSTEM_PRIORITY_CLASSES or wanted in set(known):
        return None
    return forbidden(pod_name(pod), f"no PriorityClass with name {wanted} was found")


# --------------------------------------------------------------------------- PodSecurity
def pod_security_refusal(pod: Mapping[str, Any], namespace: Mapping[str, Any] | None) -> str | None:
    why = podsecurity.violation(podsecurity.namespace_level(namespace), pod)
    return forbidden(pod_name(pod), why) if why else None


# --------------------------------------------------------------------------- ResourceQuota
def _add(total: dict[str, Quantity], name: str, q: Quantity) -> None:
    total[name] = total[name] + q if name in total else q


def _container_usage(c: Mapping[str, Any]) -> dict[str, Quantity]:
    """``podComputeUsageHelper`` of one container (requests defaulted to its limits)."""
    res = c.get("resources") or {}
    limits = {k: parse(v) for k, v in (res.get("limits") or {}).items()}
    requests = {**limits, **{k: parse(v) for k, v in (res.get("requests") or {}).items()}}
    out: dict[str, Quantity] = {}
    for name in _STANDARD:
        if name in requests:
            out[name] = out[f"requests.{name}"] = requests[name]
        if name in limits:
            out[f"limits.{name}"] = limits[name]
    for name, q in requests.items():
        if name.startswith("hugepages-"):
            out[name] = out[f"requests.{name}"] = q
        elif "/" in name and not name.startswith("kubernetes.io/"):
            out[f"requests.{name}"] = q
    return out


def pod_usage(pod: Mapping[str, Any]) -> dict[str, Quantity]:
    """What a pod counts against a quota: ``count/pods`` always; the rest while it is not
    terminal (containers summed, each resource at least its largest init container's)."""
    out = {"count/pods": parse(1)}
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return out
    spec = pod.get("spec") or {}
    total: dict[str, Quantity] = {"pods": parse(1)}
    for c in spec.get("containers") or []:
        for name, q in _container_usage(c).items():
            _add(total, name, q)
    for c in spec.get("initContainers") or []:
        for name, q in _container_usage(c).items():
            if name not in total or q.value > total[name].value:
                total[name] = q
    return {**out, **total}


def _missing(pod: Mapping[str, Any], hard: Iterable[str]) -> str | None:
    required = set(hard) & _CONSTRAINED
    if not required:
        return None
    spec = pod.get("spec") or {}
    missing: dict[str, set[str]] = {}
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        for name in required - set(_container_usage(c)):
            missing.setdefault(name, set()).add(str(c.get("name", "")))
    if not missing:
        return None
    return "must specify " + "; ".join(
        f"{r} for: {','.join(sorted(missing[r]))}" for r in sorted(missing)
    )


def _print(values: Mapping[str, Quantity], keys: Iterable[str]) -> str:
    return ",".join(f"{k}={values.get(k, parse(0))}" for k in sorted(keys))


def used(pods: Iterable[Mapping[str, Any]], hard: Iterable[str]) -> dict[str, Quantity]:
    """A quota's ``status.used``: the pods' usage of the resources it limits."""
    names = set(hard)
    total = {k: parse(0) for k in names}
    for pod in pods:
        for name, q in pod_usage(pod).items():
            if name in names:
                total[name] = total[name] + q if total[name].value else q
    return total


def quota_status(quota: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    hard = dict((quota.get("spec") or {}).get("hard") or {})
    return {"hard": hard, "used": {k: str(v) for k, v in used(pods, hard).items()}}


def quota_refusal(
    pod: Mapping[str, Any], quotas: Iterable[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
) -> str | None:
    """ResourceQuota's refusal of a new pod, given the namespace's quotas and pods."""
    usage = pod_usage(pod)
    for quota in sorted(quotas, key=lambda q: str((q.get("metadata") or {}).get("name"))):
        qname = str((quota.get("metadata") or {}).get("name"))
        hard = {k: parse(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
        missing = _missing(pod, hard)
        if missing:
            return forbidden(pod_name(pod), f"failed quota: {qname}: {missing}")
        now = used(pods, hard)
        over = [k for k in hard if k in usage and (now[k] + usage[k]).value > hard[k].value]
        if over:
            return forbidden(
                pod_name(pod),
                f"exceeded quota: {qname}, requested: {_print(usage, over)}, "
                f"used: {_print(now, over)}, limited: {_print(hard, over)}",
            )
    return None
