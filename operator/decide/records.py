"""What :func:`~shardwise.operator.decide.reconcile.decide` reads (:class:`Observed`) and
returns (:class:`Decision`), and the small records that go with them."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.operator.cluster.capacity import NodeInfo
from shardwise.operator.cluster.lostnodes import Stranded
from shardwise.operator.cluster.quota import Quota
from shardwise.operator.cluster.startup import PodState, StartupProblem
from shardwise.operator.cluster.summaries import (
    ChildRef,
    JobState,
    LiveRecord,
    PlanRecord,
    PodFailure,
)
from shardwise.operator.cluster.workloads import WorkloadState
from shardwise.operator.config import OperatorConfig
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decide import imbalance, profiling
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.models.jobtables import JobTables
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.render.children import JobMeta
from shardwise.operator.render.elastic import PlanCopy


@dataclass(frozen=True)
class PlanFailure:
    """Planning for an inputs hash failed; ``retry_at`` None means until the inputs change.

    ``attempts`` counts the failures in a row for the same reason (the retry backs off
    with it); ``generation`` is the job's when it failed: an edited job retries at once.
    """

    reason: str
    message: str
    retry_at: datetime.datetime | None = None
    attempts: int = 1
    generation: int | None = None

    def due(self, now: datetime.datetime, generation: int) -> bool:
        """Whether planning these inputs again is due: the job changed, or the wait
        is over (a failure without ``retry_at`` waits for the inputs to change)."""
        if self.generation is not None and self.generation != generation:
            return True
        return self.retry_at is not None and now >= self.retry_at


@dataclass(frozen=True)
class Observed:
    job: JobMeta
    spec: DLRMJobSpec | None
    spec_problems: Sequence[str]
    nodes: Sequence[NodeInfo]
    models: Mapping[str, CostModelInfo]
    profiling_jobs: Sequence[JobState]
    plans: Sequence[PlanRecord]
    worker_job: JobState | None
    service: ChildRef | None
    now: datetime.datetime
    config: OperatorConfig = field(default_factory=OperatorConfig)
    plan_failures: Mapping[str, PlanFailure] = field(default_factory=dict)
    worker_failure: str | None = None
    #: The first failing pod of each failed profiling attempt, by Job name.
    profiling_pod_failures: Mapping[str, PodFailure] = field(default_factory=dict)
    #: This job's pods (the ``sw_pods`` index): how far each Job's pods got.
    pods: Sequence[PodState] = ()
    #: ``FailedCreate`` Events of the Jobs without pods, by Job name.
    failed_creates: Mapping[str, StartupProblem] = field(default_factory=dict)
    #: ``status.resharding`` as last written: the one earlier state decide reads (the
    #: debounce clock and a reshard under way must survive a restart; see resharding.py).
    resharding: Mapping[str, Any] | None = None
    #: GPUs per node that other pods hold (not this job's own workers).
    gpu_usage: Mapping[str, int] = field(default_factory=dict)
    #: The job's tables (read from the referenced ConfigMap unless the job is suspended);
    #: ``None``: not read (inline tables are read from the spec when needed).
    tables: JobTables | None = None
    #: Rank 0's live summary of the running workers (``None``: no live ConfigMap yet).
    live: LiveRecord | None = None
    #: ``status.imbalanceLoop`` as last written (the closed loop's record, imbalance.py).
    imbalance_loop: Mapping[str, Any] | None = None
    #: Kueue's Workload of the worker Job, when it is queued and Kueue made one.
    workload: WorkloadState | None = None
    #: The GPU quota of the job's Kueue queue (``None``: not queued, or unknown).
    quota: Quota | None = None


@dataclass(frozen=True)
class PlanNeeded:
    inputs: PlanInputs
    #: The model to plan with; ``None`` means the bundled one.
    model: CostModelInfo | None
    #: Why the model is second best, recorded with the plan.
    degraded: str | None
    #: The Degraded condition's reason that goes with ``degraded``.
    degraded_reason: str = profiling.PROFILING_FAILED


@dataclass(frozen=True)
class LivePlanNeeded:
    """Re-plan the running plan from the workers' live costs (the closed loop)."""

    replan: imbalance.Replan
    #: The declared inputs at the running placement: the topology the re-plan keeps.
    inputs: PlanInputs


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    name: str
    uid: str = ""


@dataclass
class Decision:
    #: Plans to copy into an elastic job's plans ConfigMap, before anything else.
    plan_copies: list[PlanCopy] = field(default_factory=list)
    creates: list[dict[str, Any]] = field(default_factory=list)
    patches: list[tuple[Ref, dict[str, Any]]] = field(default_factory=list)
    deletes: list[Ref] = field(default_factory=list)
    plan: PlanNeeded | None = None
    conditions: list[Condition] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None
    #: A reshard that finished in this pass (the new worker Job is created): for metrics.
    resharded: rs.Record | None = None
    #: Profiling attempts deleted in this pass, and why (for the log).
    stopped: list[str] = field(default_factory=list)
    #: Terminating pods on lost nodes, to delete at once (see lostnodes.py).
    force_deletes: list[Stranded] = field(default_factory=list)
    #: A live re-plan to make (the closed loop), after the status is written.
    live_plan: LivePlanNeeded | None = None
    #: The closed loop's decision in this pass, and its predicted gain (for metrics).
    loop_decision: tuple[str, float | None] | None = None
    #: Condition type → the failed attempt its reason reports (a retry that failed
    #: alike is announced again, counted on the same Event).
    attempts: dict[str, int] = field(default_factory=dict)

    def requeue(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue_after = (
            seconds if self.requeue_after is None else min(self.requeue_after, seconds)
        )
