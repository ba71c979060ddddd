"""Making one job's plan when the decision asks for it (a
:class:`~shardwise.operator.decide.records.PlanNeeded`): read the tables (inline, or from the
referenced ConfigMap: :mod:`~shardwise.operator.models.jobtables`) and the published model's
bytes, run the planner off the event loop
(:class:`~shardwise.operator.loop.planner_pool.PlanExecutor`), and create the plan ConfigMap
(its summary says which model planned it and how that model was calibrated). When
the job's profiling pod published a plan refined by measurement for exactly these
inputs (:mod:`~shardwise.operator.models.refined_plans`), that plan is used instead of running
the planner, once it passes the same checks; the summary says which kind ran and why.
What fails is kept by inputs hash (:class:`PlanFailure`, with when to try again) for
the next decision to report."""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any

from shardwise import names
from shardwise.basics import UserError
from shardwise.operator.cluster.summaries import format_time
from shardwise.operator.context import OperatorContext, call
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decide.imbalance import LIVE_REPLAN_FAILED, NO_BETTER_PLAN
from shardwise.operator.decide.profiling import coverage, tables_hash
from shardwise.operator.decide.records import LivePlanNeeded, PlanFailure, PlanNeeded
from shardwise.operator.kube import ApiError
from shardwise.operator.loop.apply import Applier
from shardwise.operator.loop.planner_pool import (
    LivePlanRequest,
    PlanResult,
    make_request,
    plan_summary,
)
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.models.jobtables import (
    INVALID_TABLES,
    TABLE_REASONS,
    TABLES_NOT_FOUND,
    read_tables,
)
from shardwise.operator.models.plan_kinds import kind_fields
from shardwise.operator.models.refined_plans import (
    KIND_MODEL_ONLY,
    KIND_REFINED,
    RefinedPlanInfo,
    Wanted,
    choose,
    not_refining,
    parse_refined,
)
from shardwise.operator.render.children import JobMeta, plan_configmap
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec, parse_tables, table_signature
from shardwise.planner.topology import Topology
from shardwise.profiler.publish import read_members, unpack_archive

logger = logging.getLogger("shardwise.operator")


