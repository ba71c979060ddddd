"""Why a child's pods have not started: pure readings of pods and Events.

A pod that cannot start says so in its own status (the scheduler's ``PodScheduled=False,
reason Unschedulable``, the kubelet's waiting reasons such as ``ImagePullBackOff``), so
the operator keeps a small :class:`PodState` of each of its pods in a kopf index (the
pods watch exists anyway, for GPU capacity) and reads problems from memory. A pod that
was never created leaves no pod to read: the Job controller records the refusal as a
``FailedCreate`` Event on the Job, and nothing watches Events, so a Job that still has
no pods a few seconds after it was created is looked up with one Events list narrowed
by a field selector (:func:`events_selector`), and again every
``OperatorConfig.pod_check_seconds`` while it stays without pods.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise import names
from shardwise.operator.cluster.summaries import JobState, parse_time

#: Kubelet waiting reasons of a container whose image cannot be pulled; they alternate
#: (ErrImagePull, then ImagePullBackOff), so they share one condition reason.
IMAGE_PULL_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RegistryUnavailable",
        "SignatureValidationFailed",
    }
)
#: Waiting reasons that stop a container from starting at all (reported as they are).
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
CONFIG_ERROR = "CreateContainerConfigError"
FAILED_CREATE = "FailedCreate"
UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL_ERROR = "ImagePullError"
#: The condition reasons a startup problem can put on the DLRMJob.
CONDITION_REASONS = frozenset({FAILED_CREATE, UNSCHEDULABLE, IMAGE_PULL_ERROR, *CONFIG_REASONS})

_FAR = datetime.datetime.max.replace(tzinfo=datetime.UTC)
_POD = "spec.template.podOverrides.spec"
_CONTAINER = ("spec.template.securityContext", f"{_POD}.initContainers/containers")
#: What a refusal says (PodSecurity's reasons, other admission plugins' words) → the
#: DLRMJob fields that set it.
_FIELDS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("hostNetwork=true",), (f"{_POD}.hostNetwork",)),
    (("hostIPC=true",), (f"{_POD}.hostIPC",)),
    (
        (
            "privileged", "allowPrivilegeEscalation", "unrestricted capabilities",
            "non-default capabilities", "procMount", "seLinuxOptions", "hostProcess",
        ),
        _CONTAINER,
    ),
    (("runAsNonRoot", "runAsUser=0", "seccompProfile"), (f"{_POD}.securityContext", *_CONTAINER)),
    (("forbidden sysctls",), (f"{_POD}.securityContext",)),
    (("hostPath volumes", "restricted volume types"), ("spec.template.volumes",)),
    (("probe or lifecycle host",), (f"{_POD}.initContainers/containers",)),
    (("no PriorityClass with name",), (f"{_POD}.priorityClassName",)),
    (("must specify",), ("spec.template.resources", f"{_POD}.initContainers/containers")),
    (("exceeded quota",), ("spec.template.resources", "spec.workers.max")),
)  # fmt: skip
#: PodSecurity's hostPort detail: the containers it names.
_HOST_PORTS = re.compile(r'hostPort \(containers? ((?:"[^"]*"(?:, )?)+) uses? hostPorts? ')
#: The operator's own containers (named after their component): their ports are its.
_OWN_CONTAINERS = frozenset({names.COMPONENT_WORKER, names.COMPONENT_PROFILER})
#: Fields the profiling pod does not take.
_WORKER_ONLY = frozenset(
    {f"{_POD}.hostNetwork", f"{_POD}.hostIPC", "spec.workers.max", "spec.template.volumes"}
)


@dataclass(frozen=True)
class StartupProblem:
    """What keeps a pod (or a Job's pods) from starting, as the cluster worded it."""

    kind: str  # "Pod", or "Job" when the pods could not even be created
    name: str
    reason: str  # the cluster's own reason (FailedCreate, Unschedulable, ErrImagePull …)
    message: str
    since: datetime.datetime | None = None

    @property
    def condition_reason(self) -> str:
        """The DLRMJob condition's reason: the cluster's, image pull errors merged."""
        return IMAGE_PULL_ERROR if self.reason in IMAGE_PULL_REASONS else self.reason

    def describe(self) -> str:
        """The problem in the cluster's own words, whole (a refusal's message lists every
        requirement it found unmet: cutting it would hide some)."""
        text = " ".join(self.message.split())
        return f"{self.kind.lower()} {self.name}: {self.reason}" + (f": {text}" if text else "")

    @property
    def recurs(self) -> bool:
        """No retry gets past it until something is changed: a refusal of the pod by
        admission or validation (Pod Security, an unknown PriorityClass, a missing
        ServiceAccount, a quota that requires what the pod does not state), or a
        container the kubelet cannot configure (a missing Secret or ConfigMap key, a
        user it cannot prove non-root). A quota exceeded is not: it frees up as other
        pods end."""
        if self.reason == CONFIG_ERROR:
            return True
        if self.reason != FAILED_CREATE or "exceeded quota" in self.message:
            return False
        return "is forbidden" in self.message or "is invalid" in self.message

    def fields(self, component: str) -> list[str]:
        """The DLRMJob's fields that decide what the cluster refused (``component``:
        ``worker`` or ``profiler``), for the condition to point at."""
        profiler = component == names.COMPONENT_PROFILER
        found = []
        for words, where in _FIELDS:
            if any(w in self.message for w in words):
                found += [f for f in where if not (profiler and f in _WORKER_ONLY)]
        found += [
            f for f in _host_port_fields(self.message) if not (profiler and f in _WORKER_ONLY)
        ]
        if "serviceaccount" in self.message and "not found" in self.message:
            found.append(
                "spec.profiling.serviceAccountName"
                if profiler
                else "spec.template.serviceAccountName"
            )
        return list(dict.fromkeys(found))

    def with_fields(self, component: str) -> str:
        """:meth:`describe`, and where to fix it in the DLRMJob when that is known."""
        fields = self.fields(component)
        return self.describe() + (f" (the DLRMJob's {', '.join(fields)})" if fields else "")


def _host_port_fields(message: str) -> list[str]:
    """Where a hostPort refusal is fixed. On the host's network every container port is a
    host port (the API server fills ``hostPort`` in), so the user's lever is
    ``hostNetwork``; the containers too when one of the user's own is named (an explicit
    ``hostPort``, or a port it need not expose)."""
    m = _HOST_PORTS.search(message)
    if m is None:
        return [f"{_POD}.initContainers/containers"] if "hostPort (" in message else []
    named = set(re.findall(r'"([^"]*)"', m[1]))
    out = [f"{_POD}.hostNetwork"] if "hostNetwork=true" in message else []
    if not out or named - _OWN_CONTAINERS:
        out.append(f"{_POD}.initContainers/containers")
    return out


@dataclass(frozen=True)
class PodState:
    """One of our pods (label ``shardwise.dev/job``), as the ``sw_pods`` index keeps it."""

    name: str
    namespace: str
    job: str  # the DLRMJob (label)
    component: str
    owner: str  # the controlling Job's name ("" if none)
    owner_uid: str
    phase: str
    #: A container ran (or the pod finished): the pod got past scheduling and pulling.
    started: bool
    problem: StartupProblem | None = None
    deleting: bool = False
    #: The node it is bound to ("" before scheduling).
    node: str = ""
    #: When its grace period ends, once deleted (``deletionTimestamp``).
    deletion_deadline: datetime.datetime | None = None
    #: That grace period, in seconds (``deletionGracePeriodSeconds``).
    deletion_grace_seconds: float = 0.0


def _container_problem(name: str, statuses: Iterable[Mapping[str, Any]]) -> StartupProblem | None:
    for cs in statuses:
        state = cs.get("state")
        waiting = state.get("waiting") if isinstance(state, Mapping) else None
        if not isinstance(waiting, Mapping):
            continue
        reason = str(waiting.get("reason") or "")
        if reason in IMAGE_PULL_REASONS or reason in CONFIG_REASONS:
            container = cs.get("name", "")
            return StartupProblem(
                "Pod", name, reason, f"container {container}: {waiting.get('message') or reason}"
            )
    return None


def pod_problem(body: Mapping[str, Any]) -> StartupProblem | None:
    """The reason a pod cannot start (not scheduled, image not pulled, container config
    broken), or ``None`` while it is fine or simply not there yet."""
    meta = body.get("metadata")
    status = body.get("status")
    if not isinstance(meta, Mapping) or not isinstance(status, Mapping):
        return None
    name = str(meta.get("name", ""))
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == UNSCHEDULABLE
        ):
            return StartupProblem(
                "Pod",
                name,
                UNSCHEDULABLE,
                str(cond.get("message") or "no node fits"),
                parse_time(cond.get("lastTransitionTime")),
            )
    for key in ("initContainerStatuses", "containerStatuses"):
        found = _container_problem(name, status.get(key) or [])
        if found is not None:
            return found
    return None


