"""One DLRMJob's reconcile loop: observe, :func:`~shardwise.operator.decide.reconcile.decide`,
apply, plan, write status; and the daemon that runs it (:func:`run_job`).

Each step has its own module: :mod:`~shardwise.operator.loop.observe` builds the
:class:`~shardwise.operator.decide.records.Observed` from kopf's indexes, overlaid with this
loop's own creates and deletes (:mod:`~shardwise.operator.loop.overlay`);
:mod:`~shardwise.operator.loop.apply` creates (adopting on a 409), patches and deletes;
:mod:`~shardwise.operator.loop.planmaker` runs the planner and creates the plan ConfigMap;
:mod:`~shardwise.operator.loop.status` writes the status and its Events.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

from shardwise.operator.context import Indexes, OperatorContext
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.lifecycle import EventSpec
from shardwise.operator.decide.reconcile import decide
from shardwise.operator.kube import ApiError
from shardwise.operator.loop.apply import Applier
from shardwise.operator.loop.observe import Observer
from shardwise.operator.loop.overlay import Overlay
from shardwise.operator.loop.planmaker import PlanMaker
from shardwise.operator.loop.status import StatusWriter

logger = logging.getLogger("shardwise.operator")


class JobRunner:
    """The state one job's loop keeps between reconciles (all of it recoverable)."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        overlay = Overlay()
        self.observer = Observer(ctx, namespace, name, overlay)
        self.applier = Applier(ctx, namespace, overlay)
        self.plans = PlanMaker(ctx, namespace, name, self.applier)
        self.status = StatusWriter(ctx, namespace, name)

    def _observe_reshard(self, rec: rs.Record, now: datetime.datetime) -> None:
        """The one metrics call site of resharding: a reshard finished (the new worker
        Job is created); its time runs from the start of the reshard (debounce excluded)."""
        seconds = (now - rec.started_at).total_seconds() if rec.started_at else 0.0
        logger.info(
            "resharded %s/%s %s in %.3f s", self.namespace, self.name, rec.describe(), seconds
        )
        self.ctx.metrics.observe_reshard(self.namespace, self.name, rec.reason, seconds)

    async def reconcile(self, body: Mapping[str, Any], idx: Indexes) -> float | None:
        """One pass; returns seconds until a pass is due anyway (``0``: at once)."""
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return None  # the garbage collector removes the children
        now = datetime.datetime.now(datetime.UTC)
        if self.observer.tables_watch.take_change():
            # the tables ConfigMap was created or edited: read it, and plan, at once
            self.observer.forget_tables()
            self.plans.forget_table_failures()
        observed = await self.observer.observe(
            body, idx, now, self.plans.failures, self.status.last
        )
        await self.applier.adopt_orphans(observed.job, observed)
        decision = decide(observed)
        self.observer.follow_tables(observed.spec, observed.tables, self.plans.failures.values())
        await self.applier.apply(observed.job, decision)
        for pod in decision.force_deletes:
            self.ctx.emit(body, EventSpec("Warning", "PodForceDeleted", pod.message))
        if decision.resharded is not None:
            self._observe_reshard(decision.resharded, now)
        if decision.loop_decision is not None:
            what, gain = decision.loop_decision
            self.ctx.metrics.observe_imbalance_decision(self.namespace, self.name, what, gain)
        live = decision.fields.get("live") or {}
        if "measuredImbalance" in live:
            self.ctx.metrics.observe_live(
                self.namespace,
                self.name,
                live["measuredMaxComputeMilliseconds"] / 1e3,
                live["measuredImbalance"],
            )
        else:  # no current summary: no stale figure for the alert to fire on
            self.ctx.metrics.forget_live(self.namespace, self.name)
        if decision.live_plan is not None:
            await self.status.write(body, observed.job, decision, now)
            await self.plans.plan_live(observed.job, decision.live_plan, now)
            return 0.0
        if decision.plan is not None and observed.spec is not None:
            await self.status.write(body, observed.job, decision, now)
            await self.plans.plan(observed.job, observed.spec, decision.plan, now)
            return 0.0
        await self.status.write(body, observed.job, decision, now)
        waits = [w for w in (decision.requeue_after, self.observer.next_check) if w is not None]
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
        runner.observer.tables_watch.stop()
        ctx.wakeups.unregister(namespace, name)
        ctx.metrics.forget_job(namespace, name)
