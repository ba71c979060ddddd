"""Writing one job's status: the whole status built from the decision
(:func:`~shardwise.operator.decide.lifecycle.build_status`), patched as a merge patch against
what the API server holds, only when it changed, with an Event for each transition (and
for each retry that failed alike, which the recorder counts on the Event posted)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from shardwise import names
from shardwise.operator.context import OperatorContext, call
from shardwise.operator.decide.lifecycle import build_status, repeated_events, transition_events
from shardwise.operator.decide.records import Decision
from shardwise.operator.kube import ApiError
from shardwise.operator.metrics import PROFILING_FAILURE_REASONS
from shardwise.operator.render.children import JobMeta


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


class StatusWriter:
    """One job's status writes; ``last`` is the status it last wrote (``None``: none
    yet, the body's status stands)."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        self.last: dict[str, Any] | None = None
        #: Condition type → (reason, failed attempt) last announced (repeated_events).
        self.counted: dict[str, tuple[str, int]] = {}

    async def write(
        self, body: Mapping[str, Any], job: JobMeta, decision: Decision, now: datetime.datetime
    ) -> None:
        current = dict(body.get("status") or {})
        before = self.last if self.last is not None else current
        status = build_status(before, decision.conditions, job.generation, now, decision.fields)
        # every pass, written or not: a restarted operator and the model's age stay current
        self.ctx.metrics.observe_status(self.namespace, self.name, status, now)
        # a retry that failed alike: its Warning again, counted on the Event posted
        counted = dict(self.counted)
        repeats = repeated_events(status, decision.attempts, counted)
        events = transition_events(before, status) if status != before else []
        if status != before:
            patch = {"status": merge_patch_between(current, status)}
            try:
                await call(
                    self.ctx.kube.patch,
                    names.API_VERSION,
                    names.PLURAL,
                    self.namespace,
                    self.name,
                    patch,
                    "status",
                )
            except ApiError as err:
                if err.status == 404:
                    return
                raise
            self.last = status
        # Only now, the status written: what an Event announces is in the status, so
        # a pass that could not write it announces it once, on the pass that does.
        self.counted = counted
        for ev in repeats:
            self.ctx.emit(body, ev)
        gpu = str((status.get("costModel") or {}).get("gpuType", ""))
        for ev in events:
            self.ctx.emit(body, ev)
            if ev.reason in PROFILING_FAILURE_REASONS:
                self.ctx.metrics.observe_profiling_failure(self.namespace, gpu)
