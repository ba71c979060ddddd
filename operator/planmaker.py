"""Making one job's plan when the decision asks for it (a
:class:`~shardwise.operator.decision.PlanNeeded`): read the tables (inline, or from the
referenced ConfigMap: :mod:`~shardwise.operator.jobtables`) and the published model's
bytes, run the planner off the event loop
(:class:`~shardwise.operator.planning.PlanExecutor`), and create the plan ConfigMap
(its summary says which model planned it and how that model was calibrated). What
fails is kept by inputs hash (:class:`PlanFailure`, with when to try again) for the
next decision to report."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from shardwise import names
from shardwise.basics import UserError
from shardwise.operator.applier import Applier
from shardwise.operator.context import OperatorContext, call
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decision import PlanFailure, PlanNeeded
from shardwise.operator.jobtables import INVALID_TABLES, TABLES_NOT_FOUND, read_tables
from shardwise.operator.kube import ApiError
from shardwise.operator.observe import format_time
from shardwise.operator.planning import make_request, plan_summary
from shardwise.operator.profiling import coverage
from shardwise.operator.published_models import CostModelInfo
from shardwise.operator.render import JobMeta, plan_configmap
from shardwise.planner.tables import table_signature
from shardwise.profiler.publish import read_members, unpack_archive

logger = logging.getLogger("shardwise.operator")


class PlanMaker:
    """One job's planning, and what it failed on."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str, applier: Applier) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        self.applier = applier
        #: Inputs hash → why planning for it failed (and when to try again).
        self.failures: dict[str, PlanFailure] = {}

    async def _model(
        self, model: CostModelInfo | None
    ) -> tuple[tuple[bytes, str] | None, str | None]:
        """The published model's file bytes (and sha), or ``None`` and why not."""
        if model is None:
            return None, None
        selector = (
            f"{names.LABEL_COMPONENT}={names.COMPONENT_COSTMODEL},"
            f"{names.LABEL_GPU_TYPE}={model.gpu_type}"
        )
        try:
            cms = await call(self.ctx.kube.list, "v1", "configmaps", self.namespace, selector)
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
            tables = await read_tables(self.ctx, self.namespace, spec)
        except LookupError as err:
            self.failures[ih] = PlanFailure(TABLES_NOT_FOUND, str(err), retry)
            return
        except UserError as err:
            self.failures[ih] = PlanFailure(INVALID_TABLES, str(err), retry)
            return
        model, unreadable = await self._model(need.model)
        try:
            result = await self.ctx.planner.run(make_request(need.inputs, tables, model))
        except Exception as err:  # a crashed planner process: retried with backoff
            logger.exception("planning %s/%s failed", self.namespace, self.name)
            backoff = now + datetime.timedelta(seconds=self.ctx.config.max_error_backoff_seconds)
            self.failures[ih] = PlanFailure(
                "PlanningError", f"the planner crashed: {err!r}", backoff
            )
            return
        if result.error is not None:
            self.failures[ih] = PlanFailure("Infeasible", result.error)
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
            if used.calibration is not None:
                cover = coverage(used, [table_signature(t) for t in tables])
                summary_model["calibration"] = used.calibration.status(cover.covered, cover.of)
        degraded = "; ".join(x for x in (need.degraded, unreadable) if x)
        if degraded:
            summary_model["degraded"] = degraded
        if need.degraded:
            summary_model["degradedReason"] = need.degraded_reason
        summary = plan_summary(plan, need.inputs, result, summary_model)
        try:
            await self.applier.create(job, plan_configmap(job, plan, tables, ih, summary))
        except ApiError as err:
            if err.status != 422:
                raise
            # e.g. more than 1 MiB of plan and tables: the same inputs would fail again
            why = f"the API server refused the plan ConfigMap: {err.message}"
            self.failures[ih] = PlanFailure("PlanningError", why)
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
