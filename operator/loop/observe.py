"""Observing one job: its :class:`~shardwise.operator.decide.records.Observed`, built from
kopf's in-memory indexes (watch streams, no API calls) overlaid with the loop's own
creates and deletes (:mod:`~shardwise.operator.loop.overlay`); the few reads the indexes
cannot answer (the first failing pod of a failed Job, the FailedCreate Events of a Job
without pods) go to the API server, each once."""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from shardwise import names
from shardwise.operator.cluster.capacity import gpu_usage
from shardwise.operator.cluster.quota import Quota, quota_of
from shardwise.operator.cluster.startup import (
    PodState,
    StartupProblem,
    events_selector,
    failed_create,
    needs_events_check,
)
from shardwise.operator.cluster.summaries import JobState, PodFailure, first_failure
from shardwise.operator.cluster.workloads import active_workload
from shardwise.operator.context import Indexes, OperatorContext, call, values
from shardwise.operator.crd import DLRMJobSpec, SpecError, parse_spec
from shardwise.operator.decide.records import Observed, PlanFailure
from shardwise.operator.kube import ApiError
from shardwise.operator.loop.overlay import Overlay
from shardwise.operator.loop.tableswatch import TablesWatch
from shardwise.operator.models.cost_models import CostModelInfo, newest
from shardwise.operator.models.jobtables import (
    INVALID_TABLES,
    TABLE_REASONS,
    JobTables,
    job_tables,
)
from shardwise.operator.render.children import JobMeta

logger = logging.getLogger("shardwise.operator")


