"""The operator's Prometheus metrics: one registry per operator, served on ``/metrics``.

Why a registry of its own: tests run several operators in one process, and the
endpoint must show only this operator's series. Labels stay bounded (``namespace``,
``job`` = the DLRMJob's name, ``rank``, a phase or reason from a fixed set, the GPU
type); :meth:`OperatorMetrics.forget_job` removes every series of a deleted job so
stale series do not linger. Names: the ``shardwise_`` prefix, base units.

The predicted/measured ratio per rank is *not* computed here: the operator does not
scrape its workers. Prometheus joins the workers' ``shardwise_embedding_cost_seconds``
with ``shardwise_predicted_embedding_cost_seconds`` on ``namespace, job, rank`` in the
recording rule ``shardwise:embedding_cost_measured_over_predicted:ratio``
(charts/shardwise/rules/shardwise-alerts.yaml).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

#: Every phase ``status.phase`` can hold (lifecycle.Phase), so each job has one series
#: per phase with the current one at 1 (kube-state-metrics' style: ``sum by (phase)``).
PHASES = (
    "Pending",
    "Profiling",
    "Planning",
    "Running",
    "Resharding",
    "Succeeded",
    "Failed",
)
#: Parts of a rank's predicted cost; ``total`` is their sum.
COST_PHASES = ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm", "total")
PROFILING_FAILURE_REASONS = frozenset(
    {"ProfilingAttemptFailed", "ProfilingFailed", "InvalidProfilingSettings"}
)
#: Planning takes from milliseconds (a few tables) to minutes (thousands).
PLANNING_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)
JOB = ("namespace", "job")


class OperatorMetrics:
    """The operator's series and the calls that set them (from the job runner)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.predicted_cost = Gauge(
            "shardwise_predicted_embedding_cost_seconds",
            "Embedding cost per iteration the current plan predicts for a rank, by phase "
            "(total = fwd/bwd compute + fwd/bwd comm; the plan carries the total only).",
            [*JOB, "rank", "phase"],
            registry=r,
        )
        self.predicted_max = Gauge(
            "shardwise_plan_predicted_max_seconds",
            "The current plan's predicted embedding cost of its slowest rank.",
            JOB,
            registry=r,
        )
        self.imbalance = Gauge(
            "shardwise_plan_imbalance_ratio",
            "The current plan's predicted imbalance, 1 - mean/max over ranks (0: even).",
            JOB,
            registry=r,
        )
        self.world_size = Gauge(
            "shardwise_plan_world_size", "Ranks the current plan shards over.", JOB, registry=r
        )
        self.planning = Histogram(
            "shardwise_planning_duration_seconds",
            "Wall time of one planner run (search with the cost model).",
            JOB,
            buckets=PLANNING_BUCKETS,
            registry=r,
        )
        self.profiling_runs = Counter(
            "shardwise_profiling_runs",
            "Profiling Jobs the operator started, per GPU type.",
            ["namespace", "gpu_type"],
            registry=r,
        )
        self.profiling_failures = Counter(
            "shardwise_profiling_failures",
            "Profiling attempts that failed, per GPU type.",
            ["namespace", "gpu_type"],
            registry=r,
        )
        self.model_age = Gauge(
            "shardwise_cost_model_age_seconds",
            "Age of the published cost model a job plans with, per GPU type.",
            ["namespace", "gpu_type"],
            registry=r,
        )
        self.reshards = Counter(
            "shardwise_reshards",
            "Reshards (re-plan and restart of the workers), by reason.",
            [*JOB, "reason"],
            registry=r,
        )
        self.reshard_duration = Histogram(
            "shardwise_reshard_duration_seconds",
            "Time from a reshard's start (debounce excluded) to the new workers' Job.",
            JOB,
            buckets=PLANNING_BUCKETS,
            registry=r,
        )
        self.reconcile_errors = Counter(
            "shardwise_reconcile_errors",
            "Reconcile passes that raised (retried with backoff).",
            JOB,
            registry=r,
        )
        self.job_phase = Gauge(
            "shardwise_job_phase",
            "1 for the phase the DLRMJob is in, 0 for the others.",
            [*JOB, "phase"],
            registry=r,
        )
        self.waiting_for_capacity = Gauge(
            "shardwise_job_waiting_for_capacity",
            "1 while the job's Capacity condition is False (InsufficientCapacity).",
            JOB,
            registry=r,
        )
        self._ranks: dict[tuple[str, str], int] = {}
        self._reasons: dict[tuple[str, str], set[str]] = {}

    # ------------------------------------------------------------------ observations
    def observe_plan(
        self,
        namespace: str,
        job: str,
        per_rank_seconds: Sequence[float],
        imbalance: float,
        *,
        planning_seconds: float | None = None,
        phases: Sequence[Mapping[str, float]] | None = None,
    ) -> None:
        """A new plan: its per-rank prediction replaces the previous plan's series."""
        key = (namespace, job)
        self._remove_ranks(namespace, job, len(per_rank_seconds))
        for rank, total in enumerate(per_rank_seconds):
            labels = (namespace, job, str(rank))
            self.predicted_cost.labels(*labels, "total").set(total)
            for phase, seconds in (phases[rank] if phases else {}).items():
                if phase in COST_PHASES and phase != "total":
                    self.predicted_cost.labels(*labels, phase).set(seconds)
        self._ranks[key] = len(per_rank_seconds)
        self.predicted_max.labels(*key).set(max(per_rank_seconds, default=0.0))
        self.imbalance.labels(*key).set(imbalance)
        self.world_size.labels(*key).set(len(per_rank_seconds))
        if planning_seconds is not None:
            self.planning.labels(*key).observe(planning_seconds)

    def observe_status(
        self,
        namespace: str,
        job: str,
        status: Mapping[str, Any],
        now: datetime.datetime | None = None,
    ) -> None:
        """Phase, capacity wait, plan imbalance and model age from the written status."""
        key = (namespace, job)
        phase = str(status.get("phase") or "")
        for p in PHASES:
            self.job_phase.labels(*key, p).set(1.0 if p == phase else 0.0)
        conditions = status.get("conditions") or []
        waiting = any(
            c.get("type") == "Capacity" and c.get("status") == "False" for c in conditions
        )
        self.waiting_for_capacity.labels(*key).set(1.0 if waiting else 0.0)
        plan = status.get("plan") or {}
        if isinstance(plan.get("imbalance"), int | float):
            self.imbalance.labels(*key).set(float(plan["imbalance"]))
        if isinstance(plan.get("predictedMaxSeconds"), int | float):
            self.predicted_max.labels(*key).set(float(plan["predictedMaxSeconds"]))
        model = status.get("costModel") or {}
        published = model.get("publishedAt")
        if model.get("gpuType") and isinstance(published, str):
            when = datetime.datetime.fromisoformat(published.replace("Z", "+00:00"))
            now = now or datetime.datetime.now(datetime.UTC)
            age = max(0.0, (now - when).total_seconds())
            self.model_age.labels(namespace, str(model["gpuType"])).set(age)

    def observe_profiling_run(self, namespace: str, gpu_type: str) -> None:
        self.profiling_runs.labels(namespace, gpu_type).inc()

    def observe_profiling_failure(self, namespace: str, gpu_type: str) -> None:
        self.profiling_failures.labels(namespace, gpu_type).inc()

    def observe_reshard(
        self, namespace: str, job: str, reason: str, seconds: float | None = None
    ) -> None:
        """One reshard; ``reason`` from a fixed set (e.g. NodeAdded, NodeLost, SpecChanged),
        ``seconds`` how long it took when known."""
        self.reshards.labels(namespace, job, reason).inc()
        self._reasons.setdefault((namespace, job), set()).add(reason)
        if seconds is not None:
            self.reshard_duration.labels(namespace, job).observe(seconds)

    def observe_reconcile_error(self, namespace: str, job: str) -> None:
        self.reconcile_errors.labels(namespace, job).inc()

    def forget_job(self, namespace: str, job: str) -> None:
        """Remove every series of a deleted job (GPU-type series are shared: kept)."""
        key = (namespace, job)
        self._remove_ranks(namespace, job, 0)
        self._ranks.pop(key, None)
        for reason in self._reasons.pop(key, set()):
            self.reshards.remove(*key, reason)
        for p in PHASES:
            _remove(self.job_phase, *key, p)
        for metric in (
            self.predicted_max,
            self.imbalance,
            self.world_size,
            self.planning,
            self.reshard_duration,
            self.reconcile_errors,
            self.waiting_for_capacity,
        ):
            _remove(metric, *key)

    def _remove_ranks(self, namespace: str, job: str, keep: int) -> None:
        for rank in range(keep, self._ranks.get((namespace, job), 0)):
            for phase in COST_PHASES:
                _remove(self.predicted_cost, namespace, job, str(rank), phase)

    # ------------------------------------------------------------------ serving
    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``port`` in a daemon thread; returns the server (its
        ``server_port`` is the bound port, useful with port 0)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


def _remove(metric: Gauge | Counter | Histogram, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to remove
        metric.remove(*labels)
