"""Kueue's elastic workload slices (``ElasticJobsViaWorkloadSlices``, beta and on by
default since Kueue v0.18) for batch/v1 Jobs, as the stand-in of :mod:`k8s.kueue`
plays them: the parts of one pass that concern a Job annotated
``kueue.x-k8s.io/elastic-job: "true"``.

- **The webhook's gate.** Kueue's webhook adds the scheduling gate
  ``kueue.x-k8s.io/elastic-job`` to such a Job's pod template when it is created (only
  where the feature is on: a client can tell by reading the template back). No webhook
  runs on the emulator, so the stand-in adds it on its first pass, while the Job is
  suspended and has not started (when the template's scheduling directives may
  change), before it makes the Job's Workload.
- **Slices.** The Job's Workload carries the annotation too. Its pod count follows the
  Job's ``min(parallelism, completions)``:
  - lowered, or raised before admission, the count is changed in place (an admitted
    slice keeps its admission, its quota usage scaled down to the new count);
  - raised after admission, a new slice is made: a Workload for the new count,
    annotated ``kueue.x-k8s.io/workload-slice-replacement-for: <ns>/<old slice>``. It is
    admitted when the quota holds the new count with the old slice's share counted
    as free; the old slice is then ``Finished`` (reason ``WorkloadSliceReplaced``). The
    Job runs throughout, never suspended; a slice that does not fit stays pending,
    saying why, while the old one keeps its admission.
- **Ungating.** The pods of a Job whose active slice is admitted lose the gate, the
  lowest-named first, up to the slice's count (the pods already ungated count).

Not done: the original flavor kept for a scale-up (the stand-in assigns flavors
afresh), slices with partial admission or topology (Kueue refuses both), MultiKueue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from k8s.jobcontroller import CONTROLLER_UID, lenient, meta, terminal
from k8s.kueue_api import (
    API,
    JOB_UID_LABEL,
    format_quantity,
    is_true,
    owner_uid,
    parse_quantity,
    set_conditions,
    spec_of,
)

if TYPE_CHECKING:
    from k8s.kueue import KueueController

ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"
REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"
REPLACED = "WorkloadSliceReplaced"


def elastic(obj: Mapping[str, Any]) -> bool:
    """A Job (or Workload) that asked for workload slices."""
    return (meta(obj).get("annotations") or {}).get(ELASTIC_ANNOTATION) == "true"


def job_count(job: Mapping[str, Any]) -> int:
    """The pods Kueue asks quota for: ``min(parallelism, completions)``."""
    spec = spec_of(job)
    count = int(spec.get("parallelism", 1))
    if spec.get("completions") is not None:
        count = min(count, int(spec["completions"]))
    return count


def count_of(wl: Mapping[str, Any]) -> int:
    return int((spec_of(wl).get("podSets") or [{}])[0].get("count", 1))


def gated(template_or_pod: Mapping[str, Any]) -> bool:
    gates = spec_of(template_or_pod).get("schedulingGates") or []
    return any(g.get("name") == ELASTIC_GATE for g in gates)


def active_of(workloads: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Job uid → the Workload that speaks for it: the newest unfinished one holding
    quota, else the newest unfinished, else any (a finished Job's)."""
    out: dict[str, dict[str, Any]] = {}

    def rank(wl: Mapping[str, Any]) -> tuple[bool, bool, str, str]:
        m = meta(wl)
        return (
            not is_true(wl, "Finished"),
            is_true(wl, "QuotaReserved"),
            str(m.get("creationTimestamp", "")),
            str(m.get("resourceVersion", "")).zfill(20),
        )

    for wl in workloads:
        uid = owner_uid(wl)
        if uid is not None and (uid not in out or rank(wl) > rank(out[uid])):
            out[uid] = wl
    return out


# --------------------------------------------------------------------------- one pass
def gate_template(k: KueueController, job: Mapping[str, Any]) -> bool:
    """What Kueue's webhook does at creation: the elastic gate in the pod template.
    True once it is there (False: not yet, the Job is not suspended and unstarted)."""
    template = spec_of(job).get("template") or {}
    if gated(template):
        return True
    if not spec_of(job).get("suspend") or (job.get("status") or {}).get("startTime"):
        k._stop_job(job, None)
        return False
    gates = [*(spec_of(template).get("schedulingGates") or []), {"name": ELASTIC_GATE}]
    m = meta(job)
    patch = {"spec": {"template": {"spec": {"schedulingGates": gates}}}}
    lenient(k.kube.patch, "batch/v1", "jobs", m["namespace"], m["name"], patch)
    return False


