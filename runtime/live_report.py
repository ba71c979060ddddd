"""Rank 0's live summary: every rank's measured cost, gathered and written to a ConfigMap.

The operator learns what the running job really costs from one small object per job:
rank 0 writes :class:`~shardwise.planner.live.summary.LiveSummary` as JSON under
``names.LIVE_KEY`` in the ConfigMap named by ``SHARDWISE_LIVE_CONFIGMAP`` (the operator
creates it with the worker Job and watches it). Unset, nothing is gathered, probed or
written: the loop pays nothing.

- **Gathering.** Every ``report_every`` steps (a step number, so every rank joins the
  same collective) each rank sends its :class:`RankCost` (the medians of its sampled
  steps, :mod:`.live_cost`), its shards' probed costs (:mod:`.shard_probe`) and its
  probe's figures with ``all_gather_object`` over the training group. Rank 0 builds the
  summary, and writes it when ``min_interval`` seconds have passed since its last
  write (an update wakes the operator: one every 15 s at most by default).
- **Probe windows, aligned.** A probe window on one rank delays every rank (they meet
  in the next all-to-all), so the ranks probe the *same* step: at each gathering every
  rank sees every rank's budget check, and the step after it is probed only if all
  pass. Windows then overlap instead of adding up, and at most one runs per
  ``report_every`` steps.
- **Writing never stops training.** A thread of rank 0 writes the newest summary with a
  merge PATCH (creating the ConfigMap, owned by the DLRMJob, if it is absent); the
  training loop only hands it the text. A write that fails is one warning on rank 0's
  stderr naming the status and the fix (the worker's service account needs ``get``
  and ``patch`` on configmaps), and training goes on; it never raises.
- **The last figures.** Before a stop's checkpoint and at the end of the run every rank
  gathers once more and rank 0 hands the summary over at once; it is written while the
  checkpoint is saved, and :meth:`LiveReporter.close` waits (bounded) for the write.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise import names
from shardwise.basics import UserError
from shardwise.planner.live.summary import LiveSummary, ProbeStats, RankCost, ShardCost
from shardwise.runtime.env import WorkerEnv
from shardwise.runtime.live_cost import WorkerMetrics
from shardwise.runtime.shard_probe import ShardProbe

#: Gather every N steps (0: no live summary).
DEFAULT_REPORT_EVERY = 20
#: Rank 0 writes at most once per this many seconds (the final write excepted).
DEFAULT_MIN_INTERVAL = 15.0
#: One API request's bound (connect, read) in seconds.
REQUEST_TIMEOUT = (3.0, 5.0)
#: How long the end of the run waits for the last write.
FLUSH_TIMEOUT = 10.0
#: The service-account namespace file, when ``SHARDWISE_NAMESPACE`` is unset.
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class LiveTarget:
    """Where the summary goes: the ConfigMap, and the DLRMJob that owns it."""

    namespace: str
    configmap: str
    job: str = ""
    job_uid: str | None = None

    @classmethod
    def from_env(cls, env: WorkerEnv) -> LiveTarget | None:
        """The target the operator named, or None (no summary) when it named none."""
        if not env.live_configmap:
            return None
        namespace = env.namespace
        if not namespace and os.path.exists(SA_NAMESPACE):
            with open(SA_NAMESPACE) as f:
                namespace = f.read().strip()
        return cls(namespace, env.live_configmap, env.job, env.job_uid)


def configmap_body(target: LiveTarget, text: str) -> dict[str, Any]:
    """The live ConfigMap as the operator would create it: the job's labels, owned by the
    DLRMJob when its uid is known (without ``blockOwnerDeletion``, which needs a
    permission on the DLRMJob the workers do not have)."""
    meta: dict[str, Any] = {
        "name": target.configmap,
        "namespace": target.namespace,
        "labels": {names.LABEL_COMPONENT: names.COMPONENT_LIVE},
    }
    if target.job:
        meta["labels"][names.LABEL_JOB] = target.job
    if target.job and target.job_uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": names.API_VERSION,
                "kind": names.KIND,
                "name": target.job,
                "uid": target.job_uid,
                "controller": True,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {names.LIVE_KEY: text},
    }


def _fix(target: LiveTarget) -> str:
    return (
        f"the worker pods' service account needs get and patch (and create) on configmaps "
        f"in namespace {target.namespace!r} (the chart's shardwise-worker Role grants them)"
    )


class ConfigMapWriter:
    """Writes the newest summary in a thread of its own; never raises, warns once.

    ``api``: a function returning a ``CoreV1Api`` (default: the pod's service account,
    else the kubeconfig), called in the thread when the first write is due."""

    def __init__(
        self,
        target: LiveTarget,
        *,
        api: Callable[[], Any] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self._api_factory = api
        self._api: Any = None
        self._warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.warned = False
        self.writes = 0
        self.failures = 0

    def connect(self) -> None:
        """Import the client and read its configuration now, before training: about a
        second of CPU that would otherwise land in the steps around the first write. A
        failure here is retried (and warned about) at the first write. (The import
        adds some 90,000 objects; the trainer's collection before its loop keeps the
        collector's full pass out of the steps.)"""
        try:
            self._api = (self._api_factory or _default_api)()
        except Exception:  # the first write says what is wrong
            self._api = None

    def submit(self, text: str) -> None:
        """Hand over the newest summary (an older one not yet written is dropped)."""
        with self._cond:
            if self._closed:
                return
            self._pending = text
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="shardwise-live-summary", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Wait until what was submitted is written (or failed); False on the timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = FLUSH_TIMEOUT) -> bool:
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                text, self._pending, self._busy = self._pending, None, True
            try:
                self._write(text)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, text: str) -> None:
        target = self.target
        try:
            if self._api is None:
                self._api = (self._api_factory or _default_api)()
            self.write_once(self._api, text)
        except Exception as err:  # a write never stops training
            self.failures += 1
            if not self.warned:
                self.warned = True
                self._warn(
                    f"warning: cannot write the live summary to ConfigMap "
                    f"{target.namespace}/{target.configmap} ({_describe(err)}); training goes "
                    f"on without it. To fix: {_fix(target)}; or leave "
                    f"{names.ENV_LIVE_CONFIGMAP} unset to write none."
                )
            return
        if self.warned and self.failures and self.writes == 0:
            self._warn(f"note: the live summary is written to {target.configmap} again")
        self.writes += 1

    def write_once(self, api: Any, text: str) -> None:
        """Merge-patch the summary into the ConfigMap; create it when absent (404), and
        patch again if someone created it meanwhile (409)."""
        from kubernetes.client.exceptions import ApiException

        t = self.target
        patch = {"data": {names.LIVE_KEY: text}}
        kwargs = {"_request_timeout": REQUEST_TIMEOUT}
        merge = "application/merge-patch+json"
        try:
            api.patch_namespaced_config_map(
                t.configmap, t.namespace, patch, _content_type=merge, **kwargs
            )
            return
        except ApiException as err:
            if err.status != 404:
                raise
        try:
            api.create_namespaced_config_map(t.namespace, configmap_body(t, text), **kwargs)
        except ApiException as err:
            if err.status != 409:
                raise
            api.patch_namespaced_config_map(
                t.configmap, t.namespace, patch, _content_type=merge, **kwargs
            )


