"""The Kueue API (``kueue.x-k8s.io/v1beta2``) as the stand-in in :mod:`k8s.kueue` and
the tests use it: the kinds and labels, our own minimal CRDs for them, and quantities,
requests, flavor assignment and conditions as Kueue reads and writes them (quantities
in Kueue's canonical form, so that messages read as Kueue's)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from fractions import Fraction
from functools import partial
from typing import Any

from k8s.helpers import now, wait_for
from k8s.jobcontroller import meta
from shardwise.operator.kube import PLURALS, ApiError, KubeApi, resource_path

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API = f"{GROUP}/{VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: kind → (plural, namespaced)
KINDS = {
    "ResourceFlavor": ("resourceflavors", False),
    "ClusterQueue": ("clusterqueues", False),
    "LocalQueue": ("localqueues", True),
    "Workload": ("workloads", True),
    "WorkloadPriorityClass": ("workloadpriorityclasses", False),
}
_OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_CRDS = ("apiextensions.k8s.io/v1", "customresourcedefinitions")


def _crd(kind: str) -> dict[str, Any]:
    plural, namespaced = KINDS[kind]
    props: dict[str, Any] = {"spec": _OPEN, "status": _OPEN}
    if kind == "WorkloadPriorityClass":  # as Kueue's: no spec, no status
        props = {"value": {"type": "integer"}, "description": {"type": "string"}}
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": {"type": "object", "properties": props}},
    }
    if "status" in props:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced" if namespaced else "Cluster",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [version],
        },
    }


#: Our own minimal CRDs for the Kueue kinds the operator and the stand-in use.
KUEUE_CRDS: list[dict[str, Any]] = [_crd(kind) for kind in KINDS]


def install_kueue_crds(kube: KubeApi, timeout: float = 20.0) -> None:
    """Create those of :data:`KUEUE_CRDS` that are missing; return once all are served."""
    for crd in KUEUE_CRDS:
        if kube.get(*_CRDS, None, crd["metadata"]["name"]) is None:
            kube.create(crd)
    for plural, _ in KINDS.values():
        wait_for(partial(_served, kube, plural), timeout, what=f"{plural}.{GROUP} served")


def _served(kube: KubeApi, plural: str) -> bool:
    return kube.list(API, plural) is not None


def kueue_served(kube: KubeApi) -> bool:
    """Whether the server serves ``kueue.x-k8s.io/v1beta2`` (Kueue v0.15+ is there)."""
    try:
        kube.list(API, "clusterqueues")
    except ApiError as err:
        if err.status == 404:
            return False
        raise
    return True


def create_object(kube: KubeApi, body: Mapping[str, Any]) -> dict[str, Any]:
    """``kube.create`` for the Kueue kinds too (``KubeApi`` knows the operator's only)."""
    kind = str(body["kind"])
    if kind in PLURALS or kind not in KINDS:
        return kube.create(body)
    plural, namespaced = KINDS[kind]
    ns = meta(body).get("namespace") if namespaced else None
    path = resource_path(str(body["apiVersion"]), plural, ns)
    created: dict[str, Any] = kube.request("POST", path, body=dict(body))
    return created


def workload_name(job: str, uid: str) -> str:
    """``job-<name>-<5 hex digits of a hash of the uid>``, at most 253 characters."""
    return f"job-{job}"[:247] + "-" + hashlib.sha1(uid.encode()).hexdigest()[:5]


def workloads_of(kube: KubeApi, job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Workloads the Job owns (found by owner, as names differ across Kueue versions)."""
    uid, ns = meta(job)["uid"], meta(job)["namespace"]
    return [w for w in kube.list(API, "workloads", ns) if owner_uid(w) == uid]


def owner_uid(obj: Mapping[str, Any]) -> str | None:
    refs = meta(obj).get("ownerReferences") or []
    return next((str(r["uid"]) for r in refs if r.get("kind") == "Job"), None)


# --------------------------------------------------------------------------- quantities
_QTY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BIN = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]


def parse_quantity(value: Any, resource: str) -> int:
    """A quantity as Kueue counts it: millicores for ``cpu``, else units (rounded up)."""
    m = _QTY.match(str(value).strip())
    if m is None:
        raise ValueError(f"cannot read the quantity {value!r} of {resource}")
    number, suffix = Fraction(m[1]), m[2] or ""
    if suffix in _BIN:
        number *= 1024 ** (_BIN.index(suffix) + 1)
    elif suffix[:1] in ("e", "E") and len(suffix) > 1:
        number *= Fraction(10) ** int(suffix[1:])
    else:
        number *= Fraction(10) ** _DEC[suffix]
    if resource == "cpu":
        number *= 1000
    return -(-number.numerator // number.denominator)


def format_quantity(n: int, resource: str) -> str:
    """Kueue's canonical form: ``500m``/``2`` for cpu, ``1Gi`` for memory, ``4`` else."""
    if resource == "cpu":
        return f"{n}m" if n % 1000 else format_quantity(n // 1000, "")
    binary = resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-")
    if binary and abs(n) >= 1024:
        for i in range(len(_BIN), 0, -1):
            if n % 1024**i == 0:
                return f"{n // 1024**i}{_BIN[i - 1]}"
    for suffix, exp in (("E", 18), ("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3)):
        if n and n % 10**exp == 0:
            return f"{n // 10**exp}{suffix}"
    return str(n)


def pod_requests(template: Mapping[str, Any]) -> dict[str, int]:
    """One pod's requests (limits where a request is missing): the containers' sum, or
    an init container's where that is more."""
    spec = template.get("spec") or {}

    def asked(c: Mapping[str, Any]) -> dict[str, int]:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: parse_quantity(v, k) for k, v in merged.items()}

    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for k, v in asked(c).items():
            total[k] = total.get(k, 0) + v
    for c in spec.get("initContainers") or []:
        for k, v in asked(c).items():
            total[k] = max(total.get(k, 0), v)
    return total


def assign_flavors(
    cq: Mapping[str, Any], need: Mapping[str, int], usage: Mapping[tuple[str, str], int]
) -> tuple[str, dict[str, str], list[str]]:
    """Flavors of the ClusterQueue for the requests ``need``, beside ``usage`` ((flavor,
    resource) → used): "fit", "preempt" (would fit in an empty queue) or "nofit", the
    resource → flavor chosen, and why it does not fit, in Kueue's words. In each resource
    group, the first flavor that fits wins, else the first that would fit when empty."""
    groups = spec_of(cq).get("resourceGroups") or []
    covered = {r for g in groups for r in g.get("coveredResources") or []}
    gaps = [f"resource {r} unavailable in ClusterQueue" for r in need if r not in covered]
    if gaps:
        return "nofit", {}, gaps
    chosen: dict[str, str] = {}
    reasons: list[str] = []
    worst = 0
    for group in groups:
        wanted = [r for r in group.get("coveredResources") or [] if need.get(r)]
        if not wanted:
            continue
        best: tuple[int, str] | None = None
        for flavor in group.get("flavors") or []:
            f, mode = flavor["name"], 0
            quota = {q["name"]: q.get("nominalQuota", 0) for q in flavor.get("resources") or []}
            for r in wanted:
                nominal, used = parse_quantity(quota.get(r, 0), r), usage.get((f, r), 0)
                if need[r] > nominal:
                    mode = 2
                    reasons.append(
                        f"insufficient quota for {r} in flavor {f}, request > maximum "
                        f"capacity ({format_quantity(need[r], r)} > "
                        f"{format_quantity(nominal, r)})"
                    )
                elif used + need[r] > nominal:
                    mode = max(mode, 1)
                    more = format_quantity(used + need[r] - nominal, r)
                    reasons.append(
                        f"insufficient unused quota for {r} in flavor {f}, {more} more needed"
                    )
            if mode < 2 and (best is None or mode < best[0]):
                best = (mode, f)
            if mode == 0:
                break
        if best is None:
            return "nofit", {}, sorted(reasons)
        worst = max(worst, best[0])
        chosen.update(dict.fromkeys(wanted, best[1]))
    return ("fit", "preempt")[worst], chosen, sorted(reasons)


# --------------------------------------------------------------------------- conditions
def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == type_), None)


def is_true(obj: Mapping[str, Any], type_: str) -> bool:
    return (condition(obj, type_) or {}).get("status") == "True"


def with_condition(
    obj: Mapping[str, Any], type_: str, status: bool, reason: str, message: str
) -> list[dict[str, Any]]:
    """``obj``'s conditions with ``type_`` set, its transition time kept unless it flips
    (so that an unchanged condition is no write at all)."""
    conds = [dict(c) for c in (obj.get("status") or {}).get("conditions") or []]
    flag = "True" if status else "False"
    new = {"type": type_, "status": flag, "reason": reason, "message": message,
           "observedGeneration": meta(obj).get("generation", 1)}  # fmt: skip
    for i, c in enumerate(conds):
        if c.get("type") == type_:
            same = c.get("status") == flag
            new["lastTransitionTime"] = c.get("lastTransitionTime") if same else now()
            conds[i] = new
            return conds
    return [*conds, {**new, "lastTransitionTime": now()}]


def set_conditions(
    obj: Mapping[str, Any], *conds: tuple[str, bool, str, str]
) -> list[dict[str, Any]]:
    """Several conditions set in turn on a copy of ``obj``'s."""
    conditions = (obj.get("status") or {}).get("conditions")
    work = {"metadata": meta(obj), "status": {"conditions": conditions}}
    for c in conds:
        work["status"]["conditions"] = with_condition(work, *c)
    out: list[dict[str, Any]] = work["status"]["conditions"]
    return out


def spec_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("spec") or {})


def age(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    m = meta(obj)
    return str(m.get("creationTimestamp", "")), str(m.get("namespace", "")), str(m["name"])


def priority(wl: Mapping[str, Any]) -> int:
    return int(spec_of(wl).get("priority") or 0)