def resize(k: KueueController, job: Mapping[str, Any], wl: dict[str, Any]) -> None:
    """Follow the Job's pod count: in place (down, or before admission) or by a new
    slice (up, once admitted; one at a time)."""
    want, have = job_count(job), count_of(wl)
    if want == have or is_true(wl, "Finished") or not spec_of(wl).get("podSets"):
        return
    reserved = is_true(wl, "QuotaReserved")
    if want > have and reserved:
        if not _pending_slice(k, wl):
            k._new_workload(dict(job), replaces=wl)
        return
    m = meta(wl)
    podsets = [{**spec_of(wl)["podSets"][0], "count": want}]
    new = lenient(k.kube.patch, API, "workloads", m["namespace"], m["name"],
                  {"spec": {"podSets": podsets}})  # fmt: skip
    if new is not None:
        wl.clear()
        wl.update(new)
    if reserved:
        _scale_admission(k, wl, want)


def slice_key(wl: Mapping[str, Any]) -> str:
    """How a new slice names the one it replaces: ``<namespace>/<name>``."""
    return f"{meta(wl)['namespace']}/{meta(wl)['name']}"


def _replaces(wl: Mapping[str, Any]) -> str | None:
    return (meta(wl).get("annotations") or {}).get(REPLACEMENT_FOR)


def _pending_slice(k: KueueController, old: Mapping[str, Any]) -> bool:
    key = slice_key(old)
    return any(_replaces(w) == key and not is_true(w, "Finished") for w in k.wls.values())


def _scale_admission(k: KueueController, wl: dict[str, Any], count: int) -> None:
    """A scale-down of an admitted slice: its usage shrinks to the new count."""
    admission = dict((wl.get("status") or {}).get("admission") or {})
    psas = []
    for psa in admission.get("podSetAssignments") or []:
        was = int(psa.get("count", 1)) or 1
        usage = {
            r: format_quantity(parse_quantity(v, r) * count // was, r)
            for r, v in (psa.get("resourceUsage") or {}).items()
        }
        psas.append({**psa, "count": count, "resourceUsage": usage})
    k._wl_status(wl, {"admission": {**admission, "podSetAssignments": psas}})


def replaced(k: KueueController, wl: Mapping[str, Any]) -> dict[str, Any] | None:
    """The admitted slice that ``wl`` (a new slice) replaces, if it still holds quota."""
    key = _replaces(wl)
    if not key:
        return None
    return next(
        (
            w
            for w in k.wls.values()
            if slice_key(w) == key and is_true(w, "QuotaReserved") and not is_true(w, "Finished")
        ),
        None,
    )


def finish_replaced(k: KueueController, wl: Mapping[str, Any]) -> None:
    """The new slice is admitted: the old one is ``Finished``, its quota given back."""
    old = replaced(k, wl)
    if old is None:
        return
    job_uid = (meta(wl).get("labels") or {}).get(JOB_UID_LABEL, "UNKNOWN")
    why = (
        f"Replaced to accommodate a workload (UID: {meta(wl)['uid']}, JobUID: {job_uid}) "
        "due to workload slice aggregation"
    )
    k._wl_status(old, {"conditions": set_conditions(old, ("Finished", True, REPLACED, why))})


def ungate(k: KueueController, job: Mapping[str, Any], wl: Mapping[str, Any]) -> None:
    """Release the Job's gated pods, lowest name first, up to the admitted count."""
    if not is_true(wl, "Admitted") or is_true(wl, "Finished"):
        return
    m = meta(job)
    pods = [
        p
        for p in k.kube.list("v1", "pods", m["namespace"], f"{CONTROLLER_UID}={m['uid']}")
        if not terminal(p) and not meta(p).get("deletionTimestamp")
    ]
    waiting = sorted((p for p in pods if gated(p)), key=lambda p: str(meta(p)["name"]))
    room = count_of(wl) - (len(pods) - len(waiting))
    for pod in waiting[: max(0, room)]:
        left = [
            g for g in spec_of(pod).get("schedulingGates") or [] if g.get("name") != ELASTIC_GATE
        ]
        pm = meta(pod)
        patch = {"spec": {"schedulingGates": left or None}}
        lenient(k.kube.patch, "v1", "pods", pm["namespace"], pm["name"], patch)
