"""Is the cost model of a GPU type good enough to plan with, and if not, what to do.

A pure decision per GPU type from the published model, this job's profiling Jobs
(attempts ``1, 2, …``; their objects are the record, so a restarted operator knows
how many failed and when) and the clock:

- ``Never``: the published model if there is one, else the bundled one;
- ``IfStale``: a published model younger than ``maxAge`` that covers the job's tables
  (:func:`coverage`: it was calibrated on every one of their signatures) is used as it
  is; one that does not is calibrated again, on this job's tables, unless this job
  already did so for the very same tables (its attempt Job's
  ``shardwise.dev/tables-hash``): a model published since by a job with other tables
  is then used as it is, so two jobs never take turns re-profiling;
- ``Always``: this job profiles once for its tables (a succeeded attempt), then uses
  what it published;
- otherwise attempt ``n + 1`` is created, ``backoffSeconds × 2^(n-1)`` after failure
  ``n``; after ``retries + 1`` failures the job falls back, with a ``Degraded`` reason:
  to the stale published model if there is one (it was at least measured on this GPU
  type), else to the bundled CPU model;
- an attempt whose pod has not started ``startupTimeoutSeconds`` after the Job began
  (unschedulable, image not pulled, pods refused) has failed: waiting for the run
  deadline (``timeoutSeconds``, hours) would hold the job for nothing. The Job is
  marked (annotation) and suspended, so its pods go and a restarted operator counts
  it as failed too;
- an attempt that failed deterministically (the profiler exits 2: the CLI refused its
  settings) is not retried with the same settings: the job falls back at once;
- so is an attempt whose pod the cluster refuses in a way no retry gets past (Pod
  Security, an unknown PriorityClass, a missing ServiceAccount or Secret:
  :attr:`~shardwise.operator.cluster.startup.StartupProblem.recurs`): it is marked and
  suspended at once, not after ``startupTimeoutSeconds``, and profiling waits for the
  spec to change (another pod template), since the same pod would be refused again.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from shardwise import names
from shardwise.operator.cluster.startup import Startup, StartupProblem, startup_deadline
from shardwise.operator.cluster.summaries import JobState, PodFailure, format_time
from shardwise.operator.crd import ProfilingSpec
from shardwise.operator.decide.queueing import queue_of
from shardwise.operator.models.cost_models import CostModelInfo

#: Longest wait between attempts, whatever the backoff doubles to.
MAX_BACKOFF_SECONDS = 3600.0
#: Exit codes retrying cannot fix: the CLI's user errors (bad settings) exit 2.
DETERMINISTIC_EXIT_CODES = frozenset({2})
#: Reasons of the failure mark the operator puts on an attempt Job.
STARTUP_TIMEOUT = "StartupTimeout"
INVALID_SETTINGS = "InvalidSettings"
POD_REFUSED = "PodRefused"
#: The CostModelReady/Degraded reason of a fallback after exhausted retries, and after
#: a deterministic failure.
PROFILING_FAILED = "ProfilingFailed"
INVALID_PROFILING_SETTINGS = "InvalidProfilingSettings"
PROFILING_POD_REFUSED = "ProfilingPodRefused"


@dataclass(frozen=True)
class Coverage:
    """How many of a job's tables a model was calibrated on (by table signature)."""

    covered: int
    of: int

    @property
    def complete(self) -> bool:
        return self.covered == self.of

    def describe(self) -> str:
        return f"calibrated on {self.covered} of this job's {self.of} tables"


def coverage(model: CostModelInfo | None, signatures: Sequence[str]) -> Coverage:
    """The tables (``signatures``: one per table, as
    ``shardwise.planner.tables.table_signature`` gives them) whose signature is among
    those ``model`` was calibrated on. A model without calibration, or none, covers
    none; no tables are always covered."""
    known: Collection[str] = (
        model.calibration.tables if model is not None and model.calibration else ()
    )
    return Coverage(sum(1 for s in signatures if s in known), len(signatures))