def _default_api() -> Any:
    from shardwise.apiclient import core_v1_api

    return core_v1_api()


def _describe(err: BaseException) -> str:
    status = getattr(err, "status", None)
    if status:
        reason = getattr(err, "reason", "") or ""
        return f"HTTP {status} {reason}".strip()
    if isinstance(err, UserError):
        return str(err)
    return f"{type(err).__name__}: {str(err)[:200]}"


def rank_cost(
    rank: int, metrics: WorkerMetrics, pod: str, probe_shards: int = 0, empty_ms: float = 0.0
) -> RankCost:
    """This rank's medians in milliseconds, how many shards its probe can time (0: no
    probe), so a reader knows when every shard has a figure, and what its kernels cost
    with every bag empty (the probe's reference call; 0: not yet timed)."""
    m = metrics.medians()
    return RankCost(
        rank=rank,
        pod=pod,
        samples=metrics.window_samples(),
        fwd_compute_ms=1e3 * m.get("fwd_compute", 0.0),
        bwd_compute_ms=1e3 * m.get("bwd_compute", 0.0),
        fwd_comm_ms=1e3 * m.get("fwd_comm", 0.0),
        bwd_comm_ms=1e3 * m.get("bwd_comm", 0.0),
        step_ms=1e3 * metrics.step_median(),
        probe_shards=probe_shards,
        probe_empty_ms=empty_ms,
    )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class RunFacts:
    """What the summary says about the run itself."""

    plan_hash: str
    world_size: int
    batch_size_per_rank: int
    device: str
    steps: int
    start_step: int = 0
    resume_seconds: float = 0.0