def on_hosts(plan: Plan, topology: Topology) -> Plan:
    """``plan`` on ``topology``'s hosts when it was made for the same GPUs as one host
    (the profiling pod refines for a world size, not for hosts), rehashed; else as it
    is. The caller validates the result: a table-row-wise or grid table over more ranks
    than a host holds does not fit the hosts."""
    one_host = topology.model_copy(update={"gpus_per_host": None})
    if topology.gpus_per_host is None or plan.topology != one_host:
        return plan
    return plan.model_copy(update={"topology": topology}).with_hash()


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

    async def _refined(
        self, job: JobMeta, spec: DLRMJobSpec, need: PlanNeeded, tables: list[TableSpec]
    ) -> tuple[tuple[Plan, RefinedPlanInfo] | None, str]:
        """The plan the profiling pod refined for exactly these inputs, checked like any
        plan against the tables and the topology; or ``None`` and why not."""
        why = not_refining(spec)
        if why is not None:
            return None, why
        selector = (
            f"{names.LABEL_JOB}={self.name},{names.LABEL_COMPONENT}={names.COMPONENT_REFINED_PLAN}"
        )
        try:
            cms = await call(self.ctx.kube.list, "v1", "configmaps", self.namespace, selector)
        except ApiError as err:
            return None, f"the refined plans could not be read ({err.message})"
        bodies = {str((cm.get("metadata") or {}).get("name", "")): cm for cm in cms}
        ours = [
            info
            for info in map(parse_refined, cms)
            if info is not None and job.uid in info.owner_uids
        ]
        want = Wanted.of(need.inputs, tables_hash([table_signature(t) for t in tables]))
        info, why = choose(ours, want)
        if info is None:
            return None, why
        text = str((bodies[info.name].get("data") or {}).get(names.PLAN_KEY, ""))
        try:
            plan = Plan.model_validate_json(text)
        except ValueError as err:
            return None, f"the refined plan {info.name} is unreadable: {str(err).splitlines()[0]}"
        problems = []
        if plan.hash != plan.content_hash():
            problems.append("its hash does not match its content (was the ConfigMap edited?)")
        if plan.hash != info.plan_hash:
            problems.append(f"its hash is not the {info.plan_hash[:8]} its annotation names")
        plan = on_hosts(plan, need.inputs.topology())
        problems += plan.problems(tables, require_hash=True)
        if plan.topology != need.inputs.topology():
            problems.append(f"it was made for {plan.topology}, not {need.inputs.topology()}")
        if plan.refinement is None:
            problems.append("it carries no refinement record")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return None, f"the refined plan {info.name} is not valid here: {problems[0]}{more}"
        return (plan, info), ""

    def forget_table_failures(self) -> None:
        """The tables ConfigMap changed: plan again at once, counting from 1."""
        self.failures = {k: f for k, f in self.failures.items() if f.reason not in TABLE_REASONS}

    def _retried(
        self, ih: str, reason: str, message: str, job: JobMeta, now: datetime.datetime
    ) -> PlanFailure:
        """The failure to record for tables that could not be read: retried after
        ``tables_retry_seconds``, twice as long after each failure alike, at most
        ``max_tables_retry_seconds``; a new reason, or an edited job, starts over."""
        cfg = self.ctx.config
        prev = self.failures.get(ih)
        alike = prev is not None and prev.reason == reason and prev.generation == job.generation
        attempts = prev.attempts + 1 if prev is not None and alike else 1
        retry = now + datetime.timedelta(seconds=cfg.tables_retry_after(attempts))
        return PlanFailure(reason, message, retry, attempts, job.generation)

    async def plan(
        self, job: JobMeta, spec: DLRMJobSpec, need: PlanNeeded, now: datetime.datetime
    ) -> None:
        ih = need.inputs.hash()
        try:
            tables = await read_tables(self.ctx, self.namespace, spec)
        except LookupError as err:
            self.failures[ih] = self._retried(ih, TABLES_NOT_FOUND, str(err), job, now)
            return
        except UserError as err:
            self.failures[ih] = self._retried(ih, INVALID_TABLES, str(err), job, now)
            return
        started = time.perf_counter()
        refined, why = await self._refined(job, spec, need, tables)
        if refined is not None:
            # The pod planned with the published model (the one it calibrated): no
            # planner run, no model download.
            plan, info = refined
            fingerprint = str(info.figures.get("modelFingerprint", ""))
            result = PlanResult(None, None, fingerprint, time.perf_counter() - started)
            used, unreadable = need.model, None
        else:
            model, unreadable = await self._model(need.model)
            try:
                result = await self.ctx.planner.run(make_request(need.inputs, tables, model))
            except Exception as err:  # a crashed planner process: retried with backoff
                logger.exception("planning %s/%s failed", self.namespace, self.name)
                backoff = now + datetime.timedelta(
                    seconds=self.ctx.config.max_error_backoff_seconds
                )
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
        summary = plan_summary(
            plan,
            need.inputs,
            result,
            summary_model,
            kind=KIND_MODEL_ONLY if refined is None else KIND_REFINED,
            why=why,
            refinement=refined[1].status() if refined is not None else None,
        )
        if not await self._create(job, plan_configmap(job, plan, tables, ih, summary), ih):
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

    async def _create(
        self, job: JobMeta, body: dict[str, Any], ih: str, reason: str = "PlanningError"
    ) -> bool:
        """Create the plan ConfigMap; a refusal (e.g. more than 1 MiB of plan and tables:
        the same inputs would fail again) is kept as the failure for these inputs."""
        try:
            await self.applier.create(job, body)
        except ApiError as err:
            if err.status != 422:
                raise
            why = f"the API server refused the plan ConfigMap: {err.message}"
            self.failures[ih] = PlanFailure(reason, why)
            return False
        return True

    def _calibrated(self, used: Any) -> CostModelInfo | None:
        """The published, calibrated model the running plan was made with (its rank head
        knows a rank's fixed part), as the plan's summary names it; None otherwise."""
        if not isinstance(used, dict) or used.get("source") != "Published":
            return None
        payload, gpu_type = used.get("configMap"), used.get("gpuType")
        if not used.get("calibration") or not payload or not gpu_type:
            return None
        return CostModelInfo(
            gpu_type=str(gpu_type),
            payload=str(payload),
            published_at=None,
            fingerprint=str(used.get("fingerprint") or ""),
            sha256=f"{payload}@{used.get('publishedAt', '')}",
            namespace=self.namespace,
        )

    async def plan_live(self, job: JobMeta, need: LivePlanNeeded, now: datetime.datetime) -> None:
        """Re-plan the running plan from the workers' live costs (the closed loop) and
        create the plan ConfigMap the loop judges; a re-plan that moves nothing, or
        fails, is kept as a failure for the loop to decline on."""
        r = need.replan
        ih = r.inputs_hash
        body = await call(self.ctx.kube.get, "v1", "configmaps", self.namespace, r.base.ref.name)
        data = (body or {}).get("data") or {}
        if names.PLAN_KEY not in data or names.TABLES_KEY not in data:
            why = f"the running plan's ConfigMap {r.base.ref.name} is gone or incomplete"
            self.failures[ih] = PlanFailure(LIVE_REPLAN_FAILED, why)
            return
        try:
            tables = parse_tables(data[names.TABLES_KEY], "yaml", r.base.ref.name)
        except UserError as err:
            self.failures[ih] = PlanFailure(LIVE_REPLAN_FAILED, str(err))
            return
        try:  # the rank head is one piece of evidence: the re-plan goes on without it
            model, _ = await self._model(self._calibrated(r.base.summary.get("model")))
        except ApiError:
            model = None
        request = LivePlanRequest(
            plan_json=data[names.PLAN_KEY],
            tables_json=json.dumps([t.model_dump(mode="json") for t in tables]),
            topology_json=need.inputs.topology().model_dump_json(),
            live_json=r.live.to_json(),
            history_json=json.dumps([p.model_dump(by_alias=True) for p in r.history]),
            model=model,
        )
        try:
            result = await self.ctx.planner.run_live(request)
        except Exception as err:  # a crashed planner process: the loop declines
            logger.exception("live re-planning %s/%s failed", self.namespace, self.name)
            self.failures[ih] = PlanFailure(LIVE_REPLAN_FAILED, f"the planner crashed: {err!r}")
            return
        if result.error is not None:
            self.failures[ih] = PlanFailure(LIVE_REPLAN_FAILED, result.error)
            return
        if result.plan_json is None:
            why = f"no placement beats the running one ({result.live.get('describe', '')})"
            self.failures[ih] = PlanFailure(NO_BETTER_PLAN, why)
            return
        plan = result.plan()
        stale = ("live", "planningSeconds", "kinds", "tablesByKind")
        summary = {
            **{k: v for k, v in r.base.summary.items() if k not in stale},
            **kind_fields(plan),
            "hash": plan.hash,
            "planner": plan.planner,
            "kind": "Live",
            "predictedMaxSeconds": plan.predicted.max_seconds if plan.predicted else None,
            "imbalance": plan.predicted.imbalance if plan.predicted else None,
            "planningSeconds": round(result.seconds, 3),
            "live": dict(result.live),
        }
        body = plan_configmap(job, plan, tables, ih, summary)
        if not await self._create(job, body, ih, LIVE_REPLAN_FAILED):
            return
        logger.info(
            "re-planned %s/%s from live costs: %s", self.namespace, self.name,
            result.live.get("describe", plan.hash[:8]),
        )  # fmt: skip
