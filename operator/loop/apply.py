"""Acting on one job's :class:`~shardwise.operator.decide.records.Decision`: create, patch and
delete through :class:`~shardwise.operator.kube.KubeApi` in threads, each write
remembered in the loop's :class:`~shardwise.operator.loop.overlay.Overlay`.

A create answered 409 adopts the existing object when it is ours (same owner) or
unowned with our labels; that is how a restarted operator, or a retry after a
conflict, converges without duplicates. Children with our labels but no owner get us
as their owner (:meth:`Applier.adopt_orphans`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from shardwise import names
from shardwise.operator.context import OperatorContext, call
from shardwise.operator.decide.records import Decision, Observed
from shardwise.operator.kube import PLURALS, ApiError
from shardwise.operator.loop.overlay import Overlay
from shardwise.operator.render.children import JobMeta, owner_reference, plans_configmap
from shardwise.operator.render.elastic import PlanCopy

logger = logging.getLogger("shardwise.operator")


class Applier:
    """One job's writes."""

    def __init__(self, ctx: OperatorContext, namespace: str, overlay: Overlay) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.overlay = overlay

    async def create(self, job: JobMeta, body: dict[str, Any]) -> None:
        """Create, or adopt what is already there under that name (see module docstring)."""
        kube = self.ctx.kube
        kind, meta = str(body["kind"]), body["metadata"]
        try:
            obj = await call(kube.create, body)
        except ApiError as err:
            if err.status != 409:
                raise
            existing = await call(
                kube.get, body["apiVersion"], PLURALS[kind], meta["namespace"], meta["name"]
            )
            if existing is None:
                return  # gone again: the next reconcile decides anew
            obj = await self._adopt(job, body, existing)
        else:
            labels = meta.get("labels") or {}
            if kind == "Job" and labels.get(names.LABEL_COMPONENT) == names.COMPONENT_PROFILER:
                gpu = str(labels.get(names.LABEL_GPU_TYPE, ""))
                self.ctx.metrics.observe_profiling_run(self.namespace, gpu)
        self.overlay.remember(obj)

    async def _adopt(
        self, job: JobMeta, body: dict[str, Any], existing: dict[str, Any]
    ) -> dict[str, Any]:
        kube, meta = self.ctx.kube, existing.get("metadata") or {}
        refs = meta.get("ownerReferences") or []
        ours = any(r.get("uid") == job.uid for r in refs)
        labels = meta.get("labels") or {}
        if not ours and (
            any(r.get("controller") for r in refs) or labels.get(names.LABEL_JOB) != job.name
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
        return await call(
            kube.patch,
            body["apiVersion"],
            PLURALS[body["kind"]],
            job.namespace,
            meta["name"],
            {"metadata": patch},
        )

    async def copy_plans(self, job: JobMeta, copies: Sequence[PlanCopy]) -> None:
        """Write each plan into the job's plans ConfigMap under its world size (created
        with the first), read from the plan ConfigMap the decision names."""
        kube = self.ctx.kube
        name = names.plans_configmap_name(job.name)
        for copy in copies:
            source = await call(kube.get, "v1", "configmaps", job.namespace, copy.source)
            data = (source or {}).get("data") or {}
            if names.PLAN_KEY not in data or names.TABLES_KEY not in data:
                raise ApiError(
                    404,
                    "NotFound",
                    f"plan ConfigMap {copy.source} is gone or incomplete: nothing to copy "
                    f"into {name} (the next pass plans again)",
                )
            wanted = {
                names.world_plan_key(copy.ranks): data[names.PLAN_KEY],
                names.TABLES_KEY: data[names.TABLES_KEY],
            }
            try:
                await call(kube.create, plans_configmap(job, wanted))
            except ApiError as err:
                if err.status != 409:
                    raise
                await call(kube.patch, "v1", "configmaps", job.namespace, name, {"data": wanted})

    async def apply(self, job: JobMeta, decision: Decision) -> None:
        kube = self.ctx.kube
        for what in decision.stopped:
            logger.info("%s/%s: stopping profiling attempt %s", job.namespace, job.name, what)
        await self.copy_plans(job, decision.plan_copies)
        for body in decision.creates:
            await self.create(job, body)
        for ref, patch in decision.patches:
            try:
                obj = await call(
                    kube.patch, ref.api_version, PLURALS[ref.kind], job.namespace, ref.name, patch
                )
            except ApiError as err:
                if err.status != 404:
                    raise
            else:
                if ref.kind == "Job":
                    self.overlay.remember(obj)
        for pod in decision.force_deletes:
            logger.warning("%s/%s: %s", job.namespace, job.name, pod.message)
            await call(kube.delete, "v1", "pods", job.namespace, pod.pod, "Background", 0)
        for ref in decision.deletes:
            # Foreground for Jobs: the Job stays until its pods are gone, so a replacement
            # never runs beside the workers it replaces.
            policy = "Foreground" if ref.kind == "Job" else "Background"
            await call(
                kube.delete, ref.api_version, PLURALS[ref.kind], job.namespace, ref.name, policy
            )
            self.overlay.deleting(ref.kind, ref.name, ref.uid)

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
            existing = await call(
                self.ctx.kube.get, api[ref.kind], PLURALS[ref.kind], job.namespace, ref.name
            )
            if existing is not None:
                self.overlay.remember(await self._adopt(job, body, existing))
