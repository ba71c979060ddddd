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

The *measured* per-job figures it does export come from the live summary rank 0 writes
(:mod:`shardwise.planner.live.summary`), which the reshard-on-imbalance loop reads anyway:
the slowest rank's measured compute and the max/mean imbalance the loop decides on, the
predicted gain of its last re-plan and a count of its decisions. Per-shard costs stay in
the summary: one series per table would be unbounded.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shardwise.planner.kinds import KINDS

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
#: Sharding kinds of plan.json: the ``kind`` label of ``shardwise_plan_tables``.
PLAN_KINDS = KINDS
#: Parts of a rank's predicted cost; ``total`` is their sum.
COST_PHASES = ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm", "total")
PROFILING_FAILURE_REASONS = frozenset(
    {"ProfilingAttemptFailed", "ProfilingFailed", "InvalidProfilingSettings"}
)
#: Planning takes from milliseconds (a few tables) to minutes (thousands).
PLANNING_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)
JOB = ("namespace", "job")
#: What the reshard-on-imbalance loop decided on a pass where it judged the job: the
#: ``decision`` label of ``shardwise_imbalance_decisions_total`` (a fixed set).
IMBALANCE_DECISIONS = (
    "resharded",  # re-planned from the live costs and resharded
    "declined_gain",  # the re-plan's predicted gain is below minGain
    "declined_cost",  # the gain over the remaining steps does not pay for a reshard
    "rate_limited",  # maxPerHour reshards already in the last hour
    "plan_failed",  # the live re-plan failed: nothing to reshard to
    "delivered",  # a reshard's measured gain matched its prediction: the loop goes on
    "stopped",  # a reshard did not deliver its predicted gain: the loop is off for the job
)


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
        self.plan_tables = Gauge(
            "shardwise_plan_tables",
            "Tables of the current plan by sharding kind (every kind listed, 0 when none): "
            "row_wise, table_row_wise and grid tables put a slice on many GPUs, "
            "data_parallel a copy on every GPU.",
            [*JOB, "kind"],
            registry=r,
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
        self.measured_max = Gauge(
            "shardwise_measured_max_rank_seconds",
            "The running job's slowest rank's measured embedding compute per iteration "
            "(fwd + bwd, medians over recent sampled steps; the workers' live summary).",
            JOB,
            registry=r,
        )
        self.measured_imbalance = Gauge(
            "shardwise_measured_imbalance",
            "The running job's measured imbalance, max/mean of the ranks' embedding "
            "compute (1: even); what the reshard-on-imbalance loop decides on.",
            JOB,
            registry=r,
        )
        self.reshard_gain = Gauge(
            "shardwise_predicted_reshard_gain",
            "The predicted gain of the last live re-plan: measured max-rank compute over "
            "the re-plan's predicted max, minus 1 (0.25: the slowest rank 1.25x faster).",
            JOB,
            registry=r,
        )
        self.imbalance_decisions = Counter(
            "shardwise_imbalance_decisions",
            "Decisions of the reshard-on-imbalance loop, taken or declined.",
            [*JOB, "decision"],
            registry=r,
        )
        self._ranks: dict[tuple[str, str], int] = {}
        self._reasons: dict[tuple[str, str], set[str]] = {}
        self._decisions: dict[tuple[str, str], set[str]] = {}

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
        kinds = plan.get("kinds") or {}
        if isinstance(plan.get("tables"), int) and isinstance(kinds, Mapping):
            if not kinds:  # status names kinds only when a table is not table-wise
                kinds = {"table_wise": plan["tables"]}
            for kind in PLAN_KINDS:
                count = kinds.get(kind, 0)
                self.plan_tables.labels(*key, kind).set(float(count) if count else 0.0)
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

    def observe_live(self, namespace: str, job: str, max_seconds: float, imbalance: float) -> None:
        """The running job's measured figures from its live summary: the slowest rank's
        compute in seconds and the max/mean imbalance (as the loop judges them)."""
        self.measured_max.labels(namespace, job).set(max_seconds)
        self.measured_imbalance.labels(namespace, job).set(imbalance)

    def forget_live(self, namespace: str, job: str) -> None:
        """No current measurement (workers stopped, resharding, a summary of another
        plan): drop the measured series so that no alert fires on stale figures."""
        _remove(self.measured_max, namespace, job)
        _remove(self.measured_imbalance, namespace, job)

    def observe_imbalance_decision(
        self, namespace: str, job: str, decision: str, gain: float | None = None
    ) -> None:
        """One decision of the loop (:data:`IMBALANCE_DECISIONS`); ``gain``: the
        predicted gain of the re-plan it judged, when it made one."""
        if decision not in IMBALANCE_DECISIONS:
            raise ValueError(
                f"imbalance decision {decision!r}: not one of {', '.join(IMBALANCE_DECISIONS)}"
            )
        self.imbalance_decisions.labels(namespace, job, decision).inc()
        self._decisions.setdefault((namespace, job), set()).add(decision)
        if gain is not None:
            self.reshard_gain.labels(namespace, job).set(gain)

    def forget_job(self, namespace: str, job: str) -> None:
        """Remove every series of a deleted job (GPU-type series are shared: kept)."""
        key = (namespace, job)
        self._remove_ranks(namespace, job, 0)
        self._ranks.pop(key, None)
        for reason in self._reasons.pop(key, set()):
            self.reshards.remove(*key, reason)
        for decision in self._decisions.pop(key, set()):
            self.imbalance_decisions.remove(*key, decision)
        for p in PHASES:
            _remove(self.job_phase, *key, p)
        for kind in PLAN_KINDS:
            _remove(self.plan_tables, *key, kind)
        for metric in (
            self.predicted_max,
            self.imbalance,
            self.world_size,
            self.planning,
            self.reshard_duration,
            self.reconcile_errors,
            self.waiting_for_capacity,
            self.measured_max,
            self.measured_imbalance,
            self.reshard_gain,
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
