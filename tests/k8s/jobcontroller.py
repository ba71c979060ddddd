"""A stand-in for kube-controller-manager's Job controller: what turns our worker Jobs
into pods, for :mod:`k8s.scheduler` to bind and :mod:`k8s.kubelet` to run.

One stateless pass over what the API lists (:meth:`JobController.sync`), run every
~0.2 s by :class:`k8s.kubelet.LocalCluster`; counts are read back from the pods, which
stay until their Job goes, so nothing is remembered between passes.

The Job controller, for the Jobs its label selector picks (our worker Jobs by default):

- pods from the template, as the real controller makes them: an Indexed Job's pod
  ``<job>-<index>-<random>`` with hostname ``<job>-<index>`` (the template's subdomain
  kept), label and annotation ``batch.kubernetes.io/job-completion-index``, env
  ``JOB_COMPLETION_INDEX`` from that annotation; a NonIndexed one's ``<job>-<random>``;
  labels ``job-name``/``controller-uid`` (plain and ``batch.kubernetes.io/``) and a
  controller ``ownerReference`` (``blockOwnerDeletion``) to the Job;
- up to ``parallelism`` pods at a time, one per index not yet completed; a failed
  pod's index gets a new pod (restartPolicy Never) while the failures counted stay
  within ``backoffLimit``; scaled down (an Indexed Job's ``completions`` and
  ``parallelism`` lowered together), the pods of indexes out of range are deleted, then
  any beyond ``parallelism``, highest index first;
- ``podFailurePolicy`` rules in order (``onExitCodes`` In/NotIn, ``onPodConditions``):
  ``Ignore`` (not counted), ``FailJob``, ``Count``; no rule matched counts;
- status: ``startTime`` (set when it runs unsuspended, cleared on suspend), ``active``,
  ``ready``, ``terminating``, ``succeeded``, ``failed``, ``completedIndexes``,
  ``completionTime``; conditions ``SuccessCriteriaMet`` then ``Complete``,
  ``FailureTarget`` then ``Failed`` (reasons ``BackoffLimitExceeded``,
  ``PodFailurePolicy``, ``DeadlineExceeded`` from ``activeDeadlineSeconds``) once no
  pod is left running, as Kubernetes 1.31+ orders them; ``Suspended`` True/False;
- a suspended or failed Job's running pods are deleted; a Job being deleted gets no
  new pods and no status writes: its pods are the garbage collector's (the emulator's,
  Foreground or Background), which marks them for their kubelet to stop.

A pod the API server refuses (admission: Pod Security, a ResourceQuota, an unknown
PriorityClass; a 422) is recorded as the real controller records it, a ``FailedCreate``
Warning Event on the Job, ``Error creating: <the server's message>``, through
:mod:`k8s.eventrecorder` (repeats counted, similar ones combined); the Job is tried
again after a backoff (0.5 s, doubling to 30 s), and no pod exists meanwhile.

Not done: the pod-tracking finalizers and ``uncountedTerminatedPods``; backoff delays
between retries of failed pods (a failed index is retried at the next pass); ``FailIndex``,
``backoffLimitPerIndex``, ``successPolicy``, ``podReplacementPolicy`` (a pod is
replaced once terminal, never while terminating); ``ttlSecondsAfterFinished``;
Events other than ``FailedCreate``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from k8s.eventrecorder import EventRecorder
from k8s.helpers import now
from shardwise.operator.kube import ApiError, KubeApi

INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
TERMINAL = ("Succeeded", "Failed")
FAILED_CREATE = "FailedCreate"
#: Retries of a Job whose pods are refused: the first after this, doubling to the most.
FIRST_BACKOFF, MAX_BACKOFF = 0.5, 30.0


# --------------------------------------------------------------------------- small reads
def meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def terminal(pod: Mapping[str, Any]) -> bool:
    return phase(pod) in TERMINAL


def deleting(obj: Mapping[str, Any]) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def pod_index(pod: Mapping[str, Any]) -> int | None:
    raw = (meta(pod).get("annotations") or {}).get(INDEX)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def condition_true(obj: Mapping[str, Any], type_: str) -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conds)


def _parse(stamp: Any) -> datetime.datetime | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def set_condition(
    conds: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str
) -> list[dict[str, Any]]:
    """``conds`` with ``type_`` set; its transition time kept when its status is."""
    value = "True" if status else "False"
    old = next((c for c in conds if c.get("type") == type_), None)
    if old is not None and old.get("status") == value:
        new = {**old, "reason": reason, "message": message}
    else:
        stamp = now()
        new = {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "lastProbeTime": stamp,
            "lastTransitionTime": stamp,
        }
    return [new if c is old else c for c in conds] if old is not None else [*conds, new]


def index_ranges(indexes: Iterable[int]) -> str:
    """``completedIndexes`` as the controller writes it: ``0-2,4``."""
    out: list[str] = []
    for i in sorted(set(indexes)):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


# --------------------------------------------------------------------------- pod failure policy
def _exit_codes(pod: Mapping[str, Any], container: str | None) -> list[int]:
    codes = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term and (container is None or cs.get("name") == container):
            codes.append(int(term.get("exitCode", 0)))
    return codes


def failure_action(job: Mapping[str, Any], pod: Mapping[str, Any]) -> tuple[str, str]:
    """(action, why) of the Job's ``podFailurePolicy`` for a failed pod: the first rule
    that matches decides; none matching counts the failure."""
    rules = ((job.get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []
    for i, rule in enumerate(rules):
        action = str(rule.get("action", "Count"))
        on_codes = rule.get("onExitCodes")
        if on_codes:
            values = {int(v) for v in on_codes.get("values") or []}
            for code in _exit_codes(pod, on_codes.get("containerName")):
                hit = code in values if on_codes.get("operator") == "In" else code not in values
                if code != 0 and hit:
                    return action, (
                        f"Container for pod {meta(pod).get('namespace')}/{meta(pod).get('name')} "
                        f"failed with exit code {code} matching {action} rule at index {i}"
                    )
        for pattern in rule.get("onPodConditions") or []:
            wanted = str(pattern.get("status", "True"))
            conds = (pod.get("status") or {}).get("conditions") or []
            if any(
                c.get("type") == pattern.get("type") and c.get("status") == wanted for c in conds
            ):
                return action, (
                    f"Pod {meta(pod).get('namespace')}/{meta(pod).get('name')} has condition "
                    f"{pattern.get('type')} matching {action} rule at index {i}"
                )
    return "Count", ""


# --------------------------------------------------------------------------- the Job controller
def lenient(fn: Callable[..., Any], *args: Any) -> Any:
    """An API call whose object may have gone or changed meanwhile (404, 409: the next
    pass sees the news); ``None`` then. Every stand-in controller calls through it."""
    try:
        return fn(*args)
    except ApiError as err:
        if err.status in (404, 409):
            return None
        raise


class JobController:
    """One pass over the selected Jobs per :meth:`sync` (see the module docstring)."""

    def __init__(self, kube: KubeApi, selector: str = "shardwise.dev/component=worker") -> None:
        self.kube, self.selector = kube, selector
        self.created: list[str] = []  # pod names, in creation order (for tests and logs)
        self.events = EventRecorder(kube, "job-controller")
        #: A Job whose pods were refused: when to try again, and the delay that was.
        self._backoff: dict[str, tuple[float, float]] = {}

    def sync(self, pods: Sequence[Mapping[str, Any]]) -> None:
        for job in self.kube.list("batch/v1", "jobs", None, self.selector):
            mine = [p for p in pods if controller_uid(p) == meta(job)["uid"]]
            if not deleting(job):
                self.sync_job(job, mine)

    def sync_job(self, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> None:
        spec, status = job.get("spec") or {}, dict(job.get("status") or {})
        conds: list[dict[str, Any]] = list(status.get("conditions") or [])
        running = [p for p in pods if not terminal(p) and not deleting(p)]
        stopping = [p for p in pods if not terminal(p) and deleting(p)]
        finished = condition_true(job, "Complete") or condition_true(job, "Failed")
        indexed = spec.get("completionMode") == "Indexed"
        completions = int(spec.get("completions") or 1)
        done_idx = {
            pod_index(p)
            for p in pods
            if phase(p) == "Succeeded" and (not indexed or (pod_index(p) or 0) < completions)
        }
        succeeded = (
            len(done_idx - {None}) if indexed else sum(phase(p) == "Succeeded" for p in pods)
        )
        failed, fail_job = 0, ""
        for p in pods:
            if phase(p) != "Failed":
                continue
            action, why = failure_action(job, p)
            if action == "FailJob" and not fail_job:
                fail_job = why
            elif action == "Count":
                failed += 1
        suspended = bool(spec.get("suspend"))
        if suspended or finished:
            self._stop(running)
            stopping, running = stopping + running, []
        if suspended:
            conds = set_condition(conds, "Suspended", True, "JobSuspended", "Job suspended")
            status.pop("startTime", None)
        elif not finished:
            if condition_true(job, "Suspended"):
                conds = set_condition(conds, "Suspended", False, "JobResumed", "Job resumed")
            status.setdefault("startTime", now())
            failure = self._failure(spec, status, failed, fail_job)
            if failure is not None:
                conds = set_condition(conds, "FailureTarget", True, *failure)
                self._stop(running)
                stopping, running = stopping + running, []
                if not stopping:
                    conds = set_condition(conds, "Failed", True, *failure)
            elif succeeded >= completions:
                msg = "Reached expected number of succeeded pods"
                conds = set_condition(conds, "SuccessCriteriaMet", True, "CompletionsReached", msg)
                if not running and not stopping:
                    conds = set_condition(conds, "Complete", True, "CompletionsReached", msg)
                    status.setdefault("completionTime", now())
            else:
                excess = self._excess(spec, running, indexed)
                self._stop(excess)
                running = [p for p in running if p not in excess]
                stopping += excess
                running += self._create(job, pods, running, stopping, done_idx, indexed)
        new = {
            **status,
            "active": len(running),
            "ready": sum(condition_true(p, "Ready") for p in running),
            "terminating": len(stopping),
            "succeeded": succeeded,
            "failed": failed,
            "conditions": conds,
            "uncountedTerminatedPods": {},
        }
        if indexed:
            new["completedIndexes"] = index_ranges(i for i in done_idx if i is not None)
        if new != (job.get("status") or {}):
            m = meta(job)
            self._call(
                self.kube.patch,
                "batch/v1",
                "jobs",
                m["namespace"],
                m["name"],
                {"status": new},
                "status",
            )

    @staticmethod
    def _failure(
        spec: Mapping[str, Any], status: Mapping[str, Any], failed: int, fail_job: str
    ) -> tuple[str, str] | None:
        if fail_job:
            return "PodFailurePolicy", fail_job
        if failed > int(spec.get("backoffLimit", 6)):
            return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        deadline, started = spec.get("activeDeadlineSeconds"), _parse(status.get("startTime"))
        if deadline is not None and started is not None:
            ran = datetime.datetime.now(datetime.UTC) - started
            if ran > datetime.timedelta(seconds=int(deadline)):
                return "DeadlineExceeded", "Job was active longer than specified deadline"
        return None

    @staticmethod
    def _excess(
        spec: Mapping[str, Any], running: Sequence[Mapping[str, Any]], indexed: bool
    ) -> list[Mapping[str, Any]]:
        """The running pods a scaled-down Job no longer wants: an Indexed Job's pods whose
        index is now out of range (``completions`` lowered, in tandem with
        ``parallelism``), then any beyond ``parallelism``, highest index first."""
        completions = int(spec.get("completions") or 1)
        out = [p for p in running if indexed and (pod_index(p) or 0) >= completions]
        rest = sorted(
            (p for p in running if p not in out), key=lambda p: pod_index(p) or 0, reverse=True
        )
        over = len(rest) - int(spec.get("parallelism", 1))
        return out + rest[: max(0, over)]

    def _create(
        self,
        job: Mapping[str, Any],
        pods: Sequence[Mapping[str, Any]],
        running: Sequence[Mapping[str, Any]],
        stopping: Sequence[Mapping[str, Any]],
        done_idx: set[int | None],
        indexed: bool,
    ) -> list[dict[str, Any]]:
        spec = job.get("spec") or {}
        room = int(spec.get("parallelism", 1)) - len(running)
        completions = int(spec.get("completions") or 1)
        if indexed:
            busy = {pod_index(p) for p in [*running, *stopping]}
            todo: list[int | None] = [
                i for i in range(completions) if i not in done_idx and i not in busy
            ]
        else:
            left = completions - sum(phase(p) == "Succeeded" for p in pods)
            todo = [None] * max(0, min(room, left - len(running) - len(stopping)))
        made: list[dict[str, Any]] = []
        uid = str(meta(job)["uid"])
        due, delay = self._backoff.get(uid, (0.0, 0.0))
        if time.monotonic() < due:
            return made
        for index in todo[: max(0, room)]:
            try:
                created = self._call(self.kube.create, self.pod_for(job, index))
            except ApiError as err:
                if err.status not in (403, 422):
                    raise
                # refused (admission, validation): said on the Job, retried after a backoff
                self.events.event(
                    job, "Warning", FAILED_CREATE, f"Error creating: {err.message}",
                    kind="Job", api_version="batch/v1",
                )  # fmt: skip
                delay = min(MAX_BACKOFF, max(FIRST_BACKOFF, 2 * delay))
                self._backoff[uid] = (time.monotonic() + delay, delay)
                return made
            if created is not None:
                self.created.append(meta(created)["name"])
                made.append(created)
        self._backoff.pop(uid, None)
        return made

    @staticmethod
    def pod_for(job: Mapping[str, Any], index: int | None) -> dict[str, Any]:
        """The pod the real controller would create for ``index`` (None: NonIndexed)."""
        m, template = meta(job), (job.get("spec") or {}).get("template") or {}
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        labels |= {
            "job-name": m["name"],
            JOB_NAME: m["name"],
            "controller-uid": m["uid"],
            CONTROLLER_UID: m["uid"],
        }
        annotations = dict((template.get("metadata") or {}).get("annotations") or {})
        pod_spec = dict(template.get("spec") or {})
        prefix = f"{m['name']}-"
        if index is not None:
            labels[INDEX] = annotations[INDEX] = str(index)
            pod_spec["hostname"] = f"{m['name']}-{index}"
            prefix = f"{m['name']}-{index}-"
            env = {
                "name": "JOB_COMPLETION_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
            }
            pod_spec["containers"] = [
                {**c, "env": [*(c.get("env") or []), env]}
                if not any(e.get("name") == env["name"] for e in c.get("env") or [])
                else c
                for c in pod_spec.get("containers") or []
            ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": prefix,
                "namespace": m["namespace"],
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": m["name"],
                        "uid": m["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": pod_spec,
        }

    def _stop(self, pods: Iterable[Mapping[str, Any]]) -> None:
        for p in pods:
            m = meta(p)
            self._call(self.kube.delete, "v1", "pods", m["namespace"], m["name"])

    _call = staticmethod(lenient)
