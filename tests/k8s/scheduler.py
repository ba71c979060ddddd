"""A stand-in for kube-scheduler, for the pods of :mod:`k8s.jobcontroller`'s Jobs.

:func:`schedule` binds each unbound, undeleted pod to a Ready, schedulable node that
matches its ``nodeSelector`` and its required node affinity (:mod:`k8s.nodeaffinity`),
whose ``NoSchedule``/``NoExecute`` taints it tolerates and whose allocatable resources
hold its requests (limits where no request is given) beside the other running pods'
(spreading: the node with fewest pods, then by name);
otherwise it writes ``PodScheduled=False``/``Unschedulable`` with a message in the
scheduler's form. A pod with scheduling gates is not considered until they are all
removed (``PodScheduled=False``/``SchedulingGated``, as the scheduler writes it). Not
done: preferred node affinity, pod (anti-)affinity, topology spread, host ports,
preemption, priorities.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from k8s.helpers import now
from k8s.jobcontroller import condition_true, deleting, lenient, meta, terminal
from k8s.nodeaffinity import required_affinity_matches
from shardwise.operator.kube import KubeApi

_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "m": 1e-3,
    "": 1,
}


def quantity(value: Any, resource: str) -> float:
    """A resource quantity as a number: cores for ``cpu``, else bytes or a count."""
    text = str(value)
    if resource == "cpu" and (m := _CPU.match(text)):
        return float(m[1]) / (1000 if m[2] else 1)
    number = re.match(r"^(\d+(?:\.\d+)?)([A-Za-z]*)$", text)
    if number is None or number[2] not in _SUFFIX:
        raise ValueError(f"cannot read the quantity {value!r} of {resource}")
    return float(number[1]) * _SUFFIX[number[2]]


def requests(pod: Mapping[str, Any]) -> dict[str, float]:
    """What the pod asks of a node: requests, or limits where a request is missing."""
    out: dict[str, float] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, value in asked.items():
            out[name] = out.get(name, 0.0) + quantity(value, name)
    return out


def _tolerates(pod: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for tol in (pod.get("spec") or {}).get("tolerations") or []:
        if tol.get("effect") not in (None, "", taint.get("effect")):
            continue
        if tol.get("operator") == "Exists" and tol.get("key") in (None, "", taint.get("key")):
            return True
        if tol.get("key") == taint.get("key") and tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def _misfit(
    pod: Mapping[str, Any], node: Mapping[str, Any], used: Mapping[str, float]
) -> str | None:
    """Why ``pod`` does not fit ``node`` in the scheduler's words, or ``None``."""
    labels = meta(node).get("labels") or {}
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()) or not required_affinity_matches(
        pod, node
    ):
        return "node(s) didn't match Pod's node affinity/selector"
    if (node.get("spec") or {}).get("unschedulable"):
        return "node(s) were unschedulable"
    if not condition_true(node, "Ready"):
        return "node(s) had untolerated taint {node.kubernetes.io/not-ready: }"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(pod, taint):
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for name, amount in sorted(requests(pod).items()):
        free = quantity(allocatable.get(name, 0), name) - used.get(name, 0.0)
        if amount > 0 and amount > free + 1e-9:
            return f"Insufficient {name}"
    return None


def schedule(
    kube: KubeApi, pods: Sequence[Mapping[str, Any]], nodes: Sequence[Mapping[str, Any]]
) -> None:
    """Bind every pending, unbound pod that fits a node (see the module docstring)."""
    bound = [p for p in pods if (p.get("spec") or {}).get("nodeName") and not terminal(p)]
    used: dict[str, dict[str, float]] = {}
    count: dict[str, int] = {}
    for p in bound:
        where = str(p["spec"]["nodeName"])
        count[where] = count.get(where, 0) + 1
        for name, amount in requests(p).items():
            used.setdefault(where, {})[name] = used.get(where, {}).get(name, 0.0) + amount
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName") or terminal(pod) or deleting(pod):
            continue
        if (pod.get("spec") or {}).get("schedulingGates"):
            _gated(kube, pod)
            continue
        reasons: dict[str, int] = {}
        fits = []
        for node in nodes:
            name = meta(node)["name"]
            why = _misfit(pod, node, used.get(name, {}))
            if why is None:
                fits.append(node)
            else:
                reasons[why] = reasons.get(why, 0) + 1
        m = meta(pod)
        if not fits:
            detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
            message = f"0/{len(nodes)} nodes are available: {detail}."
            cond = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
            old = (pod.get("status") or {}).get("conditions") or []
            if not any(c.get("message") == message for c in old):
                cond["lastTransitionTime"] = now()
                status = {"phase": "Pending", "conditions": [cond]}
                lenient(
                    kube.patch,
                    "v1",
                    "pods",
                    m["namespace"],
                    m["name"],
                    {"status": status},
                    "status",
                )
            continue
        best = min(fits, key=lambda n: (count.get(meta(n)["name"], 0), meta(n)["name"]))
        target = meta(best)["name"]
        if (
            lenient(
                kube.patch, "v1", "pods", m["namespace"], m["name"], {"spec": {"nodeName": target}}
            )
            is None
        ):
            continue
        count[target] = count.get(target, 0) + 1
        for name, amount in requests(pod).items():
            used.setdefault(target, {})[name] = used.get(target, {}).get(name, 0.0) + amount
        cond = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}
        lenient(
            kube.patch,
            "v1",
            "pods",
            m["namespace"],
            m["name"],
            {"status": {"phase": "Pending", "conditions": [cond]}},
            "status",
        )


#: What the scheduler writes on a pod it may not consider yet.
GATED_MESSAGE = "Scheduling is blocked due to non-empty scheduling gates"


def _gated(kube: KubeApi, pod: Mapping[str, Any]) -> None:
    """``PodScheduled=False``/``SchedulingGated``, written once."""
    old = (pod.get("status") or {}).get("conditions") or []
    if any(c.get("reason") == "SchedulingGated" for c in old):
        return
    cond = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
            "message": GATED_MESSAGE, "lastTransitionTime": now()}  # fmt: skip
    m = meta(pod)
    status = {"phase": "Pending", "conditions": [cond]}
    lenient(kube.patch, "v1", "pods", m["namespace"], m["name"], {"status": status}, "status")
