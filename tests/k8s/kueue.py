"""A stand-in for Kueue (``kueue.x-k8s.io/v1beta2``, v0.15+) and its batch/v1 Job
integration, so the operator's queueing can be tested against the API emulator.

:data:`KUEUE_CRDS` are our own minimal CRDs (spec and status kept as written);
:class:`KueueController` is one pass of what Kueue's Job reconciler and scheduler do
for Jobs labelled ``kueue.x-k8s.io/queue-name``; :class:`KueueCluster` runs it every
0.2 s on a thread, beside :class:`k8s.kubelet.LocalCluster` or on its own.

- a managed Job gets a Workload ``job-<name>-<hash>`` (owned by the Job; one pod set
  ``main`` of ``min(parallelism, completions)`` pods of its template; priority from the
  WorkloadPriorityClass its ``kueue.x-k8s.io/priority-class`` label names, as
  ``spec.priorityClassRef``/``spec.priority``); a managed Job running without an
  admitted Workload is suspended (Kueue's webhook suspends it at creation; none runs
  here, so create such Jobs suspended);
- admission per ClusterQueue, highest priority first, then oldest (Workloads made in
  the same second by namespace and name; ``StrictFIFO`` stops at the first that does
  not fit, ``BestEffortFIFO``, the default, goes on):
  the first flavor of each resource group whose nominal quota holds the request (a
  request of a resource no group covers never fits); the Job is resumed with the
  flavor's ``nodeLabels`` in its pod template's ``nodeSelector``; a pending Workload
  says why in ``QuotaReserved``, in Kueue's words;
- ``withinClusterQueue: LowerPriority`` preemption: the fewest lower-priority
  Workloads (lowest, then newest first) whose eviction makes room are evicted, their
  Jobs suspended and their node selectors restored; the preemptor is admitted on a
  later pass. An admitted Job suspended by someone else is resumed, as Kueue does:
  ``spec.active: false`` on its Workload is what stops it (evicted, ``Deactivated``);
- a finished Job's Workload is ``Finished`` and frees its quota; usage and counts go
  to the ClusterQueue's status.

A Job annotated ``kueue.x-k8s.io/elastic-job: "true"`` scales through workload slices
(:mod:`k8s.kueue_slices`; ``elastic_slices = False`` plays a Kueue with the feature off).

Not done: cohorts and borrowing, fair sharing, admission checks, topology, partial
admission, ``waitForPodsReady``, LocalQueue status, namespace selectors, flavor
taints/tolerations and node-affinity matching, pod PriorityClasses, LimitRanges, a
Workload remade when its Job's pod set changes.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

from k8s import kueue_slices as slices
from k8s.jobcontroller import condition_true, deleting, lenient, meta
from k8s.kueue_api import (
    API,
    GROUP,
    JOB_UID_LABEL,
    KINDS,
    KUEUE_CRDS,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    VERSION,
    age,
    assign_flavors,
    condition,
    create_object,
    format_quantity,
    install_kueue_crds,
    is_true,
    kueue_served,
    owner_uid,
    parse_quantity,
    pod_requests,
    priority,
    set_conditions,
    spec_of,
    with_condition,
    workload_name,
    workloads_of,
)
from shardwise.operator.kube import ApiError, KubeApi

# fmt: off
__all__ = [
    "API", "GROUP", "JOB_UID_LABEL", "KINDS", "KUEUE_CRDS", "PRIORITY_LABEL", "QUEUE_LABEL",
    "VERSION", "KueueCluster", "KueueController", "condition", "create_object",
    "install_kueue_crds", "is_true", "kueue_served", "workload_name", "workloads_of",
]
# fmt: on


# --------------------------------------------------------------------------- the controller
class KueueController:
    """Kueue's Job reconciler and scheduler for batch/v1 Jobs; :meth:`sync` is one pass
    over what the API lists (see the module docstring)."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube
        self.wls: dict[str, dict[str, Any]] = {}  # uid → Workload, as of this pass
        self.lqs: dict[tuple[str, str], dict[str, Any]] = {}
        self.cqs: dict[str, dict[str, Any]] = {}
        self.rfs: dict[str, dict[str, Any]] = {}
        self.wpcs: dict[str, dict[str, Any]] = {}
        self._order: dict[str, int] = {}  # workload uid → place in the queue (first seen)
        self._admitted: dict[str, int] = {}  # workload uid → when admitted (a counter)
        self._restore: set[str] = set()  # Jobs (uid) whose node selector is to restore
        self.elastic_slices = True  # Kueue's ElasticJobsViaWorkloadSlices feature gate

    # ------------------------------------------------------------------ the pass
    def sync(self) -> None:
        k = self.kube
        jobs = k.list("batch/v1", "jobs")
        self.wls = {meta(w)["uid"]: w for w in k.list(API, "workloads")}
        self.lqs = {(meta(q)["namespace"], meta(q)["name"]): q for q in k.list(API, "localqueues")}
        self.cqs = {meta(q)["name"]: q for q in k.list(API, "clusterqueues")}
        self.rfs = {meta(f)["name"]: f for f in k.list(API, "resourceflavors")}
        self.wpcs = {meta(p)["name"]: p for p in k.list(API, "workloadpriorityclasses")}
        owned = slices.active_of(self.wls.values())
        for job in jobs:
            if QUEUE_LABEL not in (meta(job).get("labels") or {}) or deleting(job):
                continue
            elastic = self.elastic_slices and slices.elastic(job)
            if elastic and not slices.gate_template(self, job):
                continue  # the webhook's gate first
            wl = owned.get(meta(job)["uid"])
            if wl is None:
                self._new_workload(job)
            else:
                if elastic:
                    slices.resize(self, job, wl)
                self._job(job, wl)
                if elastic:
                    slices.ungate(self, job, wl)
        live = {meta(j)["uid"] for j in jobs}
        for uid, wl in list(self.wls.items()):
            if owner_uid(wl) not in (None, *live):  # what the garbage collector does
                self._call(k.delete, API, "workloads", meta(wl)["namespace"], meta(wl)["name"])
                del self.wls[uid]
        for wl in sorted(self.wls.values(), key=age):
            self._order.setdefault(meta(wl)["uid"], len(self._order))
        self._schedule()
        for name, cq in self.cqs.items():
            self._cq_status(name, cq)

    # ------------------------------------------------------------------ the Job side
    def _new_workload(self, job: dict[str, Any], replaces: Mapping[str, Any] | None = None) -> None:
        """A managed Job without a Workload: suspended if it runs, and given one; or an
        elastic Job's new slice, which ``replaces`` its admitted one."""
        m, spec = meta(job), spec_of(job)
        if not spec.get("suspend") and replaces is None:
            self._stop_job(job, None)
        count = slices.job_count(job)
        podset = {"name": "main", "count": count, "template": spec.get("template") or {}}
        wl_spec: dict[str, Any] = {"queueName": m["labels"][QUEUE_LABEL], "podSets": [podset]}
        fields = self._priority_of(job)
        if fields is None:
            return  # its WorkloadPriorityClass does not exist (yet): Kueue retries
        wl_spec.update({k: v for k, v in fields.items() if v is not None})
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": m["name"], "uid": m["uid"],
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        annotations, name = {}, workload_name(m["name"], m["uid"])
        if self.elastic_slices and slices.elastic(job):
            annotations[slices.ELASTIC_ANNOTATION] = "true"
        if replaces is not None:
            annotations[slices.REPLACEMENT_FOR] = slices.slice_key(replaces)
            name = workload_name(m["name"], f"{m['uid']}/{m.get('generation', 1)}")
        body = {
            "apiVersion": API,
            "kind": "Workload",
            "metadata": {
                "name": name,
                "namespace": m["namespace"],
                "labels": {JOB_UID_LABEL: m["uid"]},
                "annotations": annotations,
                "ownerReferences": [owner],
            },
            "spec": wl_spec,
        }
        wl = self._call(create_object, self.kube, body)
        if wl is not None:
            self.wls[meta(wl)["uid"]] = wl

    def _priority_of(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Workload's priority fields for the Job's label; None: no such class."""
        name = (meta(job).get("labels") or {}).get(PRIORITY_LABEL)
        if name is None:
            return {"priorityClassRef": None, "priority": 0}
        if name not in self.wpcs:
            return None
        ref = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": name}
        return {"priorityClassRef": ref, "priority": int(self.wpcs[name].get("value") or 0)}

    def _job(self, job: dict[str, Any], wl: dict[str, Any]) -> None:
        """Keep a Job and its Workload in step: finished, priority, running or not."""
        if is_true(wl, "Finished"):
            return
        if condition_true(job, "Complete") or condition_true(job, "Failed"):
            failed = condition(job, "Failed")
            why = ("Succeeded", "Job finished successfully")
            if failed is not None and failed.get("status") == "True":
                why = ("Failed", str(failed.get("message", "")))
            self._wl_status(wl, {"conditions": with_condition(wl, "Finished", True, *why)})
            return
        fields = self._priority_of(job)
        if fields is not None and any(spec_of(wl).get(k) != v for k, v in fields.items()):
            m = meta(wl)
            args = (API, "workloads", m["namespace"], m["name"], {"spec": fields})
            wl.update(self._call(self.kube.patch, *args) or {})  # the label is mutable
        if spec_of(wl).get("active") is False and is_true(wl, "QuotaReserved"):
            self._evict(wl, "Deactivated", "The workload is deactivated", None)
        elif is_true(wl, "Admitted"):
            self._start_job(job, wl)
        elif not spec_of(job).get("suspend") or meta(job)["uid"] in self._restore:
            self._stop_job(job, wl)

    def _start_job(self, job: dict[str, Any], wl: Mapping[str, Any]) -> None:
        """Resume an admitted Workload's Job, placed on its flavors' nodes."""
        if not spec_of(job).get("suspend"):
            return
        labels: dict[str, str] = {}
        admission = (wl.get("status") or {}).get("admission") or {}
        for psa in admission.get("podSetAssignments") or []:
            for flavor in (psa.get("flavors") or {}).values():
                labels.update(spec_of(self.rfs.get(flavor) or {}).get("nodeLabels") or {})
        spec: dict[str, Any] = {"suspend": False}
        if labels:
            selector = spec_of(spec_of(job).get("template") or {}).get("nodeSelector") or {}
            spec["template"] = {"spec": {"nodeSelector": {**selector, **labels}}}
        m = meta(job)
        self._call(self.kube.patch, "batch/v1", "jobs", m["namespace"], m["name"], {"spec": spec})
        self._restore.discard(m["uid"])

    def _stop_job(self, job: Mapping[str, Any], wl: Mapping[str, Any] | None) -> None:
        """Suspend the Job, clear its start time (so that its template may change), then
        give its pod template back the node selector it had when its Workload was made."""
        m, kube = meta(job), self.kube
        args = ("batch/v1", "jobs", m["namespace"], m["name"])
        if not spec_of(job).get("suspend"):
            self._call(kube.patch, *args, {"spec": {"suspend": True}})
        if (job.get("status") or {}).get("startTime"):
            self._call(kube.patch, *args, {"status": {"startTime": None}}, "status")
        if wl is None:
            return
        podsets = spec_of(wl).get("podSets") or [{}]
        before = spec_of(podsets[0].get("template") or {}).get("nodeSelector") or {}
        current = spec_of(spec_of(job).get("template") or {}).get("nodeSelector") or {}
        self._restore.add(m["uid"])
        if current != before:
            selector = {**dict.fromkeys(current), **before} if before else None
            patch = {"spec": {"template": {"spec": {"nodeSelector": selector}}}}
            try:  # refused while the Job controller has not yet seen it suspended
                if self._call(kube.patch, *args, patch) is None:
                    return
            except ApiError as err:
                if err.status != 422:
                    raise
                return  # the next pass tries again
        self._restore.discard(m["uid"])

    # ------------------------------------------------------------------ the scheduler
    def _schedule(self) -> None:
        queues: dict[str, list[dict[str, Any]]] = {}
        for wl in self.wls.values():
            if is_true(wl, "Finished") or is_true(wl, "QuotaReserved"):
                continue
            lq_name = str(spec_of(wl).get("queueName", ""))
            lq = self.lqs.get((meta(wl)["namespace"], lq_name))
            cq_name = str(spec_of(lq or {}).get("clusterQueue", ""))
            if lq is None:
                self._pending(wl, "Inadmissible", f"LocalQueue {lq_name} doesn't exist")
            elif cq_name not in self.cqs:
                self._pending(wl, "Inadmissible", f"ClusterQueue {cq_name} doesn't exist")
            elif self._missing_flavors(self.cqs[cq_name]):
                self._pending(wl, "Inadmissible", f"ClusterQueue {cq_name} is inactive")
            elif spec_of(wl).get("active") is not False:
                queues.setdefault(cq_name, []).append(wl)
        for cq_name, queue in queues.items():
            queue.sort(key=lambda w: (-priority(w), self._order[meta(w)["uid"]]))
            strict = spec_of(self.cqs[cq_name]).get("queueingStrategy") == "StrictFIFO"
            for wl in queue:
                outcome = self._try_admit(cq_name, wl)
                if outcome == "preempting" or (outcome == "pending" and strict):
                    break  # what is freed is the preemptor's; StrictFIFO waits for the head

    def _holding(self, cq_name: str) -> list[dict[str, Any]]:
        """The Workloads that hold quota in the ClusterQueue."""
        return [
            w
            for w in self.wls.values()
            if is_true(w, "QuotaReserved")
            and not is_true(w, "Finished")
            and ((w.get("status") or {}).get("admission") or {}).get("clusterQueue") == cq_name
        ]

    def _usage(self, cq_name: str, skip: Iterable[str] = ()) -> dict[tuple[str, str], int]:
        """(flavor, resource) → what the Workloads holding quota use (but ``skip``'s)."""
        out: dict[tuple[str, str], int] = {}
        for wl in self._holding(cq_name):
            if meta(wl)["uid"] in skip:
                continue
            for psa in wl["status"]["admission"].get("podSetAssignments") or []:
                for res, flavor in (psa.get("flavors") or {}).items():
                    used = parse_quantity((psa.get("resourceUsage") or {}).get(res, 0), res)
                    out[(flavor, res)] = out.get((flavor, res), 0) + used
        return out

    def _try_admit(self, cq_name: str, wl: dict[str, Any]) -> str:
        """Admit ``wl`` if it fits, else preempt for it if it may: "admitted",
        "preempting" or "pending"."""
        podset = (spec_of(wl).get("podSets") or [{}])[0]
        count = int(podset.get("count", 1))
        need = {r: v * count for r, v in pod_requests(podset.get("template") or {}).items() if v}
        old = slices.replaced(self, wl)  # a new slice: the one it replaces counts as free
        usage = self._usage(cq_name, skip=[meta(old)["uid"]] if old else [])
        mode, flavors, reasons = assign_flavors(self.cqs[cq_name], need, usage)
        if mode == "fit":
            self._admit(cq_name, wl, count, need, flavors)
            return "admitted"
        message = "couldn't assign flavors to pod set main: " + ", ".join(reasons)
        preemption = spec_of(self.cqs[cq_name]).get("preemption") or {}
        victims = []
        if mode == "preempt" and preemption.get("withinClusterQueue") == "LowerPriority":
            victims = self._victims(cq_name, wl, need)
        for victim in victims:
            job_uid = (meta(wl).get("labels") or {}).get(JOB_UID_LABEL, "UNKNOWN")
            why = (
                f"Preempted to accommodate a workload (UID: {meta(wl)['uid']}, JobUID: "
                f"{job_uid}) due to prioritization in the ClusterQueue; preemptor path: "
                f"/{cq_name}; preemptee path: /{cq_name}"
            )
            self._evict(victim, "Preempted", why, "InClusterQueue")
        if victims:
            message += f". Pending the preemption of {len(victims)} workload(s)"
        self._pending(wl, "Pending", message)
        return "preempting" if victims else "pending"

    def _victims(
        self, cq_name: str, wl: Mapping[str, Any], need: Mapping[str, int]
    ) -> list[dict[str, Any]]:
        """The fewest lower-priority Workloads whose eviction lets ``wl`` fit, taken
        lowest priority and newest first (Kueue's classical preemption in a queue)."""
        found = [w for w in self._holding(cq_name) if priority(w) < priority(wl)]
        found.sort(key=lambda w: (priority(w), -self._admitted.get(meta(w)["uid"], 0)))

        def fits(out: list[dict[str, Any]]) -> bool:
            usage = self._usage(cq_name, skip=[meta(w)["uid"] for w in out])
            return assign_flavors(self.cqs[cq_name], need, usage)[0] == "fit"

        targets: list[dict[str, Any]] = []
        for victim in found:
            targets.append(victim)
            if fits(targets):
                for back in reversed(targets[:-1]):  # keep those that need not go
                    if fits([t for t in targets if t is not back]):
                        targets.remove(back)
                return targets
        return []

    # ------------------------------------------------------------------ writes
    def _admit(
        self,
        cq_name: str,
        wl: dict[str, Any],
        count: int,
        need: Mapping[str, int],
        flavors: Mapping[str, str],
    ) -> None:
        """Reserve the quota and admit (no admission checks), then resume the Job."""
        usage = {r: format_quantity(v, r) for r, v in need.items()}
        psa = {"name": "main", "flavors": dict(flavors), "resourceUsage": usage, "count": count}
        sets = [
            ("QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {cq_name}"),
            ("Admitted", True, "Admitted", "The workload is admitted"),
        ]
        for type_ in ("Evicted", "Preempted"):
            if is_true(wl, type_):
                old = str((condition(wl, type_) or {}).get("message", ""))
                sets.append((type_, False, "QuotaReserved", f"Previously: {old}"))
        admission = {"clusterQueue": cq_name, "podSetAssignments": [psa]}
        status = {"admission": admission, "conditions": set_conditions(wl, *sets)}
        if not self._wl_status(wl, status):
            return
        self._admitted[meta(wl)["uid"]] = len(self._admitted) + 1
        slices.finish_replaced(self, wl)
        job = self._job_of(wl)
        if job is not None:
            self._start_job(job, wl)

    def _evict(self, wl: dict[str, Any], reason: str, message: str, preempted: str | None) -> None:
        """Evicted (and Preempted), the Job stopped, then the quota given back."""
        sets = [("Evicted", True, reason, message)]
        if preempted:
            sets.append(("Preempted", True, preempted, message))
        self._wl_status(wl, {"conditions": set_conditions(wl, *sets)})
        job = self._job_of(wl)
        if job is not None:
            self._stop_job(job, wl)
        sets = [("QuotaReserved", False, "Pending", message)]
        if condition(wl, "Admitted") is not None:
            sets.append(("Admitted", False, "NoReservation", "The workload has no reservation"))
        self._wl_status(wl, {"conditions": set_conditions(wl, *sets), "admission": None})

    def _job_of(self, wl: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Job that owns the Workload (None for a Workload made on its own)."""
        ref = next(
            (r for r in meta(wl).get("ownerReferences") or [] if r.get("kind") == "Job"), None
        )
        if ref is None:
            return None
        job: dict[str, Any] | None = self._call(
            self.kube.get, "batch/v1", "jobs", meta(wl)["namespace"], ref["name"]
        )
        return job

    def _pending(self, wl: dict[str, Any], reason: str, message: str) -> None:
        conds = with_condition(wl, "QuotaReserved", False, reason, message)
        if conds != (wl.get("status") or {}).get("conditions"):
            self._wl_status(wl, {"conditions": conds})

    def _wl_status(self, wl: dict[str, Any], status: dict[str, Any]) -> bool:
        """Write the Workload's status; ``wl`` (in :attr:`wls`) follows. False: it is gone."""
        m = meta(wl)
        args = (API, "workloads", m["namespace"], m["name"], {"status": status}, "status")
        new = self._call(self.kube.patch, *args)
        if new is None:
            return False
        wl.clear()
        wl.update(new)
        return True

    def _missing_flavors(self, cq: Mapping[str, Any]) -> list[str]:
        groups = spec_of(cq).get("resourceGroups") or []
        return sorted({f["name"] for g in groups for f in g.get("flavors") or []} - set(self.rfs))

    def _cq_status(self, name: str, cq: Mapping[str, Any]) -> None:
        """Usage by flavor, the counts and ``Active``, written when they change."""
        usage, flavors = self._usage(name), []
        for group in spec_of(cq).get("resourceGroups") or []:
            for f in group.get("flavors") or []:
                totals = [
                    {"name": r, "total": format_quantity(usage.get((f["name"], r), 0), r),
                     "borrowed": "0"}
                    for r in group.get("coveredResources") or []
                ]  # fmt: skip
                flavors.append({"name": f["name"], "resources": totals})
        holding = len(self._holding(name))
        pending = 0
        for w in self.wls.values():
            lq = self.lqs.get((meta(w)["namespace"], str(spec_of(w).get("queueName", ""))))
            if spec_of(lq or {}).get("clusterQueue") == name:
                pending += not is_true(w, "QuotaReserved") and not is_true(w, "Finished")
        missing = self._missing_flavors(cq)
        active = (True, "Ready", "Can admit new workloads")
        if missing:
            why = f"Can't admit new workloads: references missing ResourceFlavor(s): {missing}"
            active = (False, "FlavorNotFound", why)
        status = {
            "flavorsReservation": flavors,
            "flavorsUsage": flavors,
            "pendingWorkloads": pending,
            "reservingWorkloads": holding,
            "admittedWorkloads": holding,
            "conditions": with_condition(cq, "Active", *active),
        }
        old = cq.get("status") or {}
        if any(old.get(k) != v for k, v in status.items()):
            args = (API, "clusterqueues", None, name, {"status": status}, "status")
            self._call(self.kube.patch, *args)

    _call = staticmethod(lenient)


class KueueCluster:
    """:class:`KueueController` every ``interval`` seconds on a background thread (its
    CRDs installed first); errors are kept in :attr:`errors` and the loop goes on."""

    def __init__(self, url: str, *, interval: float = 0.2) -> None:
        self.kube = KubeApi.for_host(url)
        self.controller = KueueController(self.kube)
        self.interval = interval
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kueue", daemon=True)

    def start(self) -> KueueCluster:
        install_kueue_crds(self.kube)
        self._thread.start()
        return self

    def tick(self) -> None:
        self.controller.sync()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # kept for the test to see; the loop goes on
                self.errors.append(traceback.format_exc())
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.kube.close()
