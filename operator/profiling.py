"""Is the cost model of a GPU type good enough to plan with, and if not, what to do.

A pure decision per GPU type from the published model, this job's profiling Jobs
(attempts ``1, 2, …``; their objects are the record, so a restarted operator knows
how many failed and when) and the clock:

- ``Never``: the published model if there is one, else the bundled one;
- ``IfStale``: a published model younger than ``maxAge`` is used as it is;
- ``Always``: this job profiles once (a succeeded attempt), then uses what it published;
- otherwise attempt ``n + 1`` is created, ``backoffSeconds × 2^(n-1)`` after failure
  ``n``; after ``retries + 1`` failures the job falls back, with a ``Degraded`` reason:
  to the stale published model if there is one (it was at least measured on this GPU
  type), else to the bundled CPU model.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from shardwise.operator import constants as c
from shardwise.operator.costmodels import CostModelInfo
from shardwise.operator.crd import ProfilingSpec
from shardwise.operator.observe import JobState, format_time

#: Longest wait between attempts, whatever the backoff doubles to.
MAX_BACKOFF_SECONDS = 3600.0


class State(StrEnum):
    FRESH = "Fresh"  # a published model young enough
    RUNNING = "Running"  # a profiling Job is running
    WAITING = "Waiting"  # backing off before the next attempt, or for the publication
    SUCCEEDED = "Succeeded"  # profiled for this job (Always)
    FAILED = "Failed"  # gave up: fallback model
    SKIPPED = "Skipped"  # policy Never


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
        return int(job.ref.labels.get(c.LABEL_ATTEMPT, "0"))
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
    pod_failures: Mapping[str, str] | None = None,
) -> Decision:
    """What to do about ``gpu_type``'s cost model (see the module docstring)."""
    ordered = sorted(jobs, key=attempt_of)
    attempts = attempt_of(ordered[-1]) if ordered else 0
    fresh = model is not None and model.is_fresh(now, policy.max_age_seconds)
    if policy.policy == "Never":
        what = f"the published model {model.describe()}" if model else "the bundled CPU model"
        return Decision(
            gpu_type, State.SKIPPED, model, attempts=attempts, message=f"policy Never: {what}"
        )
    if policy.policy == "IfStale" and fresh:
        assert model is not None
        return Decision(
            gpu_type, State.FRESH, model, attempts=attempts, message=f"fresh: {model.describe()}"
        )
    last_success = max((attempt_of(j) for j in ordered if j.complete), default=0)
    failures: list[tuple[JobState, str]] = []
    for job in ordered:
        if job.complete and attempt_of(job) == last_success:
            age = (now - job.finished).total_seconds() if job.finished else 0.0
            if policy.policy == "IfStale" and age >= policy.max_age_seconds:
                continue  # an old success whose model has gone stale: profile again
            published_after = model is not None and (
                job.finished is None
                or model.published_at is None
                or model.published_at >= job.finished - datetime.timedelta(minutes=10)
            )
            if published_after:
                assert model is not None
                msg = f"profiled by {job.ref.name}: {model.describe()}"
                return Decision(
                    gpu_type,
                    State.SUCCEEDED,
                    model,
                    attempts=attempts,
                    job=job.ref.name,
                    message=msg,
                )
            waited = (now - job.finished).total_seconds() if job.finished else 0.0
            grace = publish_grace_seconds
            if waited < grace:
                return Decision(
                    gpu_type, State.WAITING, model, attempts=attempts, job=job.ref.name,
                    next_attempt_at=now + datetime.timedelta(seconds=grace - waited),
                    message=f"{job.ref.name} succeeded; waiting for its published model",
                )  # fmt: skip
            failures.append((job, f"{job.ref.name} succeeded but published no {gpu_type} model"))
        elif attempt_of(job) > last_success and job.failure is not None:
            detail = (pod_failures or {}).get(job.ref.name)
            failures.append(
                (job, f"{job.ref.name}: {job.failure}" + (f"; {detail}" if detail else ""))
            )
        elif attempt_of(job) > last_success and not job.done:
            return Decision(
                gpu_type, State.RUNNING, model, attempts=attempts, job=job.ref.name,
                message=f"profiling {gpu_type} with {job.ref.name}",
            )  # fmt: skip
    if len(failures) >= policy.retries + 1:
        last = failures[-1][1]
        if model is not None:
            fallback, why = model, f"the stale published model {model.describe()}"
        else:
            fallback, why = None, "the bundled CPU model"
        n = len(failures)
        degraded = f"profiling {gpu_type} failed {n} time(s) (last: {last}); planning with {why}"
        return Decision(
            gpu_type, State.FAILED, fallback, attempts=attempts, job=failures[-1][0].ref.name,
            message=degraded, degraded=degraded,
        )  # fmt: skip
    if failures:
        job, why = failures[-1]
        delay = min(MAX_BACKOFF_SECONDS, policy.backoff_seconds * 2 ** (len(failures) - 1))
        due = (job.finished or now) + datetime.timedelta(seconds=delay)
        if now < due:
            return Decision(
                gpu_type, State.WAITING, model, attempts=attempts, job=job.ref.name,
                next_attempt_at=due,
                message=f"attempt {attempts} failed ({why}); retrying at {format_time(due)}",
            )  # fmt: skip
        return Decision(
            gpu_type, State.RUNNING, model, create=attempts + 1, attempts=attempts + 1,
            message=f"attempt {attempts} failed ({why}); starting attempt {attempts + 1}",
        )  # fmt: skip
    reason = "stale" if model is not None else "missing"
    if policy.policy == "Always":
        reason = "policy Always"
    return Decision(
        gpu_type, State.RUNNING, model, create=attempts + 1, attempts=attempts + 1,
        message=f"profiling {gpu_type} ({reason} cost model)",
    )  # fmt: skip