def _started(status: Mapping[str, Any]) -> bool:
    if status.get("phase") in ("Running", "Succeeded", "Failed"):
        return True
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            state = cs.get("state") or {}
            if state.get("running") or state.get("terminated"):
                return True
    return False


def pod_state(body: Mapping[str, Any]) -> PodState:
    meta = body.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    status = body.get("status")
    status = status if isinstance(status, Mapping) else {}
    labels = meta.get("labels") or {}
    owner: Mapping[str, Any] = next(
        (
            o
            for o in meta.get("ownerReferences") or []
            if o.get("kind") == "Job" and o.get("controller")
        ),
        {},
    )
    return PodState(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        job=str(labels.get(names.LABEL_JOB, "")),
        component=str(labels.get(names.LABEL_COMPONENT, "")),
        owner=str(owner.get("name", "")),
        owner_uid=str(owner.get("uid", "")),
        phase=str(status.get("phase") or "Pending"),
        started=_started(status),
        problem=pod_problem(body),
        deleting=bool(meta.get("deletionTimestamp")),
        node=str((body.get("spec") or {}).get("nodeName") or ""),
        deletion_deadline=parse_time(meta.get("deletionTimestamp")),
        deletion_grace_seconds=float(meta.get("deletionGracePeriodSeconds") or 0),
    )


