"""Small, immutable summaries of the objects the operator watches.

The kopf indexes keep these instead of whole bodies (50 jobs' children stay a few
hundred kilobytes), and :mod:`shardwise.operator.decide.reconcile` decides from them alone.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise import names
from shardwise.planner.live.summary import LiveSummary


def parse_time(value: Any) -> datetime.datetime | None:
    if not value:
        return None
    try:
        t = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.UTC)


def format_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ChildRef:
    """Identity and labels of a child object."""

    kind: str
    name: str
    namespace: str
    uid: str
    resource_version: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner_uids: tuple[str, ...] = ()
    deleting: bool = False
    created: datetime.datetime | None = None

    @property
    def job(self) -> str:
        return self.labels.get(names.LABEL_JOB, "")


def child_ref(body: Mapping[str, Any]) -> ChildRef:
    meta = body.get("metadata") or {}
    return ChildRef(
        kind=str(body.get("kind", "")),
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        uid=str(meta.get("uid", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        owner_uids=tuple(str(o.get("uid", "")) for o in meta.get("ownerReferences") or []),
        deleting=bool(meta.get("deletionTimestamp")),
        created=parse_time(meta.get("creationTimestamp")),
    )


@dataclass(frozen=True)
class JobState:
    """A ``batch/v1`` Job: where it is in its life."""

    ref: ChildRef
    active: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False
    failure: str | None = None  # "Reason: message" of the Failed condition
    suspended: bool = False
    finished: datetime.datetime | None = None
    #: When the Job controller started it (``status.startTime``; reset on resume).
    started_at: datetime.datetime | None = None
    #: The reason alone: the Failed condition's, or the operator's own mark (failure
    #: annotation: ``StartupTimeout``, ``InvalidSettings``), which wins.
    failure_reason: str | None = None
    #: Kueue took it as elastic (its webhook gated the pod template): its size can
    #: change in place, through workload slices (``operator.render.elastic``).
    slices: bool = False

    @property
    def done(self) -> bool:
        return self.complete or self.failure is not None


def failure_mark(reason: str, message: str, at: datetime.datetime) -> str:
    """The value of the failure annotation (``shardwise.dev/failure``) the operator puts
    on a Job it gave up on: the Job stays as the record of a failed attempt."""
    return json.dumps({"reason": reason, "message": message, "at": format_time(at)})


def _marked(annotations: Mapping[str, str]) -> tuple[str, str, datetime.datetime | None] | None:
    raw = annotations.get(names.ANN_FAILURE)
    if not raw:
        return None
    try:
        mark = json.loads(raw)
    except json.JSONDecodeError:
        return "Failed", raw, None
    if not isinstance(mark, dict):
        return "Failed", raw, None
    return (
        str(mark.get("reason") or "Failed"),
        str(mark.get("message", "")),
        parse_time(mark.get("at")),
    )


def job_state(body: Mapping[str, Any]) -> JobState:
    status = body.get("status") or {}
    complete, failure, finished = False, None, parse_time(status.get("completionTime"))
    reason = None
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            complete = True
            finished = finished or parse_time(cond.get("lastTransitionTime"))
        elif cond.get("type") == "Failed":
            reason = str(cond.get("reason") or "Failed")
            failure = f"{reason}: {cond.get('message') or 'the Job failed'}"
            finished = parse_time(cond.get("lastTransitionTime")) or finished
    mark = _marked((body.get("metadata") or {}).get("annotations") or {})
    if mark is not None and not complete:
        reason, message, at = mark
        failure, finished = f"{reason}: {message}", at or finished
    return JobState(
        ref=child_ref({**body, "kind": "Job"}),
        active=int(status.get("active") or 0),
        ready=int(status.get("ready") or 0),
        succeeded=int(status.get("succeeded") or 0),
        failed=int(status.get("failed") or 0),
        complete=complete,
        failure=failure,
        suspended=bool((body.get("spec") or {}).get("suspend")),
        finished=finished,
        started_at=parse_time(status.get("startTime")),
        failure_reason=reason,
        slices=_takes_slices(body),
    )


def _takes_slices(body: Mapping[str, Any]) -> bool:
    """Asked for elastic slices, and the installed Kueue's webhook answered with its gate."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    template = ((body.get("spec") or {}).get("template") or {}).get("spec") or {}
    gates = template.get("schedulingGates") or []
    return annotations.get(names.ANN_KUEUE_ELASTIC) == "true" and any(
        g.get("name") == names.KUEUE_ELASTIC_GATE for g in gates
    )


@dataclass(frozen=True)
class PlanRecord:
    """What a plan ConfigMap says about its plan (annotation ``shardwise.dev/plan``)."""

    ref: ChildRef
    inputs_hash: str
    summary: Mapping[str, Any]

    @property
    def plan_hash(self) -> str:
        return str(self.summary.get("hash", ""))


def plan_record(body: Mapping[str, Any]) -> PlanRecord:
    ref = child_ref({**body, "kind": "ConfigMap"})
    try:
        summary = json.loads(ref.annotations.get(names.ANN_PLAN, "{}"))
    except json.JSONDecodeError:
        summary = {}
    return PlanRecord(ref, ref.annotations.get(names.ANN_INPUTS_HASH, ""), summary)


@dataclass(frozen=True)
class PodFailure:
    """The first thing that went wrong in a failed pod, for the Event and condition."""

    pod: str
    container: str
    exit_code: int | None
    reason: str
    message: str
    finished: datetime.datetime | None

    def describe(self) -> str:
        code = f" with exit code {self.exit_code}" if self.exit_code is not None else ""
        tail = f": {self.message.strip()[:300]}" if self.message.strip() else ""
        return f"pod {self.pod} container {self.container} failed{code} ({self.reason}){tail}"


def pod_failure(body: Mapping[str, Any]) -> PodFailure | None:
    """The pod's failure, or ``None`` when it has not failed."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    name = str(meta.get("name", ""))
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term and int(term.get("exitCode", 0)) != 0:
            return PodFailure(
                name,
                str(cs.get("name", "")),
                int(term["exitCode"]),
                str(term.get("reason") or "Error"),
                str(term.get("message") or ""),
                parse_time(term.get("finishedAt")),
            )
    if status.get("phase") == "Failed":
        return PodFailure(
            name,
            "",
            None,
            str(status.get("reason") or "Failed"),
            str(status.get("message") or ""),
            parse_time(meta.get("deletionTimestamp") or meta.get("creationTimestamp")),
        )
    return None


def first_failure(pods: Sequence[Mapping[str, Any]]) -> PodFailure | None:
    """The earliest pod failure (by finish time, then name)."""
    found = [f for f in (pod_failure(p) for p in pods) if f is not None]
    far = datetime.datetime.max.replace(tzinfo=datetime.UTC)
    return min(found, key=lambda f: (f.finished or far, f.pod), default=None)


@dataclass(frozen=True)
class LiveRecord:
    """The job's live ConfigMap: rank 0's summary, or why it cannot be read."""

    summary: LiveSummary | None
    problem: str | None = None


def live_record(body: Mapping[str, Any]) -> LiveRecord:
    """Parse ``live.json``; an empty ConfigMap (no summary written yet) is no problem."""
    name = (body.get("metadata") or {}).get("name", "")
    text = (body.get("data") or {}).get(names.LIVE_KEY)
    if not text:
        return LiveRecord(None)
    try:
        return LiveRecord(LiveSummary.model_validate_json(text))
    except ValueError as err:
        first = str(err).splitlines()[0]
        return LiveRecord(None, f"ConfigMap {name} key {names.LIVE_KEY} is unreadable ({first})")
