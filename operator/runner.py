"""One DLRMJob's reconcile loop: observe, :func:`~shardwise.operator.reconcile.decide`,
apply, plan, write status.

Reads come from kopf's in-memory indexes (watch streams, no API calls), overlaid with
what this loop itself just created or deleted (the index learns of it a moment
later), so a reconcile right after a create does not create again. Writes go through
:class:`~shardwise.operator.kube.KubeApi` in threads. A create answered 409 adopts the
existing object when it is ours (same owner) or unowned with our labels; that is how a
restarted operator, or a retry after a conflict, converges without duplicates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shardwise.operator import constants as c
from shardwise.operator.capacity import GpuPod, NodeInfo, gpu_usage
from shardwise.operator.config import OperatorConfig
from shardwise.operator.costmodels import CostModelInfo, newest
from shardwise.operator.crd import DLRMJobSpec, SpecError, inline_tables, parse_spec
from shardwise.operator.kube import PLURALS, ApiError, KubeApi
from shardwise.operator.lifecycle import EventSpec, build_status, transition_events
from shardwise.operator.metrics import PROFILING_FAILURE_REASONS, OperatorMetrics
from shardwise.operator.observe import (
    ChildRef,
    JobState,
    PodFailure,
    child_ref,
    first_failure,
    format_time,
    job_state,
    plan_record,
)
from shardwise.operator.planning import PlanExecutor, make_request, plan_summary
from shardwise.operator.reconcile import Decision, Observed, PlanFailure, PlanNeeded, decide
from shardwise.operator.render import JobMeta, owner_reference, plan_configmap
from shardwise.operator.startup import (
    PodState,
    StartupProblem,
    events_selector,
    failed_create,
    needs_events_check,
)
from shardwise.operator.wakeups import Wakeups
from shardwise.planner.errors import UserError
from shardwise.planner.tables import TableSpec, format_of, parse_tables
from shardwise.profiler.publish import read_members, unpack_archive

logger = logging.getLogger("shardwise.operator")
T = TypeVar("T")
Index = Mapping[Any, Iterable[Any]]
#: How long this loop trusts its own record of a create over the index's silence.
OVERLAY_SECONDS = 60.0


@dataclass
class OperatorContext:
    """What every job loop shares."""

    kube: KubeApi
    planner: PlanExecutor
    config: OperatorConfig = field(default_factory=OperatorConfig)
    wakeups: Wakeups = field(default_factory=Wakeups)
    #: Emits an Event (kopf.event in the operator; a list in unit tests).
    emit: Callable[[Mapping[str, Any], EventSpec], None] = lambda body, ev: None
    #: Node summaries last seen, to wake jobs only when capacity really changed.
    nodes_seen: dict[str, NodeInfo] = field(default_factory=dict)
    #: Pods holding GPUs last seen, to wake jobs only when GPU usage really changed.
    gpu_pods_seen: dict[str, GpuPod] = field(default_factory=dict)
    #: What each of our pods last showed (started, problem, deleting), to wake its
    #: job only when that changes.
    pods_seen: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: Prometheus series (served on --metrics-port by operator.main).
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)


@dataclass(frozen=True)
class Indexes:
    """The kopf indexes (``sw_*`` handler ids in :mod:`shardwise.operator.handlers`)."""

    jobs: Index
    plans: Index
    services: Index
    models: Index
    nodes: Index
    #: Bound pods holding GPUs, by node: capacity other workloads already use.
    gpu_pods: Index = field(default_factory=dict)
    #: Our own pods (:class:`~shardwise.operator.startup.PodState`), by job.
    pods: Index = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Indexes:
        return cls(
            kwargs["sw_jobs"],
            kwargs["sw_plans"],
            kwargs["sw_services"],
            kwargs["sw_models"],
            kwargs["sw_nodes"],
            kwargs.get("sw_gpu_pods", {}),
            kwargs.get("sw_pods", {}),
        )


def _ref_of(x: Any) -> ChildRef:
    ref: ChildRef = x if isinstance(x, ChildRef) else x.ref
    return ref


def _as_deleting(x: Any) -> Any:
    if isinstance(x, ChildRef):
        return dataclasses.replace(x, deleting=True)
    return dataclasses.replace(x, ref=dataclasses.replace(x.ref, deleting=True))


def _values(index: Index, key: Any) -> list[Any]:
    store = index.get(key)
    return list(store) if store is not None else []


def merge_patch_between(old: Any, new: Any) -> Any:
    """The RFC 7386 patch that turns ``old`` into ``new`` (``None`` deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch_between(old[key], value)
    return patch


class JobRunner:
    """The state one job's loop keeps between reconciles (all of it recoverable)."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        #: (kind, name) → (summary, when) of what this loop created, until the index
        #: shows that very object (same uid), or for OVERLAY_SECONDS at most.
        self.created: dict[tuple[str, str], tuple[Any, float]] = {}
        #: (kind, name) → uid this loop deleted, until the index drops it.
        self.deleted: dict[tuple[str, str], str] = {}
        self.plan_failures: dict[str, PlanFailure] = {}
        self.pod_failures: dict[str, PodFailure | None] = {}  # Job uid → first failing pod
        #: Job uid → (its FailedCreate or None, when the Events were read; monotonic).
        self.event_checks: dict[str, tuple[StartupProblem | None, float]] = {}
        #: Seconds until a Job without pods is due for an Events read (None: none is).
        self.next_check: float | None = None
        self.last_status: dict[str, Any] | None = None
        self._spec_key: tuple[str, int] | None = None
        self._spec: tuple[DLRMJobSpec | None, list[str]] = (None, [])

    # ------------------------------------------------------------------ observing
    def _parse(self, body: Mapping[str, Any]) -> tuple[DLRMJobSpec | None, list[str]]:
        meta = body.get("metadata") or {}
        key = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
        if key != self._spec_key:
            try:
                self._spec = (parse_spec(body.get("spec"), self.ctx.config.gpu_resource), [])
            except SpecError as err:
                self._spec = (None, err.problems)
            self._spec_key = key
        return self._spec

    def _children(self, kind: str, indexed: list[T], ref: Callable[[T], ChildRef]) -> list[T]:
        """The index's view, corrected by this loop's own recent creates and deletes:
        a created object shows before its watch event arrives, a deleted one shows as
        deleting until the index drops it."""
        seen = {(ref(x).name, ref(x).uid) for x in indexed}
        now = time.monotonic()
        for key, (summary, when) in list(self.created.items()):
            mine = _ref_of(summary)
            if key[0] == kind and ((mine.name, mine.uid) in seen or now - when > OVERLAY_SECONDS):
                del self.created[key]
        for key, uid in list(self.deleted.items()):
            if key[0] == kind and (key[1], uid) not in seen:
                del self.deleted[key]
        overlay = {k[1]: v for k, (v, _) in self.created.items() if k[0] == kind}
        out = [
            _as_deleting(x) if self.deleted.get((kind, ref(x).name)) == ref(x).uid else x
            for x in indexed
            if ref(x).name not in overlay or ref(x).deleting or ref(x).uid in self.deleted.values()
        ]
        # Live objects first: a replacement shows before the one it replaces.
        return sorted([*out, *overlay.values()], key=lambda x: _ref_of(x).deleting)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def _first_pod_failure(
        self, job: JobState, component: str, extra: Mapping[str, str]
    ) -> PodFailure | None:
        if job.ref.uid not in self.pod_failures:
            selector = ",".join(
                f"{k}={v}"
                for k, v in {c.LABEL_JOB: self.name, c.LABEL_COMPONENT: component, **extra}.items()
            )
            pods = await self._call(self.ctx.kube.list, "v1", "pods", self.namespace, selector)
            self.pod_failures[job.ref.uid] = first_failure(pods)
        return self.pod_failures[job.ref.uid]

    async def _failed_creates(
        self, jobs: list[JobState], pods: list[PodState], now: datetime.datetime
    ) -> dict[str, StartupProblem]:
        """The FailedCreate of each running Job that has no pods (see
        :mod:`shardwise.operator.startup`): read once it is ``failed_create_grace_seconds``
        old, then every ``pod_check_seconds``; ``next_check`` says when one is due."""
        cfg, found, waits = self.ctx.config, {}, []
        mono, live = time.monotonic(), set()
        for job in jobs:
            due = needs_events_check(job, pods, cfg.failed_create_grace_seconds)
            if due is None:
                continue
            live.add(job.ref.uid)
            if due > now:
                waits.append((due - now).total_seconds())
                continue
            problem, checked = self.event_checks.get(job.ref.uid, (None, -math.inf))
            if mono - checked >= cfg.pod_check_seconds:
                try:
                    events = await self._call(
                        self.ctx.kube.list, "v1", "events", self.namespace, None,
                        events_selector(job),
                    )  # fmt: skip
                except ApiError as err:
                    if err.status != 403:
                        raise
                    # RBAC without `list events` (an older role): the job still runs,
                    # only a Job's refused pods go unreported
                    logger.warning("cannot read Events in %s: %s", self.namespace, err)
                    events = []
                problem, checked = failed_create(events), mono
                self.event_checks[job.ref.uid] = (problem, checked)
            waits.append(checked + cfg.pod_check_seconds - mono)
            if problem is not None:
                found[job.ref.name] = problem
        for uid in set(self.event_checks) - live:
            del self.event_checks[uid]
        self.next_check = max(0.0, min(waits)) if waits else None
        return found

    async def observe(
        self, body: Mapping[str, Any], idx: Indexes, now: datetime.datetime
    ) -> Observed:
        meta = body.get("metadata") or {}
        job = JobMeta(
            self.name, self.namespace, str(meta.get("uid", "")), int(meta.get("generation") or 1)
        )
        spec, problems = self._parse(body)
        key = (self.namespace, self.name)
        jobs = self._children("Job", _values(idx.jobs, key), lambda j: j.ref)
        ours = [j for j in jobs if job.uid in j.ref.owner_uids or not j.ref.owner_uids]
        workers = [j for j in ours if j.ref.labels.get(c.LABEL_COMPONENT) == c.COMPONENT_WORKER]
        profilers = [j for j in ours if j.ref.labels.get(c.LABEL_COMPONENT) == c.COMPONENT_PROFILER]
        plans = [
            p
            for p in self._children("ConfigMap", _values(idx.plans, key), lambda p: p.ref)
            if job.uid in p.ref.owner_uids or not p.ref.owner_uids
        ]
        services = [
            s
            for s in self._children("Service", _values(idx.services, key), lambda s: s)
            if job.uid in s.owner_uids or not s.owner_uids
        ]
        worker = workers[0] if workers else None
        worker_failure = None
        if worker is not None and worker.failure is not None:
            found_failure = await self._first_pod_failure(worker, c.COMPONENT_WORKER, {})
            worker_failure = found_failure.describe() if found_failure else None
        pods: list[PodState] = _values(idx.pods, key)
        failed_creates = await self._failed_creates([*profilers, *workers[:1]], pods, now)
        profiling_failures = {}
        for pj in profilers:
            if pj.failure is not None:
                extra = {c.LABEL_ATTEMPT: pj.ref.labels.get(c.LABEL_ATTEMPT, "")}
                found = await self._first_pod_failure(pj, c.COMPONENT_PROFILER, extra)
                if found:
                    profiling_failures[pj.ref.name] = found
        models: dict[str, CostModelInfo] = {}
        for (ns, gpu), store in idx.models.items():
            if ns == self.namespace:
                best = newest(list(store))
                if best is not None:
                    models[gpu] = best
        nodes = [n for store in idx.nodes.values() for n in store]
        held = [p for store in idx.gpu_pods.values() for p in store]
        return Observed(
            gpu_usage=gpu_usage(held, self.namespace, self.name, c.COMPONENT_WORKER),
            job=job,
            spec=spec,
            spec_problems=problems,
            nodes=nodes,
            models=models,
            profiling_jobs=profilers,
            plans=plans,
            worker_job=worker,
            service=services[0] if services else None,
            now=now,
            config=self.ctx.config,
            plan_failures=dict(self.plan_failures),
            worker_failure=worker_failure,
            profiling_pod_failures=profiling_failures,
            pods=pods,
            failed_creates=failed_creates,
            resharding=(
                self.last_status if self.last_status is not None else body.get("status") or {}
            ).get("resharding"),
        )

    # ------------------------------------------------------------------ acting
    def _remember(self, obj: Mapping[str, Any]) -> None:
        kind = str(obj.get("kind", ""))
        summary: Any = child_ref(obj)
        if kind == "Job":
            summary = job_state(obj)
        elif kind == "ConfigMap":
            summary = plan_record(obj)
        self.created[(kind, _ref_of(summary).name)] = (summary, time.monotonic())

    async def create(self, job: JobMeta, body: dict[str, Any]) -> None:
        """Create, or adopt what is already there under that name (see module docstring)."""
        kube = self.ctx.kube
        kind, meta = str(body["kind"]), body["metadata"]
        try:
            obj = await self._call(kube.create, body)
        except ApiError as err:
            if err.status != 409:
                raise
            existing = await self._call(
                kube.get, body["apiVersion"], PLURALS[kind], meta["namespace"], meta["name"]
            )
            if existing is None:
                return  # gone again: the next reconcile decides anew
            obj = await self._adopt(job, body, existing)
        else:
            labels = meta.get("labels") or {}
            if kind == "Job" and labels.get(c.LABEL_COMPONENT) == c.COMPONENT_PROFILER:
                gpu = str(labels.get(c.LABEL_GPU_TYPE, ""))
                self.ctx.metrics.observe_profiling_run(self.namespace, gpu)
        self._remember(obj)

    async def _adopt(
        self, job: JobMeta, body: dict[str, Any], existing: dict[str, Any]
    ) -> dict[str, Any]:
        kube, meta = self.ctx.kube, existing.get("metadata") or {}
        refs = meta.get("ownerReferences") or []
        ours = any(r.get("uid") == job.uid for r in refs)
        labels = meta.get("labels") or {}
        if not ours and (
            any(r.get("controller") for r in refs) or labels.get(c.LABEL_JOB) != job.name
        ):
            raise ApiError(
                409,
                "Conflict",
                f"{body['kind']} {meta.get('name')} exists and is not this DLRMJob's "
                "(another owner, or not labelled for it); delete or rename it",
            )
        patch: dict[str, Any] = {}
        if not ours:
            patch["ownerReferences"] = [*refs, *body["metadata"]["ownerReferences"]]
        wanted = body["metadata"].get("annotations") or {}
        have = meta.get("annotations") or {}
        if body["kind"] == "ConfigMap" and any(have.get(k) != v for k, v in wanted.items()):
            patch["annotations"] = wanted  # the same plan, reached from other inputs
        if not patch:
            return existing
        logger.info("adopting %s %s/%s", body["kind"], job.namespace, meta.get("name"))
        return await self._call(
            kube.patch,
            body["apiVersion"],
            PLURALS[body["kind"]],
            job.namespace,
            meta["name"],
            {"metadata": patch},
        )

    async def apply(self, job: JobMeta, decision: Decision) -> None:
        kube = self.ctx.kube
        for what in decision.stopped:
            logger.info("%s/%s: stopping profiling attempt %s", job.namespace, job.name, what)
        for body in decision.creates:
            await self.create(job, body)
        for ref, patch in decision.patches:
            try:
                obj = await self._call(
                    kube.patch, ref.api_version, PLURALS[ref.kind], job.namespace, ref.name, patch
                )
            except ApiError as err:
                if err.status != 404:
                    raise
            else:
                if ref.kind == "Job":
                    self._remember(obj)
        for pod in decision.force_deletes:
            logger.warning("%s/%s: %s", job.namespace, job.name, pod.message)
            await self._call(kube.delete, "v1", "pods", job.namespace, pod.pod, "Background", 0)
        for ref in decision.deletes:
            # Foreground for Jobs: the Job stays until its pods are gone, so a replacement
            # never runs beside the workers it replaces.
            policy = "Foreground" if ref.kind == "Job" else "Background"
            await self._call(
                kube.delete, ref.api_version, PLURALS[ref.kind], job.namespace, ref.name, policy
            )
            created = self.created.pop((ref.kind, ref.name), None)
            if created is not None:
                self.created[(ref.kind, ref.name)] = (_as_deleting(created[0]), created[1])
            self.deleted[(ref.kind, ref.name)] = ref.uid

    async def adopt_orphans(self, job: JobMeta, observed: Observed) -> None:
        """Children with our labels but no owner (restored, or orphaned by hand) get us
        as their owner, so that deleting the DLRMJob deletes them too."""
        refs = [p.ref for p in observed.plans] + [j.ref for j in observed.profiling_jobs]
        refs += [x.ref for x in (observed.worker_job,) if x is not None]
        refs += [s for s in (observed.service,) if s is not None]
        api = {"Job": "batch/v1", "ConfigMap": "v1", "Service": "v1"}
        for ref in refs:
            if ref.owner_uids or ref.deleting or ref.kind not in api:
                continue
            body = {
                "kind": ref.kind,
                "apiVersion": api[ref.kind],
                "metadata": {"ownerReferences": [owner_reference(job)]},
            }
            existing = await self._call(
                self.ctx.kube.get, api[ref.kind], PLURALS[ref.kind], job.namespace, ref.name
            )
            if existing is not None:
                self._remember(await self._adopt(job, body, existing))

    # ------------------------------------------------------------------ planning
    async def _tables(self, spec: DLRMJobSpec) -> list[TableSpec]:
        if spec.tables.inline is not None:
            return inline_tables(spec)
        ref = spec.tables.config_map_ref
        assert ref is not None
        cm = await self._call(self.ctx.kube.get, "v1", "configmaps", self.namespace, ref.name)
        where = f"spec.tables.configMapRef: ConfigMap {self.namespace}/{ref.name}"
        if cm is None:
            raise LookupError(f"{where} does not exist")
        text = (cm.get("data") or {}).get(ref.key)
        if text is None:
            raise LookupError(f"{where} has no key {ref.key!r}")
        from pathlib import Path

        return parse_tables(text, format_of(Path(ref.key)), f"{where} key {ref.key}")

    async def _model(
        self, model: CostModelInfo | None
    ) -> tuple[tuple[bytes, str] | None, str | None]:
        """The published model's file bytes (and sha), or ``None`` and why not."""
        if model is None:
            return None, None
        selector = (
            f"{c.LABEL_COMPONENT}={c.COMPONENT_COSTMODEL},{c.LABEL_GPU_TYPE}={model.gpu_type}"
        )
        try:
            cms = await self._call(self.ctx.kube.list, "v1", "configmaps", self.namespace, selector)
            members = read_members(unpack_archive(cms, model.payload))
            data = next(v for k, v in sorted(members.items()) if k.endswith(".pt"))
        except (UserError, StopIteration) as err:
            why = str(err) or "no .pt file in the archive"
            return (
                None,
                f"the published model {model.payload} is unreadable ({why}); "
                "planned with the bundled CPU model",
            )
        return (data, model.sha256), None

    async def plan(
        self, job: JobMeta, spec: DLRMJobSpec, need: PlanNeeded, now: datetime.datetime
    ) -> None:
        ih = need.inputs.hash()
        retry = now + datetime.timedelta(seconds=self.ctx.config.tables_retry_seconds)
        try:
            tables = await self._tables(spec)
        except LookupError as err:
            self.plan_failures[ih] = PlanFailure("TablesNotFound", str(err), retry)
            return
        except UserError as err:
            self.plan_failures[ih] = PlanFailure("InvalidTables", str(err), retry)
            return
        model, unreadable = await self._model(need.model)
        try:
            result = await self.ctx.planner.run(make_request(need.inputs, tables, model))
        except Exception as err:  # a crashed planner process: retried with backoff
            logger.exception("planning %s/%s failed", self.namespace, self.name)
            backoff = now + datetime.timedelta(seconds=self.ctx.config.max_error_backoff_seconds)
            self.plan_failures[ih] = PlanFailure(
                "PlanningError", f"the planner crashed: {err!r}", backoff
            )
            return
        if result.error is not None:
            self.plan_failures[ih] = PlanFailure("Infeasible", result.error)
            return
        plan = result.plan()
        used = need.model if model is not None else None
        summary_model: dict[str, Any] = {
            "gpuType": need.inputs.gpu_type,
            "source": "Published" if used else "Bundled",
        }
        if used is not None:
            summary_model.update(configMap=used.payload, fingerprint=used.fingerprint)
            if used.published_at:
                summary_model["publishedAt"] = format_time(used.published_at)
        degraded = "; ".join(x for x in (need.degraded, unreadable) if x)
        if degraded:
            summary_model["degraded"] = degraded
        if need.degraded:
            summary_model["degradedReason"] = need.degraded_reason
        summary = plan_summary(plan, need.inputs, result, summary_model)
        try:
            await self.create(job, plan_configmap(job, plan, tables, ih, summary))
        except ApiError as err:
            if err.status != 422:
                raise
            # e.g. more than 1 MiB of plan and tables: the same inputs would fail again
            why = f"the API server refused the plan ConfigMap: {err.message}"
            self.plan_failures[ih] = PlanFailure("PlanningError", why)
            return
        logger.info(
            "planned %s/%s: %s in %.2f s", self.namespace, self.name, plan.hash[:8], result.seconds
        )
        if plan.predicted is not None:
            self.ctx.metrics.observe_plan(
                self.namespace,
                self.name,
                plan.predicted.per_rank_seconds,
                plan.predicted.imbalance,
                planning_seconds=result.seconds,
            )

    def _observe_reshard(self, rec: Any, now: datetime.datetime) -> None:
        """The one metrics call site of issue 8: a reshard finished (the new worker Job
        is created); its time runs from the start of the reshard (debounce excluded)."""
        seconds = (now - rec.started_at).total_seconds() if rec.started_at else 0.0
        logger.info(
            "resharded %s/%s %s in %.3f s", self.namespace, self.name, rec.describe(), seconds
        )
        # Issue 9's OperatorMetrics: the counter by reason, and the time-to-reshard
        # histogram once observe_reshard takes ``seconds``.
        observe = getattr(getattr(self.ctx, "metrics", None), "observe_reshard", None)
        if observe is not None:
            if "seconds" in inspect.signature(observe).parameters:
                observe(self.namespace, self.name, rec.reason, seconds)
            else:
                observe(self.namespace, self.name, rec.reason)

    # ------------------------------------------------------------------ status
    async def write_status(
        self, body: Mapping[str, Any], job: JobMeta, decision: Decision, now: datetime.datetime
    ) -> None:
        current = dict(body.get("status") or {})
        before = self.last_status if self.last_status is not None else current
        status = build_status(before, decision.conditions, job.generation, now, decision.fields)
        # every pass, written or not: a restarted operator and the model's age stay current
        self.ctx.metrics.observe_status(self.namespace, self.name, status, now)
        if status == before:
            return
        events = transition_events(before, status)
        patch = {"status": merge_patch_between(current, status)}
        try:
            await self._call(
                self.ctx.kube.patch,
                c.API_VERSION,
                c.PLURAL,
                self.namespace,
                self.name,
                patch,
                "status",
            )
        except ApiError as err:
            if err.status == 404:
                return
            raise
        self.last_status = status
        gpu = str((status.get("costModel") or {}).get("gpuType", ""))
        for ev in events:
            self.ctx.emit(body, ev)
            if ev.reason in PROFILING_FAILURE_REASONS:
                self.ctx.metrics.observe_profiling_failure(self.namespace, gpu)

    # ------------------------------------------------------------------ one pass
    async def reconcile(self, body: Mapping[str, Any], idx: Indexes) -> float | None:
        """One pass; returns seconds until a pass is due anyway (``0``: at once)."""
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return None  # the garbage collector removes the children
        now = datetime.datetime.now(datetime.UTC)
        observed = await self.observe(body, idx, now)
        await self.adopt_orphans(observed.job, observed)
        decision = decide(observed)
        await self.apply(observed.job, decision)
        for pod in decision.force_deletes:
            self.ctx.emit(body, EventSpec("Warning", "PodForceDeleted", pod.message))
        if decision.resharded is not None:
            self._observe_reshard(decision.resharded, now)
        if decision.plan is not None and observed.spec is not None:
            await self.write_status(body, observed.job, decision, now)
            await self.plan(observed.job, observed.spec, decision.plan, now)
            return 0.0
        await self.write_status(body, observed.job, decision, now)
        waits = [w for w in (decision.requeue_after, self.next_check) if w is not None]
        return min(waits) if waits else None


class Stopped(Protocol):
    """kopf's ``stopped`` flag of a daemon: truthy once set, ``await wait()`` until then."""

    def __bool__(self) -> bool: ...

    def wait(self) -> Awaitable[Any]: ...


async def _until(aw: Awaitable[Any]) -> None:
    await aw


async def run_job(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    namespace: str,
    name: str,
    idx: Indexes,
    stopped: Stopped | None = None,
) -> None:
    """The daemon body: reconcile whenever woken, on requeue, or every resync period,
    until kopf sets ``stopped`` (the job is deleted, or the operator exits)."""
    runner = JobRunner(ctx, namespace, name)
    event = ctx.wakeups.register(namespace, name)
    cfg = ctx.config
    backoff = cfg.error_backoff_seconds
    try:
        while not stopped:
            event.clear()
            try:
                wait = await runner.reconcile(body, idx)
                backoff = cfg.error_backoff_seconds
            except asyncio.CancelledError:
                raise
            except Exception as err:
                level = logging.WARNING if isinstance(err, ApiError | OSError) else logging.ERROR
                logger.log(
                    level,
                    "reconciling %s/%s failed: %s",
                    namespace,
                    name,
                    err,
                    exc_info=level == logging.ERROR,
                )
                wait, backoff = backoff, min(backoff * 2, cfg.max_error_backoff_seconds)
                ctx.metrics.observe_reconcile_error(namespace, name)
            if wait == 0:
                continue
            timeout = cfg.resync_seconds if wait is None else min(wait, cfg.resync_seconds)
            waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(event.wait())}
            if stopped is not None:
                waiters.add(asyncio.ensure_future(_until(stopped.wait())))
            _, pending = await asyncio.wait(
                waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
    finally:
        ctx.wakeups.unregister(namespace, name)
        ctx.metrics.forget_job(namespace, name)