def pods_of(job: JobState, pods: Iterable[PodState]) -> list[PodState]:
    """The live pods ``job`` controls (by owner uid; by name for an ownerless pod)."""
    return [
        p
        for p in pods
        if not p.deleting
        and (p.owner_uid == job.ref.uid if p.owner_uid else p.owner == job.ref.name)
    ]


def failed_create(events: Sequence[Mapping[str, Any]]) -> StartupProblem | None:
    """The latest ``FailedCreate`` Warning among a Job's Events (core/v1 or events.k8s.io
    wording), or ``None``."""
    best: tuple[datetime.datetime, StartupProblem] | None = None
    for ev in events:
        if ev.get("reason") != FAILED_CREATE or ev.get("type", "Warning") != "Warning":
            continue
        obj = ev.get("involvedObject") or ev.get("regarding") or {}
        series = ev.get("series") or {}
        when = (
            parse_time(series.get("lastObservedTime"))
            or parse_time(ev.get("lastTimestamp"))
            or parse_time(ev.get("eventTime"))
            or parse_time(ev.get("firstTimestamp"))
        )
        problem = StartupProblem(
            "Job",
            str(obj.get("name", "")),
            FAILED_CREATE,
            str(ev.get("message") or ev.get("note") or ""),
            when,
        )
        key = when or datetime.datetime.min.replace(tzinfo=datetime.UTC)
        if best is None or key >= best[0]:
            best = (key, problem)
    return best[1] if best else None


def events_selector(job: JobState) -> str:
    """The field selector of a Job's ``FailedCreate`` Events (all server-side fields)."""
    return (
        f"involvedObject.kind=Job,involvedObject.name={job.ref.name},"
        f"involvedObject.uid={job.ref.uid},reason={FAILED_CREATE}"
    )


def wanted_pods(job: JobState) -> int:
    """The pods a Job of ours runs at once: a worker Job's workers (its annotation),
    else one."""
    try:
        return max(1, int(job.ref.annotations.get(names.ANN_WORKERS, "1")))
    except ValueError:
        return 1


def needs_events_check(
    job: JobState, pods: Sequence[PodState], grace_seconds: float
) -> datetime.datetime | None:
    """From when ``job``'s Events are worth reading: it runs (not done, suspended or
    deleted) yet controls fewer pods than it wants (:func:`wanted_pods`: a quota may
    admit some of a Job's pods and refuse the rest). ``None``: no need."""
    if job.done or job.suspended or job.ref.deleting or len(pods_of(job, pods)) >= wanted_pods(job):
        return None
    since = job.started_at or job.ref.created
    if since is None:
        return datetime.datetime.min.replace(tzinfo=datetime.UTC)
    return since + datetime.timedelta(seconds=grace_seconds)


@dataclass(frozen=True)
class Startup:
    """How far a Job's pods got."""

    started: bool
    problem: StartupProblem | None = None


def job_startup(
    job: JobState, pods: Sequence[PodState], failed: StartupProblem | None = None
) -> Startup:
    """Whether ``job`` has a pod that started, else the first problem of its pods (the
    oldest), else its ``FailedCreate`` (which counts only while it has no pod)."""
    mine = pods_of(job, pods)
    if job.ready or job.succeeded or job.failed or any(p.started for p in mine):
        return Startup(True)
    problems = [p.problem for p in mine if p.problem is not None]
    if problems:
        return Startup(False, min(problems, key=lambda x: (x.since or _FAR, x.name)))
    return Startup(False, failed if not mine else None)


def startup_deadline(job: JobState, timeout_seconds: float) -> datetime.datetime | None:
    """When a Job whose pods have not started counts as failed: ``timeout_seconds``
    after the Job controller started it (``status.startTime``, reset on resume), or
    after its creation when the controller has not said; never while it is suspended."""
    if job.suspended:  # queued in Kueue (or suspended): not started, not late
        return None
    since = job.started_at or job.ref.created
    return since + datetime.timedelta(seconds=timeout_seconds) if since else None