class LiveReporter:
    """The training loop's side: :meth:`start_step` before the forward,
    :meth:`after_step` after the step (probe window, gathering), :meth:`final` before
    a stop's checkpoint and at the end, :meth:`close` last. A collective every
    ``report_every`` steps and in :meth:`final`: call them on every rank alike."""

    def __init__(
        self,
        env: WorkerEnv,
        target: LiveTarget,
        facts: RunFacts,
        metrics: WorkerMetrics,
        *,
        group: Any = None,
        probe: ShardProbe | None = None,
        report_every: int = DEFAULT_REPORT_EVERY,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        writer: ConfigMapWriter | None = None,
    ) -> None:
        if report_every < 1:
            raise UserError(f"report_every must be at least 1, not {report_every}.")
        self.env, self.target, self.facts, self.metrics = env, target, facts, metrics
        self.group, self.probe = group, probe
        self.report_every, self.min_interval = report_every, min_interval
        # the pod's name (a pod's hostname; $HOSTNAME where processes share a host)
        self.pod = os.environ.get("HOSTNAME") or socket.gethostname()
        self.writer = (writer or ConfigMapWriter(target)) if env.rank == 0 else None
        if self.writer is not None:
            self.writer.connect()
        self.first_step_at = ""
        self.last: LiveSummary | None = None
        self._last_write: float | None = None
        self._probe_next = False
        self._final_step: int | None = None
        #: Seconds spent gathering and building summaries (all steps).
        self.seconds = 0.0

    def start_step(self, step: int) -> None:
        if self.probe is not None:
            self.probe.start_step(self._probe_next)
            self._probe_next = False

    def after_step(self, step: int, train_seconds: float) -> None:
        if not self.first_step_at:
            self.first_step_at = _now()
        if self.probe is not None:
            self.probe.train_seconds = train_seconds
            self.probe.finish_step()
        if step % self.report_every == 0:
            self._report(step, force=False)

    def final(self, step: int, train_seconds: float) -> None:
        """Gather and write at once (before a stop's checkpoint, at the end)."""
        if self._final_step == step:
            return
        self._final_step = step
        if self.probe is not None:
            self.probe.train_seconds = train_seconds
        self._report(step, force=True)

    def close(self, timeout: float = FLUSH_TIMEOUT) -> None:
        if self.probe is not None:
            self.probe.close()
        if self.writer is not None:
            self.writer.close(timeout)

    def figures(self) -> dict[str, Any]:
        """This rank's own account, for the trainer's run summary."""
        stats = self.probe.stats() if self.probe is not None else ProbeStats()
        return {
            "probe_seconds": stats.seconds,
            "probe_windows": stats.windows,
            "train_seconds": stats.train_seconds,
            "report_seconds": self.seconds,
            "writes": self.writer.writes if self.writer is not None else 0,
            "write_failures": self.writer.failures if self.writer is not None else 0,
        }

    # ------------------------------------------------------------------ internals
    def _message(self) -> dict[str, Any]:
        held = sum(len(k.shards) for k in self.probe.kernels) if self.probe is not None else 0
        shards: list[ShardCost] = []
        stats = ProbeStats()
        ok = True
        empty = 0.0
        if self.probe is not None:
            medians = self.metrics.medians()
            fwd, bwd = medians.get("fwd_compute", 0.0), medians.get("bwd_compute", 0.0)
            if fwd > 0:
                shards = self.probe.shard_costs(bwd / fwd)
                empty = self.probe.empty_ms(bwd / fwd)
            stats = self.probe.stats()
            # a window replays what the kernels run: forward, and backward where it can
            ok = self.probe.allowed((fwd + bwd if self.probe.times_backward else fwd) or None)
        cost = rank_cost(self.env.rank, self.metrics, self.pod, held, empty)
        return {
            "rank": cost.model_dump(by_alias=True),
            "shards": [s.model_dump(by_alias=True) for s in shards],
            "probe": stats.model_dump(by_alias=True),
            "probe_ok": ok,
        }

    def _report(self, step: int, *, force: bool) -> None:
        t0 = time.perf_counter()
        mine = self._message()
        gathered: list[Any] = [None] * self.env.world_size
        if self.env.world_size > 1:
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        # Every rank sees the same list, so every rank takes the same decision.
        self._probe_next = self.probe is not None and all(m["probe_ok"] for m in gathered)
        now = time.monotonic()
        due = self._last_write is None or now - self._last_write >= self.min_interval
        if self.writer is not None and (force or due):
            # Written meanwhile (a stop's checkpoint goes on); close() waits for it.
            self.last = self.summary(step, gathered)
            self.writer.submit(self.last.to_json())
            self._last_write = now
        self.seconds += time.perf_counter() - t0

    def summary(self, step: int, gathered: list[dict[str, Any]]) -> LiveSummary:
        f = self.facts
        probes = [ProbeStats.model_validate(m["probe"]) for m in gathered]
        return LiveSummary(
            plan_hash=f.plan_hash,
            world_size=f.world_size,
            batch_size_per_rank=f.batch_size_per_rank,
            device=f.device,
            step=step,
            steps=f.steps,
            start_step=f.start_step,
            resume_seconds=f.resume_seconds,
            first_step_at=self.first_step_at,
            written_at=_now(),
            ranks=sorted(
                (RankCost.model_validate(m["rank"]) for m in gathered), key=lambda r: r.rank
            ),
            shards=sorted(
                (ShardCost.model_validate(s) for m in gathered for s in m["shards"]),
                key=lambda s: (s.rank, s.table, s.row_offset, s.col_offset),
            ),
            # The rank whose probe took the largest share of its training time.
            probe=max(probes, key=lambda p: p.overhead),
        )


def live_reporter(
    env: WorkerEnv,
    facts: RunFacts,
    metrics: WorkerMetrics,
    sharded_collection: Any,
    *,
    group: Any = None,
    report_every: int = DEFAULT_REPORT_EVERY,
    probe: bool = True,
    min_interval: float = DEFAULT_MIN_INTERVAL,
) -> LiveReporter | None:
    """The trainer's reporter (with the shard probe when ``probe``), or None when the
    operator named no live ConfigMap or ``report_every`` is 0: nothing is gathered."""
    target = LiveTarget.from_env(env)
    if target is None or report_every == 0:
        return None
    shard_probe = None
    if probe:
        shard_probe = ShardProbe(sharded_collection, rank=env.rank, cuda=facts.device == "cuda")
    return LiveReporter(
        env,
        target,
        facts,
        metrics,
        group=group,
        probe=shard_probe,
        report_every=report_every,
        min_interval=min_interval,
    )