def tables_hash(signatures: Sequence[str]) -> str:
    """What identifies a set of tables for profiling: their sorted unique signatures."""
    blob = "\n".join(sorted(set(signatures)))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class State(StrEnum):
    FRESH = "Fresh"  # a published model young enough
    RUNNING = "Running"  # a profiling Job is running
    WAITING = "Waiting"  # backing off before the next attempt, or for the publication
    SUCCEEDED = "Succeeded"  # profiled for this job (Always)
    FAILED = "Failed"  # gave up: fallback model
    SKIPPED = "Skipped"  # policy Never


@dataclass(frozen=True)
class Mark:
    """A failure to record on attempt Job ``job`` (the failure annotation); ``suspend``
    also suspends it, which makes the Job controller delete its pods."""

    job: str
    reason: str
    message: str
    suspend: bool = False


@dataclass(frozen=True)
class _Failure:
    job: JobState
    why: str
    #: Deterministic, with the settings the next attempt would have.
    final: bool
    at: datetime.datetime | None
    #: The cluster refused its pod (rather than the profiler its settings).
    refused: bool = False


@dataclass(frozen=True)
class Decision:
    gpu_type: str
    state: State
    #: The model to plan with once ``ready``; ``None`` means the bundled model.
    model: CostModelInfo | None = None
    #: Create profiling attempt number ``create`` now.
    create: int | None = None
    attempts: int = 0
    job: str | None = None
    next_attempt_at: datetime.datetime | None = None
    message: str = ""
    #: Why the model is second best (becomes the ``Degraded`` condition).
    degraded: str | None = None
    #: The reason of the fallback's conditions (CostModelReady, Degraded).
    fallback_reason: str = PROFILING_FAILED
    #: What keeps the running attempt's pod from starting.
    blocked: StartupProblem | None = None
    #: When to look again though nothing changes (the running attempt's startup deadline).
    check_at: datetime.datetime | None = None
    #: Failures to record on attempt Jobs.
    marks: tuple[Mark, ...] = ()
    #: ``create`` retries a failed attempt (announced as a failure, however soon the
    #: retry is due: a loaded operator may see the failure after its backoff ended).
    retry: bool = False

    @property
    def ready(self) -> bool:
        return self.state in (State.FRESH, State.SUCCEEDED, State.FAILED, State.SKIPPED)

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {
            "gpuType": self.gpu_type,
            "state": str(self.state),
            "attempts": self.attempts,
            "message": self.message,
        }
        if self.job:
            out["job"] = self.job
        if self.next_attempt_at:
            out["nextAttemptAt"] = format_time(self.next_attempt_at)
        return out


def attempt_of(job: JobState) -> int:
    try:
        return int(job.ref.labels.get(names.LABEL_ATTEMPT, "0"))
    except ValueError:
        return 0


