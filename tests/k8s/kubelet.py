"""A kubelet stand-in that runs the pods bound to local nodes as local processes, and
:class:`LocalCluster`, which runs it beside the Job controller (:mod:`k8s.jobcontroller`)
and the scheduler (:mod:`k8s.scheduler`) against the API emulator, so that a DLRMJob's
workers really train.

Local nodes are those created with :func:`k8s.helpers.add_local_node` (annotation
:data:`k8s.helpers.LOCAL_NODE`). For each pod bound to one, :class:`LocalKubelet`:

- starts the container as a process in a session of its own (:mod:`k8s.podspec` says
  how a pod becomes one: command, env, volumes as directories with the mount paths
  rewritten to them, cluster DNS names rewritten to 127.0.0.1 and a port per Job),
  stdout and stderr in ``<root>/logs/<namespace>_<pod>.log``;
- status: ``Running`` (container running, ``Ready``) once started, then ``Succeeded``
  or ``Failed`` with the exit code (128 + signal when killed), ``Completed``/``Error``
  and, for ``FallbackToLogsOnError``, the log's last 80 lines (at most 2048 bytes) as
  the termination message; a command that cannot start fails with ``StartError``; a
  pod it cannot start yet waits: in ``CreateContainerConfigError`` for an env var of a
  missing Secret or ConfigMap key, in ``ContainerCreating`` for a missing volume;
- deletion: on a ``deletionTimestamp`` SIGTERM to the main process (what a container
  runtime signals), SIGKILL to every process of the pod after the grace period
  (``deletionGracePeriodSeconds``, else ``terminationGracePeriodSeconds``), then the
  terminal status and the kubelet's final ``DELETE`` (grace 0, uid precondition) that
  removes the object. A pod removed from the API meanwhile (force delete, its node
  deleted) has its processes killed at once. When the main process exits, what it
  left behind is killed, as a container's PID namespace ends.

The emulator confirms the deletion of a pod on a Ready node at once (it has no
kubelet); :func:`wait_for_local_kubelets` makes it leave pods on local nodes to this
one, so a Job deleted in the Foreground stays until its workers have checkpointed and
exited, as on a cluster. A pod's processes are found as a cgroup would hold them: by
the marker variable (:data:`k8s.podspec.MARKER`) every descendant inherits, and the
process tree; :meth:`LocalKubelet.shutdown` leaves none behind.

Not done: images (the host's Python runs everything), restarts (restartPolicy is taken
as Never), init and sidecar containers, probes (Ready as soon as started), resource
limits, node heartbeats and NotReady behaviour (pods run whatever the node's
condition), pods on nodes that are not local (left to the test, as before).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from k8s.emulator import ApiEmulator
from k8s.helpers import LOCAL_NODE, now
from k8s.jobcontroller import JobController, controller_uid, deleting, meta, terminal
from k8s.kinds import NODES
from k8s.podspec import MARKER, ConfigError, PodError, PodSpecs
from k8s.scheduler import schedule
from shardwise.operator.kube import ApiError, KubeApi, resource_path
from shardwise.runtime.launch import process_tree

LOG_LINES, LOG_BYTES = 80, 2048


def is_local(node: Mapping[str, Any]) -> bool:
    return (meta(node).get("annotations") or {}).get(LOCAL_NODE) == "true"


def wait_for_local_kubelets(monkeypatch: pytest.MonkeyPatch) -> None:
    """For this test, the emulator leaves the deletion of a pod on a local node to the
    local kubelet (it confirms at once for other Ready nodes): the pod stays
    Terminating while its processes stop, as on a cluster."""
    original = ApiEmulator._kubelet_alive

    def alive(self: ApiEmulator, node: str) -> bool:
        obj = self._store.get((NODES, None, node))
        return False if obj is not None and is_local(obj) else original(self, node)

    monkeypatch.setattr(ApiEmulator, "_kubelet_alive", alive)


def pids_of(uid: str, main: int | None) -> list[int]:
    """Every live process of the pod: its marker in the environment, or below ``main``."""
    wanted = f"{MARKER}={uid}".encode()
    found = set(process_tree(main)) if main is not None else set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
    return sorted(found)


def kill_all(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def log_tail(path: Path) -> str:
    """What FallbackToLogsOnError keeps: the last 80 lines, at most 2048 bytes."""
    data = path.read_bytes() if path.exists() else b""
    tail = b"\n".join(data.rstrip(b"\n").split(b"\n")[-LOG_LINES:])[-LOG_BYTES:]
    return tail.decode(errors="replace")


@dataclass
class PodRun:
    """One pod's container, started by the local kubelet."""

    uid: str
    namespace: str
    name: str
    log: Path
    argv: list[str]
    env: dict[str, str]
    cwd: str
    job: str = ""
    node: str = ""
    owner: str = ""  # the controller's uid (the Job's)
    popen: subprocess.Popen[bytes] | None = None
    started: str = ""
    finished: str = ""
    #: time.monotonic() at the start and at the exit (for tests that order events)
    started_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    term_at: float | None = None
    kill_at: float | None = None
    reported: bool = False
    gone: bool = False
    history: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.exit_code is None