class Observer:
    """What one job's loop remembers about reading (all of it recoverable)."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str, overlay: Overlay) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        self.overlay = overlay
        self.pod_failures: dict[str, PodFailure | None] = {}  # Job uid → first failing pod
        #: Job uid → (its FailedCreate or None, when the Events were read; monotonic).
        self.event_checks: dict[str, tuple[StartupProblem | None, float]] = {}
        #: Seconds until a Job without pods is due for an Events read (None: none is).
        self.next_check: float | None = None
        self._spec_key: tuple[str, int] | None = None
        self._spec: tuple[DLRMJobSpec | None, list[str]] = (None, [])
        #: The referenced tables ConfigMap as last read: (spec key, tables, monotonic).
        self._tables: tuple[tuple[str, int], JobTables, float] | None = None
        #: Watches that ConfigMap while it cannot be read (its fix is read at once).
        self.tables_watch = TablesWatch(ctx, namespace, name)

    def forget_tables(self) -> None:
        """Read the tables ConfigMap again on the next pass (it changed)."""
        self._tables = None

    def follow_tables(
        self, spec: DLRMJobSpec | None, tables: JobTables | None, failures: Iterable[PlanFailure]
    ) -> None:
        """Watch the tables ConfigMap while reading it fails (profiling or planning)."""
        ref = spec.tables.config_map_ref if spec is not None else None
        reason = tables.reason if tables is not None and tables.problem else None
        if reason is None:
            reason = next((f.reason for f in failures if f.reason in TABLE_REASONS), None)
        self.tables_watch.follow(
            ref.name if ref is not None and reason else None, exists=reason == INVALID_TABLES
        )

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

    async def _job_tables(self, spec: DLRMJobSpec | None) -> JobTables | None:
        """The tables of a job that is not suspended, whatever its policy: read before
        anything is profiled or planned on them (coverage, the profiling pod's copy, the
        planner), so tables no one can read stop the job before anything is announced.
        Inline ones come from the spec; a referenced ConfigMap that cannot be read is
        read again after ``tables_retry_seconds``, doubling for each failure alike up to
        ``max_tables_retry_seconds`` (an edited job reads it at once), else every resync."""
        if spec is None or spec.suspend:
            return None
        if spec.tables.inline is not None:
            return None  # decide reads them from the spec
        key, mono, cfg = self._spec_key or ("", 0), time.monotonic(), self.ctx.config
        prev = self._tables
        if prev is not None:
            seen, tables, at = prev
            ttl = cfg.tables_retry_after(tables.attempts) if tables.problem else cfg.resync_seconds
            if seen == key and mono - at < ttl:
                return tables
        tables = await job_tables(self.ctx, self.namespace, spec)
        if tables.problem is not None:
            # a failure alike of the same spec backs off; an edited job starts over
            alike = prev is not None and prev[0] == key and prev[1].reason == tables.reason
            tables = replace(tables, attempts=prev[1].attempts + 1 if alike and prev else 1)
        self._tables = (key, tables, mono)
        return tables

    async def _first_pod_failure(
        self, job: JobState, component: str, extra: Mapping[str, str]
    ) -> PodFailure | None:
        if job.ref.uid not in self.pod_failures:
            selector = ",".join(
                f"{k}={v}"
                for k, v in {
                    names.LABEL_JOB: self.name,
                    names.LABEL_COMPONENT: component,
                    **extra,
                }.items()
            )
            pods = await call(self.ctx.kube.list, "v1", "pods", self.namespace, selector)
            self.pod_failures[job.ref.uid] = first_failure(pods)
        return self.pod_failures[job.ref.uid]

    async def _failed_creates(
        self, jobs: list[JobState], pods: list[PodState], now: datetime.datetime
    ) -> dict[str, StartupProblem]:
        """The FailedCreate of each running Job that has no pods (see
        :mod:`shardwise.operator.cluster.startup`): read once it is ``failed_create_grace_seconds``
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
                    events = await call(
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

    def _quota(self, queue: str, idx: Indexes) -> Quota | None:
        """The GPU quota behind the job's Kueue LocalQueue (``None``: not queued, or a
        queue the indexes do not know)."""
        if not queue:
            return None
        local = next(iter(values(idx.localqueues, (self.namespace, queue))), None)
        clusters = {name: next(iter(store)) for name, store in idx.clusterqueues.items() if store}
        return quota_of(local, clusters)

    async def observe(
        self,
        body: Mapping[str, Any],
        idx: Indexes,
        now: datetime.datetime,
        plan_failures: Mapping[str, PlanFailure],
        last_status: Mapping[str, Any] | None,
    ) -> Observed:
        """The job as it is now. ``plan_failures``: what planning failed on, by inputs
        hash; ``last_status``: the status this loop last wrote (``None``: the body's)."""
        meta = body.get("metadata") or {}
        lbls = meta.get("labels") or {}
        job = JobMeta(
            self.name,
            self.namespace,
            str(meta.get("uid", "")),
            int(meta.get("generation") or 1),
            queue=str(lbls.get(names.LABEL_KUEUE_QUEUE, "")),
            priority_class=str(lbls.get(names.LABEL_KUEUE_PRIORITY, "")),
        )
        spec, problems = self._parse(body)
        tables = await self._job_tables(spec)
        key = (self.namespace, self.name)
        children = self.overlay.children
        jobs = children("Job", values(idx.jobs, key), lambda j: j.ref)
        ours = [j for j in jobs if job.uid in j.ref.owner_uids or not j.ref.owner_uids]
        workers = [
            j for j in ours if j.ref.labels.get(names.LABEL_COMPONENT) == names.COMPONENT_WORKER
        ]
        profilers = [
            j for j in ours if j.ref.labels.get(names.LABEL_COMPONENT) == names.COMPONENT_PROFILER
        ]
        plans = [
            p
            for p in children("ConfigMap", values(idx.plans, key), lambda p: p.ref)
            if job.uid in p.ref.owner_uids or not p.ref.owner_uids
        ]
        services = [
            s
            for s in children("Service", values(idx.services, key), lambda s: s)
            if job.uid in s.owner_uids or not s.owner_uids
        ]
        worker = workers[0] if workers else None
        worker_failure = None
        if worker is not None and worker.failure is not None:
            found_failure = await self._first_pod_failure(worker, names.COMPONENT_WORKER, {})
            worker_failure = found_failure.describe() if found_failure else None
        pods: list[PodState] = values(idx.pods, key)
        failed_creates = await self._failed_creates([*profilers, *workers[:1]], pods, now)
        profiling_failures = {}
        for pj in profilers:
            if pj.failure is not None:
                extra = {names.LABEL_ATTEMPT: pj.ref.labels.get(names.LABEL_ATTEMPT, "")}
                found = await self._first_pod_failure(pj, names.COMPONENT_PROFILER, extra)
                if found:
                    profiling_failures[pj.ref.name] = found
        models: dict[str, CostModelInfo] = {}
        for (ns, gpu), store in idx.models.items():
            if ns == self.namespace:
                best = newest(list(store))
                if best is not None:
                    models[gpu] = best
        nodes = [n for store in idx.nodes.values() for n in store]
        status = last_status if last_status is not None else body.get("status") or {}
        held = [p for store in idx.gpu_pods.values() for p in store]
        return Observed(
            gpu_usage=gpu_usage(held, self.namespace, self.name, names.COMPONENT_WORKER),
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
            plan_failures=dict(plan_failures),
            worker_failure=worker_failure,
            profiling_pod_failures=profiling_failures,
            pods=pods,
            failed_creates=failed_creates,
            tables=tables,
            resharding=status.get("resharding"),
            imbalance_loop=status.get("imbalanceLoop"),
            live=next(iter(values(idx.live, key)), None),
            quota=self._quota(job.queue, idx),
            workload=(
                active_workload(values(idx.workloads, (self.namespace, worker.ref.uid)))
                if worker is not None
                else None
            ),
        )