def decide(
    gpu_type: str,
    policy: ProfilingSpec,
    model: CostModelInfo | None,
    jobs: Sequence[JobState],
    now: datetime.datetime,
    *,
    publish_grace_seconds: float = 60.0,
    pod_failures: Mapping[str, PodFailure] | None = None,
    startup: Mapping[str, Startup] | None = None,
    settings_hash: str = "",
    tables: Sequence[str] | None = None,
) -> Decision:
    """What to do about ``gpu_type``'s cost model (see the module docstring).

    ``pod_failures`` and ``startup`` are keyed by attempt Job name: the first failing
    pod of a failed attempt, how far a running attempt's pods got. ``settings_hash`` is
    the pod template the next attempt would have (``shardwise.dev/settings-hash``).
    ``tables`` are the job's table signatures (one per table); ``None`` when they are
    unknown, and then coverage is not judged.
    """
    ordered = sorted(jobs, key=attempt_of)
    attempts = attempt_of(ordered[-1]) if ordered else 0
    fresh = model is not None and model.is_fresh(now, policy.max_age_seconds)
    cover = coverage(model, tables) if tables is not None else None
    wanted = tables_hash(tables) if tables is not None else None
    if policy.policy == "Never":
        what = f"the published model {model.describe()}" if model else "the bundled CPU model"
        return Decision(
            gpu_type, State.SKIPPED, model, attempts=attempts, message=f"policy Never: {what}"
        )
    if policy.policy == "IfStale" and fresh and (cover is None or cover.complete):
        assert model is not None
        what = f"; {cover.describe()}" if cover is not None else ""
        return Decision(
            gpu_type, State.FRESH, model, attempts=attempts,
            message=f"fresh: {model.describe()}{what}",
        )  # fmt: skip
    last_success = max((attempt_of(j) for j in ordered if j.complete), default=0)
    failures: list[_Failure] = []
    marks: list[Mark] = []
    for job in ordered:
        name = job.ref.name
        if job.complete and attempt_of(job) == last_success:
            age = (now - job.finished).total_seconds() if job.finished else 0.0
            if policy.policy == "IfStale" and age >= policy.max_age_seconds:
                continue  # an old success whose model has gone stale: profile again
            if wanted is not None and job.ref.annotations.get(names.ANN_TABLES_HASH) != wanted:
                continue  # it calibrated on other tables (the spec changed since)
            published_after = model is not None and (
                job.finished is None
                or model.published_at is None
                or model.published_at >= job.finished - datetime.timedelta(minutes=10)
            )
            if published_after:
                assert model is not None
                msg = f"profiled by {name}: {model.describe()}"
                return Decision(
                    gpu_type, State.SUCCEEDED, model, attempts=attempts, job=name, message=msg
                )
            waited = (now - job.finished).total_seconds() if job.finished else 0.0
            grace = publish_grace_seconds
            if waited < grace:
                return Decision(
                    gpu_type, State.WAITING, model, attempts=attempts, job=name,
                    next_attempt_at=now + datetime.timedelta(seconds=grace - waited),
                    message=f"{name} succeeded; waiting for its published model",
                )  # fmt: skip
            why = f"{name} succeeded but published no {gpu_type} model"
            failures.append(_Failure(job, why, False, job.finished))
        elif attempt_of(job) > last_success and job.failure is not None:
            pod = (pod_failures or {}).get(name)
            why = f"{name}: {job.failure}" + (f"; {pod.describe()}" if pod else "")
            refused = job.failure_reason == POD_REFUSED
            deterministic = job.failure_reason in (INVALID_SETTINGS, POD_REFUSED) or (
                pod is not None and pod.exit_code in DETERMINISTIC_EXIT_CODES
            )
            same = job.ref.annotations.get(names.ANN_SETTINGS_HASH, settings_hash) == settings_hash
            failures.append(_Failure(job, why, deterministic and same, job.finished, refused))
            if deterministic and pod is not None and job.failure_reason != INVALID_SETTINGS:
                # durable: the Job records it even when its pods are gone
                marks.append(Mark(name, INVALID_SETTINGS, f"{job.failure}; {pod.describe()}"))
        elif attempt_of(job) > last_success and not job.done:
            if job.ref.deleting:
                return Decision(
                    gpu_type, State.WAITING, model, attempts=attempts, job=name,
                    message=f"waiting for the stopped attempt {name} to go",
                )  # fmt: skip
            st = (startup or {}).get(name, Startup(False))
            if not st.started and st.problem is not None and st.problem.recurs:
                msg = (
                    "its pod is refused, and would be again however long it waited: "
                    + st.problem.with_fields(names.COMPONENT_PROFILER)
                )
                marks.append(Mark(name, POD_REFUSED, msg, suspend=True))
                same = job.ref.annotations.get(names.ANN_SETTINGS_HASH, settings_hash) == (
                    settings_hash
                )
                failures.append(_Failure(job, f"{name}: {POD_REFUSED}: {msg}", same, now, True))
                continue
            deadline = None if st.started else startup_deadline(job, policy.startup_timeout_seconds)
            limit = f"spec.profiling.startupTimeoutSeconds: {policy.startup_timeout_seconds}"
            if deadline is not None and now >= deadline:
                cause = f"; {st.problem.describe()}" if st.problem else ""
                msg = f"no pod started within {policy.startup_timeout_seconds} s ({limit}){cause}"
                marks.append(Mark(name, STARTUP_TIMEOUT, msg, suspend=True))
                failures.append(_Failure(job, f"{name}: {STARTUP_TIMEOUT}: {msg}", False, now))
                continue
            msg = f"profiling {gpu_type} with {name}"
            queue = queue_of(job)
            if queue and job.suspended:  # Kueue unsuspends it when the quota admits it
                msg = f"{name} waits in LocalQueue {queue} for Kueue to admit it ({gpu_type})"
            if st.problem is not None:
                msg += f": {st.problem.describe()}"
                if deadline is not None:
                    msg += f"; the attempt fails at {format_time(deadline)} ({limit})"
            return Decision(
                gpu_type, State.RUNNING, model, attempts=attempts, job=name, message=msg,
                blocked=st.problem, check_at=deadline, marks=tuple(marks),
            )  # fmt: skip
    if failures and failures[-1].final:
        # Not retried with the same settings: the pod is refused, or the profiler is.
        last = failures[-1]
        fallback, why = _fallback(model)
        if last.refused:
            reason, said = (
                PROFILING_POD_REFUSED,
                (
                    f"profiling {gpu_type} cannot start: {last.why}; no attempt is made again "
                    "with the same pod (a change to its spec.template or spec.profiling settings "
                    "starts one)"
                ),
            )
        else:
            reason, said = (
                INVALID_PROFILING_SETTINGS,
                (
                    f"profiling {gpu_type} failed deterministically and is not retried with the "
                    "same settings (the profiler refused them: fix spec.profiling or the "
                    f"profiling image): {last.why}"
                ),
            )
        degraded = f"{said}; planning with {why}"
        return Decision(
            gpu_type, State.FAILED, fallback, attempts=attempts, job=last.job.ref.name,
            message=degraded, degraded=degraded, fallback_reason=reason, marks=tuple(marks),
        )  # fmt: skip
    if len(failures) >= policy.retries + 1:
        last = failures[-1]
        fallback, why = _fallback(model)
        n = len(failures)
        degraded = (
            f"profiling {gpu_type} failed {n} time(s) (last: {last.why}); planning with {why}"
        )
        return Decision(
            gpu_type, State.FAILED, fallback, attempts=attempts, job=last.job.ref.name,
            message=degraded, degraded=degraded, marks=tuple(marks),
        )  # fmt: skip
    if failures:
        last = failures[-1]
        delay = min(MAX_BACKOFF_SECONDS, policy.backoff_seconds * 2 ** (len(failures) - 1))
        due = (last.at or now) + datetime.timedelta(seconds=delay)
        if now < due:
            return Decision(
                gpu_type, State.WAITING, model, attempts=attempts, job=last.job.ref.name,
                next_attempt_at=due, marks=tuple(marks),
                message=f"attempt {attempts} failed ({last.why}); retrying at {format_time(due)}",
            )  # fmt: skip
        return Decision(
            gpu_type, State.RUNNING, model, create=attempts + 1, attempts=attempts + 1,
            marks=tuple(marks), retry=True,
            message=f"attempt {attempts} failed ({last.why}); starting attempt {attempts + 1}",
        )  # fmt: skip
    if policy.policy == "Always":
        reason = "policy Always"
    elif model is None:
        reason = "no published cost model"
    elif not fresh:
        reason = "stale cost model"
    else:
        assert cover is not None  # fresh, and IfStale did not take it: not covered
        reason = f"the published model is {cover.describe()}"
    return Decision(
        gpu_type, State.RUNNING, model, create=attempts + 1, attempts=attempts + 1,
        message=f"profiling {gpu_type} ({reason})", marks=tuple(marks),
    )  # fmt: skip


def _fallback(model: CostModelInfo | None) -> tuple[CostModelInfo | None, str]:
    if model is not None:
        return model, f"the stale published model {model.describe()}"
    return None, "the bundled CPU model"