class LocalKubelet:
    """Runs the pods bound to local nodes (see the module docstring); :meth:`sync` is
    one pass over the pods the API lists."""

    def __init__(
        self,
        kube: KubeApi,
        url: str,
        root: Path,
        tokens: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        self.kube, self.root = kube, root
        self.specs = PodSpecs(kube, url, root, tokens)
        self.runs: dict[str, PodRun] = {}
        self.problems: dict[str, str] = {}  # pod → why it cannot start (yet)
        (root / "logs").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ the pass
    def sync(self, pods: Sequence[Mapping[str, Any]], nodes: Sequence[Mapping[str, Any]]) -> None:
        local = {meta(n)["name"] for n in nodes if is_local(n)}
        listed = {}
        for pod in pods:
            if (pod.get("spec") or {}).get("nodeName") not in local:
                continue
            uid = meta(pod)["uid"]
            listed[uid] = pod
            run = self.runs.get(uid)
            if run is None:
                if deleting(pod):
                    self._confirm(pod)
                elif not terminal(pod):
                    self._start(pod)
                continue
            self._watch(run, pod)
        for uid, run in list(self.runs.items()):
            if uid in listed or run.gone:
                continue
            run.gone = True  # removed from the API (forced, or its node deleted)
            if run.running and run.popen is not None:
                self._note(run, "removed from the API: SIGKILL")
                kill_all(pids_of(uid, run.popen.pid))
                run.popen.wait()
                self._exited(run)

    def _watch(self, run: PodRun, pod: Mapping[str, Any]) -> None:
        assert run.popen is not None
        if run.exit_code is None and run.popen.poll() is not None:
            self._exited(run)
        if deleting(pod) and run.running and run.term_at is None:
            grace = meta(pod).get("deletionGracePeriodSeconds")
            if grace is None:
                grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            run.term_at, run.kill_at = time.monotonic(), time.monotonic() + float(grace)
            self._note(run, f"deleted: SIGTERM, SIGKILL in {grace} s")
            kill_all([run.popen.pid], signal.SIGTERM)
        if run.running and run.kill_at is not None and time.monotonic() >= run.kill_at:
            self._note(run, "grace period over: SIGKILL")
            kill_all(pids_of(run.uid, run.popen.pid))
            run.popen.wait()
            self._exited(run)
        if run.exit_code is not None and not run.reported:
            self._report(run, pod)
        if run.exit_code is not None and run.reported and deleting(pod):
            self._confirm(pod)

    # ------------------------------------------------------------------ starting
    def _start(self, pod: Mapping[str, Any]) -> None:
        m = meta(pod)
        key = f"{m['namespace']}/{m['name']}"
        try:
            process = self.specs.process(pod)
        except PodError as err:
            if self.problems.get(key) != str(err):
                self.problems[key] = str(err)
                reason = (
                    "CreateContainerConfigError" if isinstance(err, ConfigError)
                    else "ContainerCreating"
                )  # fmt: skip
                waiting = {"reason": reason, "message": str(err)}
                self._status(pod, "Pending", {"waiting": waiting}, ready=False)
            return
        self.problems.pop(key, None)
        spec = pod.get("spec") or {}
        run = PodRun(
            uid=m["uid"],
            namespace=m["namespace"],
            name=m["name"],
            log=self.root / "logs" / f"{m['namespace']}_{m['name']}.log",
            argv=process.argv,
            env=process.env,
            cwd=process.cwd,
            job=str((m.get("labels") or {}).get("batch.kubernetes.io/job-name", "")),
            node=str(spec.get("nodeName", "")),
            owner=controller_uid(pod) or "",
        )
        self.runs[run.uid] = run
        with run.log.open("ab") as log:
            try:
                run.popen = subprocess.Popen(
                    run.argv,
                    env=run.env,
                    cwd=run.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as err:
                run.exit_code = 128
                term = {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(err),
                    "startedAt": now(),
                    "finishedAt": now(),
                }
                self._status(pod, "Failed", {"terminated": term}, ready=False)
                run.reported = True
                return
        run.started, run.started_at = now(), time.monotonic()
        self._note(run, f"started pid {run.popen.pid}: {' '.join(run.argv)}")
        self._status(pod, "Running", {"running": {"startedAt": run.started}}, ready=True)

    # ------------------------------------------------------------------ finishing
    def _exited(self, run: PodRun) -> None:
        assert run.popen is not None
        rc = run.popen.wait()
        run.exit_code = rc if rc >= 0 else 128 - rc
        run.finished, run.exited_at = now(), time.monotonic()
        kill_all(pids_of(run.uid, None))  # the rest of the "container" goes with its init
        self._note(run, f"exited {run.exit_code}")

    def _report(self, run: PodRun, pod: Mapping[str, Any]) -> None:
        code = int(run.exit_code or 0)
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.started,
            "finishedAt": run.finished,
            "containerID": f"local://{run.popen.pid if run.popen else 0}",
        }
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        if code and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            term["message"] = log_tail(run.log)
        self._status(pod, "Succeeded" if code == 0 else "Failed", {"terminated": term}, False)
        run.reported = True

    def _status(
        self, pod: Mapping[str, Any], phase: str, state: dict[str, Any], ready: bool
    ) -> None:
        m, spec = meta(pod), pod.get("spec") or {}
        c = (spec.get("containers") or [{}])[0]
        stamp = now()
        flag = "True" if ready else "False"
        why = {} if ready or phase == "Pending" else {"reason": "PodCompleted"}
        conds = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp, **why},
            {"type": "Ready", "status": flag, "lastTransitionTime": stamp, **why},
        ]
        started = (pod.get("status") or {}).get("startTime") or stamp
        status = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": started,
            "conditions": conds,
            "containerStatuses": [
                {
                    "name": c.get("name", ""),
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": ready,
                    "started": "running" in state,
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        with contextlib.suppress(ApiError):  # gone meanwhile
            self.kube.patch("v1", "pods", m["namespace"], m["name"], {"status": status}, "status")

    def _confirm(self, pod: Mapping[str, Any]) -> None:
        """The kubelet's last word on a deleted pod: remove it (grace 0, this uid)."""
        m = meta(pod)
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": m["uid"]},
        }
        try:
            self.kube.request(
                "DELETE", resource_path("v1", "pods", m["namespace"], m["name"]), body=body
            )
        except ApiError as err:
            if err.status not in (404, 409):
                raise

    # ------------------------------------------------------------------ for tests
    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The host directory standing for the claim's volume."""
        return self.specs.pvc_dir(namespace, claim)

    def log(self, pod: str, namespace: str | None = None) -> str:
        """A pod's output so far ("" before it started)."""
        for run in list(self.runs.values()):
            if run.name == pod and namespace in (None, run.namespace):
                return run.log.read_text(errors="replace") if run.log.exists() else ""
        return ""

    def logs(self, last: int = 0) -> str:
        """Every pod's output (its last ``last`` lines each when given), with headers."""
        parts = []
        for run in list(self.runs.values()):
            text = run.log.read_text(errors="replace") if run.log.exists() else ""
            lines = text.splitlines()[-last:] if last else text.splitlines()
            parts.append(
                f"===== pod {run.namespace}/{run.name} (exit {run.exit_code}; "
                f"{'; '.join(run.history)})\n" + "\n".join(lines)
            )
        return "\n".join(parts)

    def _note(self, run: PodRun, what: str) -> None:
        run.history.append(f"{time.strftime('%H:%M:%S')} {what}")

    def shutdown(self) -> None:
        """Kill every process of every pod this kubelet started (nothing outlives it)."""
        for run in list(self.runs.values()):
            main = run.popen.pid if run.popen is not None and run.popen.poll() is None else None
            kill_all(pids_of(run.uid, main))
            if run.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.popen.wait(timeout=10)


class LocalCluster:
    """The Job controller, the scheduler and the kubelet stand-ins, one pass every
    ``interval`` seconds on a background thread (a poll of the API over HTTP, as a
    controller's watch would see it). Unexpected errors are kept in :attr:`errors`;
    the loop goes on."""

    def __init__(
        self,
        url: str,
        root: Path,
        *,
        selector: str = "shardwise.dev/component=worker",
        interval: float = 0.2,
        tokens: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        self.kube = KubeApi.for_host(url)
        self.controller = JobController(self.kube, selector)
        self.kubelet = LocalKubelet(self.kube, url, root, tokens)
        self.interval = interval
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="local-cluster", daemon=True)

    def start(self) -> LocalCluster:
        self._thread.start()
        return self

    def tick(self) -> None:
        pods = self.kube.list("v1", "pods")
        self.controller.sync(pods)
        nodes = self.kube.list("v1", "nodes")
        pods = self.kube.list("v1", "pods")
        schedule(self.kube, pods, nodes)
        self.kubelet.sync(self.kube.list("v1", "pods"), nodes)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # kept for the test to see; the cluster goes on
                self.errors.append(traceback.format_exc())
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.kubelet.shutdown()
        self.kube.close()

    def pods(self, job: str | None = None) -> Iterator[PodRun]:
        """The pods the kubelet started (of the Job ``job`` when given), oldest first."""
        for run in list(self.kubelet.runs.values()):
            if job is None or run.job == job:
                yield run
