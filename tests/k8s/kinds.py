"""The resources the emulator serves, and what the API server checks and fills in on the
objects of each built-in kind: names, labels, owner references, Jobs, ConfigMaps."""

from __future__ import annotations

import base64
import copy
import datetime
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from k8s.fielderrors import Cause, invalid
from k8s.schema import StructuralSchema

CONFIGMAP_LIMIT = 1 << 20

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CM_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
Key = tuple[str, str, str]  # group, version, plural
PODS: Key = ("", "v1", "pods")
NODES: Key = ("", "v1", "nodes")
NAMESPACES: Key = ("", "v1", "namespaces")
QUOTAS: Key = ("", "v1", "resourcequotas")
PRIORITY_CLASSES: Key = ("scheduling.k8s.io", "v1", "priorityclasses")


@dataclass
class Kind:
    """A resource the emulator serves."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status: bool = False
    generation: bool = False
    name_rule: str = "subdomain"  # "subdomain", "dns1035" (Services), "subdomain63" (Jobs)
    schema: StructuralSchema | None = None
    short_names: tuple[str, ...] = ()
    singular: str = ""
    custom: bool = False
    immutable: tuple[tuple[str, ...], ...] = ()
    validate: Callable[[dict[str, Any]], list[Cause]] | None = None
    #: What an update may not do, given the object stored (new, old).
    validate_update: Callable[[dict[str, Any], Mapping[str, Any]], list[Cause]] | None = None

    @property
    def key(self) -> Key:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def metadata(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def metadata_causes(kind: Kind, obj: dict[str, Any]) -> list[Cause]:
    """Names, labels and owner references, as the server checks them on every object."""
    meta = metadata(obj)
    name = meta.get("name", "")
    out = []
    if kind.name_rule == "dns1035":
        ok, limit, rule = bool(_DNS1035.match(name)), 63, "a DNS-1035 label"
    else:
        limit = 63 if kind.name_rule == "subdomain63" else 253
        ok, rule = bool(_SUBDOMAIN.match(name)), "a lowercase RFC 1123 subdomain"
    if not ok or len(name) > limit:
        out.append(
            Cause(
                "metadata.name",
                f'Invalid value: "{name}": must be {rule} of at most {limit} characters',
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, lname = key.rpartition("/")
        if (
            (prefix and not _SUBDOMAIN.match(prefix))
            or len(lname) > 63
            or not _LABEL_NAME.match(lname)
        ):
            out.append(Cause("metadata.labels", f'Invalid value: "{key}": name part must be valid'))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            out.append(
                Cause(
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid label must be an empty string or '
                    "consist of at most 63 alphanumeric characters, '-', '_' or '.'",
                )
            )
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                out.append(
                    Cause(
                        f"metadata.ownerReferences[{i}].{f}",
                        "Required value",
                        "FieldValueRequired",
                    )
                )
    return out


def _host_port_causes(pod: Mapping[str, Any], path: str, is_pod: bool) -> list[Cause]:
    """On the host's network a container's ``hostPort`` must be its ``containerPort``: in
    a Pod always (defaulting filled it in), in a template where it is given at all. The
    server checks the containers only, not the init containers."""
    if pod.get("hostNetwork") is not True:
        return []
    out = []
    for i, c in enumerate(pod.get("containers") or []):
        for j, port in enumerate((c or {}).get("ports") or []):
            host = port.get("hostPort", 0)
            if (is_pod or host) and host != port.get("containerPort", 0):
                where = f"{path}.containers[{i}].ports[{j}].hostPort"
                why = "must match `containerPort` when `hostNetwork` is true"
                out.append(invalid(where, host, why))
    return out


def _pod_causes(obj: dict[str, Any]) -> list[Cause]:
    return _host_port_causes(obj.get("spec") or {}, "spec", is_pod=True)


def _job_causes(obj: dict[str, Any]) -> list[Cause]:
    spec = obj.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    out = _host_port_causes(pod, "spec.template.spec", is_pod=False)
    policy = pod.get("restartPolicy")
    if policy not in ("Never", "OnFailure"):
        out.append(
            Cause(
                "spec.template.spec.restartPolicy",
                f'Unsupported value: "{policy}": supported values: "OnFailure", "Never"',
                "FieldValueNotSupported",
            )
        )
    if spec.get("podFailurePolicy") and policy != "Never":
        out.append(
            Cause(
                "spec.template.spec.restartPolicy",
                "Invalid value: only Never is supported when podFailurePolicy is specified",
            )
        )
    if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
        out.append(Cause("spec.completions", "Required value: when completionMode is Indexed"))
    if not (pod.get("containers") or []):
        out.append(Cause("spec.template.spec.containers", "Required value", "FieldValueRequired"))
    return out


def _job_update_causes(new: dict[str, Any], old: Mapping[str, Any]) -> list[Cause]:
    """``spec.completions`` is immutable, but for an Indexed Job, which may change it in
    tandem with ``spec.parallelism`` (elastic Indexed Jobs, Kubernetes 1.27+; what
    Kueue's elastic workload slices scale)."""
    spec, before = new.get("spec") or {}, old.get("spec") or {}
    completions = spec.get("completions")
    if completions == before.get("completions"):
        return []
    path = "spec.completions"
    if before.get("completionMode") != "Indexed":
        return [invalid(path, completions, "field is immutable")]
    if completions is not None and completions != spec.get("parallelism"):
        return [invalid(path, completions, "can only be modified in tandem with spec.parallelism")]
    return []


def _pod_update_causes(new: dict[str, Any], old: Mapping[str, Any]) -> list[Cause]:
    """A pod's scheduling gates may only be removed (how Kueue releases a gated pod)."""
    had = {g.get("name") for g in (old.get("spec") or {}).get("schedulingGates") or []}
    gates = (new.get("spec") or {}).get("schedulingGates") or []
    return [
        Cause(
            f"spec.schedulingGates[{i}].name",
            f"Forbidden: only deletion is allowed, but found new scheduling gate '{g.get('name')}'",
            "FieldValueForbidden",
        )
        for i, g in enumerate(gates)
        if g.get("name") not in had
    ]


def job_defaults(job: dict[str, Any]) -> None:
    """What the Job strategy fills in: the selector and the template's controller labels."""
    spec = job.setdefault("spec", {})
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    meta = spec.setdefault("template", {}).setdefault("metadata", {})
    name = metadata(job).get("name", "")
    labels = meta.setdefault("labels", {})
    labels.setdefault("job-name", name)
    labels.setdefault("batch.kubernetes.io/job-name", name)
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/job-name": name}})


def pod_defaults(pod: dict[str, Any]) -> None:
    """What defaulting fills into a Pod (not a pod template, since 1.28): on the host's
    network, each port of a container or init container without a ``hostPort`` gets its
    ``containerPort`` as one (the port it binds on the node)."""
    spec = pod.get("spec")
    if not isinstance(spec, dict) or spec.get("hostNetwork") is not True:
        return
    for section in ("containers", "initContainers"):
        for container in spec.get(section) or []:
            for port in (container or {}).get("ports") or []:
                if (
                    isinstance(port, dict)
                    and port.get("containerPort")
                    and not port.get("hostPort")
                ):
                    port["hostPort"] = port["containerPort"]


#: What of a Job's pod template may still change while the Job is suspended and has not
#: started (no ``status.startTime``): Kubernetes 1.27+, which Kueue relies on to place a
#: Job on its flavor's nodes when it admits it.
JOB_SCHEDULING_DIRECTIVES = (
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("spec", "nodeSelector"),
    ("spec", "affinity"),
    ("spec", "tolerations"),
    ("spec", "schedulingGates"),
)


def immutable_part(kind: Kind, path: tuple[str, ...], obj: Any, old: Mapping[str, Any]) -> Any:
    """What of ``obj`` at ``path`` (one of ``kind.immutable``) may not change, given the
    object as stored (``old``): all of it, but for a suspended, unstarted Job's template
    its scheduling directives."""
    for part in path:
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    spec, status = old.get("spec") or {}, old.get("status") or {}
    if (
        kind.key != ("batch", "v1", "jobs")
        or path != ("spec", "template")
        or not spec.get("suspend")
        or status.get("startTime")
        or not isinstance(obj, Mapping)
    ):
        return obj
    out = copy.deepcopy(dict(obj))
    for section, key in JOB_SCHEDULING_DIRECTIVES:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def _configmap_causes(obj: dict[str, Any]) -> list[Cause]:
    out, size = [], 0
    for section in ("data", "binaryData"):
        for key, value in (obj.get(section) or {}).items():
            if not _CM_KEY.match(key) or len(key) > 253:
                out.append(Cause(f"{section}[{key}]", "Invalid value: a valid config key"))
            if section == "data":
                size += len(str(value).encode())
            else:
                try:
                    size += len(base64.b64decode(value, validate=True))
                except ValueError:
                    out.append(Cause(f"binaryData[{key}]", "Invalid value: not base64"))
    if size > CONFIGMAP_LIMIT:
        out.append(
            Cause("", f"Too long: must have at most {CONFIGMAP_LIMIT} bytes", "FieldValueTooLong")
        )
    return out


def _event_causes(obj: dict[str, Any]) -> list[Cause]:
    """core/v1 Event validation as the API server's legacy rules have it. Without an
    ``eventTime`` an Event lives in the namespace of the object it is about ("default"
    for a cluster-scoped one); with one, it names who reported it and the action."""
    ns = metadata(obj).get("namespace") or ""
    about = str((obj.get("involvedObject") or {}).get("namespace") or "")
    out = []
    mismatch = f'Invalid value: "{about}": does not match event.namespace'
    if not obj.get("eventTime"):
        if (about and about != ns) or (not about and ns not in ("", "default")):
            out.append(Cause("involvedObject.namespace", mismatch))
        return out
    if not about and ns not in ("default", "kube-system"):
        out.append(Cause("involvedObject.namespace", mismatch))
    for field in ("reportingComponent", "reportingInstance", "action", "reason"):
        if not obj.get(field):
            out.append(Cause(field, "Required value", "FieldValueRequired"))
        elif len(str(obj[field])) > 128:
            out.append(Cause(field, "Invalid value: can have at most 128 characters"))
    if len(str(obj.get("message") or "").encode()) > 1024:
        out.append(Cause("message", "Invalid value: can have at most 1024 characters"))
    return out


def _priority_class_causes(obj: dict[str, Any]) -> list[Cause]:
    """A PriorityClass needs its ``value`` (an int32 of at most one billion)."""
    value = obj.get("value")
    if value is None:
        return [Cause("value", "Required value", "FieldValueRequired")]
    if not isinstance(value, int) or value > 1_000_000_000:
        return [invalid("value", value, "must be no greater than 1000000000")]
    return []


BUILTIN_KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "namespaces", "Namespace", False, status=True),
    Kind(
        "", "v1", "configmaps", "ConfigMap", True, short_names=("cm",), validate=_configmap_causes
    ),
    Kind(
        "",
        "v1",
        "pods",
        "Pod",
        True,
        status=True,
        short_names=("po",),
        validate=_pod_causes,
        validate_update=_pod_update_causes,
    ),
    Kind(
        "",
        "v1",
        "services",
        "Service",
        True,
        status=True,
        name_rule="dns1035",
        short_names=("svc",),
    ),
    Kind("", "v1", "events", "Event", True, short_names=("ev",), validate=_event_causes),
    Kind("", "v1", "nodes", "Node", False, status=True, short_names=("no",)),
    Kind("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
    Kind("", "v1", "secrets", "Secret", True),
    Kind("", "v1", "resourcequotas", "ResourceQuota", True, status=True, short_names=("quota",)),
    Kind(
        "scheduling.k8s.io",
        "v1",
        "priorityclasses",
        "PriorityClass",
        False,
        short_names=("pc",),
        validate=_priority_class_causes,
    ),
    Kind(
        "batch",
        "v1",
        "jobs",
        "Job",
        True,
        status=True,
        generation=True,
        name_rule="subdomain63",
        immutable=(("spec", "template"), ("spec", "selector"), ("spec", "completionMode")),
        validate=_job_causes,
        validate_update=_job_update_causes,
    ),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        status=True,
        generation=True,
        short_names=("crd",),
    ),
)


def crd_kinds(crd: Mapping[str, Any]) -> list[Kind]:
    """The resources an accepted CRD serves: one for each served version, whose objects
    its schema prunes, defaults and validates."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        status = "status" in (version.get("subresources") or {})
        out.append(
            Kind(
                spec["group"],
                version["name"],
                names["plural"],
                names["kind"],
                spec.get("scope", "Namespaced") == "Namespaced",
                status=status,
                generation=True,
                schema=StructuralSchema(schema),
                short_names=tuple(names.get("shortNames") or ()),
                singular=names.get("singular", ""),
                custom=True,
            )
        )
    return out


def crd_status(crd: Mapping[str, Any]) -> dict[str, Any]:
    """An established CRD's status: its names accepted, its storage version stored."""
    spec = crd["spec"]
    return {
        "acceptedNames": spec["names"],
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {
                "type": t,
                "status": "True",
                "reason": r,
                "lastTransitionTime": now(),
                "message": "",
            }
            for t, r in (
                ("NamesAccepted", "NoConflicts"),
                ("Established", "InitialNamesAccepted"),
            )
        ],
    }
