"""``torchrun`` for a pod: forwards SIGTERM, exits 0 when every rank stopped cleanly, and
stops within a bound when a peer is gone.

Kubernetes stops a pod by sending SIGTERM to its first process. When that process is
``torchrun``, it forwards the signal to the workers, waits for them, and then exits
**1** with a ``SignalException`` traceback, even when every worker finished its step,
checkpointed and exited 0 (measured with torch 2.13). The operator, which stops
workers on purpose to reshard, must tell that apart from a crash, so the worker image
starts ``torchrun`` through this module::

    python -m shardwise.runtime.launch --nproc_per_node=2 -m shardwise.runtime.train …

It runs ``torchrun`` with the same arguments and a fresh ``SHARDWISE_STOP_DIR``, passes
SIGTERM/SIGINT on to torchrun *and* straight to its workers (torchrun may itself be
blocked on its rendezvous store and relay nothing), and exits with torchrun's status,
except after a stop signal when every local rank left a marker
(:func:`.stop.write_stop_marker`, written after the final checkpoint): then it exits 0.

**The stop is bounded.** When a peer node froze, the workers here block in a collective
and torchrun in its store, and neither heeds the signal. So after the signal the
launcher waits at most ``SHARDWISE_STOP_TIMEOUT`` (default 10 s) + 5 s for every local
rank to reach a step boundary agreed with all peers (a ``stopping`` marker; the ranks'
own watchdogs give up at ``SHARDWISE_STOP_TIMEOUT``), then the checkpoint's bound
``SHARDWISE_CHECKPOINT_TIMEOUT`` (default 300 s) for the save; past a bound it kills
torchrun and every worker (SIGKILL) and exits :data:`.stop.BOUND_EXIT` (124). When
every rank stopped cleanly but torchrun does not exit within 5 s, it is killed too and
the launcher exits 0. ``SHARDWISE_STOP_TIMEOUT=0`` turns the bounds off.

It also gives torchrun ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` = both bounds (unless set), so
torchrun does not SIGKILL a stop checkpoint after its default 30 s, and the c10d
rendezvous store's ``read_timeout`` = ``SHARDWISE_RDZV_TIMEOUT`` (default 60 s) through
``PET_RDZV_CONF``, unless the arguments or the environment set a rendezvous config.
An elastic torchrun (``--nnodes=MIN:MAX``) gets its agents' TCP store unshared
(:data:`SHARED_STORE_ENV`), without which a node joining a running job never starts.
The pod's ``terminationGracePeriodSeconds`` should cover the stop bound and one
checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from shardwise import names
from shardwise.basics import UserError
from shardwise.runtime.env import Timeouts
from shardwise.runtime.stop import BOUND_EXIT, read_stop_markers, read_stopping_markers

FORWARDED = (signal.SIGTERM, signal.SIGINT)
#: The launcher's bound runs this much past the ranks' own, so they report first.
KILL_MARGIN = 5.0
#: How long torchrun may take to exit once every local rank stopped cleanly.
EXIT_GRACE = 5.0
RDZV_CONF_ENV = "PET_RDZV_CONF"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: Off for an elastic torchrun: with the agents' TCP store shared, a node that joins a
#: running job waits forever for the master address, which rank 0's agent publishes
#: only in its first round (torch 2.13, measured: tests/test_runtime_elastic.py).
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def clean_stop(markers: Sequence[Mapping[str, object]]) -> bool:
    """True when the markers show every local rank stopped after checkpointing."""
    return _every_local_rank(markers)


def _every_local_rank(markers: Sequence[Mapping[str, object]]) -> bool:
    if not markers:
        return False
    expected = {int(str(m.get("local_world_size", 0))) for m in markers}
    return len(expected) == 1 and len({m.get("rank") for m in markers}) == expected.pop()


@dataclass
class StopClock:
    """When the launcher gives up on a stop, from what the ranks have said so far."""

    timeouts: Timeouts
    signalled_at: float
    clean_at: float | None = None

    def deadline(
        self,
        stopping: Sequence[Mapping[str, object]],
        stopped: Sequence[Mapping[str, object]],
        now: float,
    ) -> float:
        if clean_stop(stopped):  # every rank checkpointed: only torchrun is left
            if self.clean_at is None:
                self.clean_at = now
            return self.clean_at + EXIT_GRACE
        bound = self.signalled_at + self.timeouts.stop + KILL_MARGIN
        if _every_local_rank(stopping):  # a save is on: as long as the ranks expect it
            bound += max(_save_allowance(m, self.timeouts.checkpoint) for m in stopping)
        return bound


def _save_allowance(marker: Mapping[str, object], limit: float) -> float:
    """The save time a rank's stopping marker allows (at most ``limit``, the checkpoint
    timeout, which is also what a marker without one gets)."""
    try:
        return min(limit, float(str(marker.get("save_allowance", limit))))
    except ValueError:
        return limit


@dataclass
class OrphanWatch:
    """torchrun left running after all its workers exited, for longer than any store
    call takes: it is blocked on a rendezvous store that is gone (measured: a node
    whose rendezvous host froze keeps torchrun there for minutes, the pod Running with
    no worker). Only when torchrun restarts nothing (``--max-restarts`` 0): between
    restarts it legitimately runs without workers."""

    grace: float
    had_workers: bool = False
    empty_since: float | None = None

    def stuck(self, live_workers: int, now: float) -> bool:
        if live_workers:
            self.had_workers, self.empty_since = True, None
            return False
        if not self.had_workers:  # still in its first rendezvous
            return False
        if self.empty_since is None:
            self.empty_since = now
        return now - self.empty_since >= self.grace


def _option(args: Sequence[str], *spellings: str) -> str | None:
    """The value of torchrun's option (``--name=V`` or ``--name V``) among ``args``,
    up to the script or module (what follows is its own); ``None`` if absent.
    :class:`IndexError` when the option ends the arguments without a value."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in spellings:
            return value if eq else args[i + 1]
        if not arg.startswith("-") and (
            arg.endswith(".py") or (i > 0 and args[i - 1] in ("-m", "--module"))
        ):
            break
    return None


def max_restarts(args: Sequence[str], environ: Mapping[str, str]) -> int | None:
    """torchrun's ``--max-restarts`` (``PET_MAX_RESTARTS``, default 0); None if unreadable."""
    try:
        given = _option(args, "--max-restarts", "--max_restarts")
        return int(given if given is not None else environ.get("PET_MAX_RESTARTS") or 0)
    except (ValueError, IndexError):
        return None


def elastic(args: Sequence[str]) -> bool:
    """torchrun is given a range of nodes (``--nnodes=MIN:MAX``, MIN < MAX)."""
    try:
        low, _, high = (_option(args, "--nnodes") or "").partition(":")
    except IndexError:
        return False
    return bool(high) and low != high


def torchrun_env(
    environ: Mapping[str, str], args: Sequence[str], stop_dir: str, timeouts: Timeouts
) -> dict[str, str]:
    """torchrun's environment: the stop directory, and shutdown and rendezvous timeouts
    that fit the stop bounds (a value the user set is kept)."""
    env = {**environ, names.ENV_STOP_DIR: stop_dir}
    if timeouts.stop > 0 and SHUTDOWN_TIMEOUT_ENV not in env:
        env[SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(timeouts.stop + timeouts.checkpoint))
    if elastic(args) and SHARED_STORE_ENV not in env:
        env[SHARED_STORE_ENV] = "1"
    conf_given = any(a.split("=", 1)[0] in ("--rdzv-conf", "--rdzv_conf") for a in args)
    if not conf_given and RDZV_CONF_ENV not in env:
        env[RDZV_CONF_ENV] = f"read_timeout={math.ceil(timeouts.rendezvous)}"
    return env


# --------------------------------------------------------------------------- processes


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name before ")" may hold spaces
    return fields[0], int(fields[1])


def _parents() -> dict[int, list[int]]:
    """Children by parent pid, from /proc (empty where there is none)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            out.setdefault(stat[1], []).append(int(entry.name))
    return out


def children(pid: int) -> list[int]:
    """``pid``'s direct children: torchrun's are its workers (each in its own session)."""
    listed = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if not listed:  # a kernel without the children files: scan every process
        return sorted(_parents().get(pid, []))
    out: set[int] = set()
    for path in listed:
        with contextlib.suppress(OSError):
            out.update(int(c) for c in path.read_text().split())
    return sorted(out)


def live_children(pid: int) -> list[int]:
    """The children that have not exited (an exited child torchrun has not reaped is a
    zombie: torchrun is stuck, not its worker)."""
    return [c for c in children(pid) if (stat := _stat(c)) is not None and stat[0] != "Z"]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    parents = _parents()
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(sorted(parents.get(current, [])))
    return out


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone meanwhile
            os.kill(pid, sig)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        print("All arguments go to torchrun (python -m torch.distributed.run).")
        return 0 if args else 2
    try:
        timeouts = Timeouts.from_environ()
    except UserError as e:
        print(f"shardwise launch: error: {e}", file=sys.stderr, flush=True)
        return 2
    stop_dir = tempfile.mkdtemp(prefix="shardwise-stop-")
    env = torchrun_env(os.environ, args, stop_dir, timeouts)
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env)
    received: list[str] = []
    clock: StopClock | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal clock
        received.append(signal.Signals(signum).name)
        if clock is None:
            clock = StopClock(timeouts, time.monotonic())
        if child.poll() is None:  # the workers too: torchrun may be stuck in its store
            _signal_all([child.pid, *children(child.pid)], signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    orphans = (
        OrphanWatch(timeouts.rendezvous + KILL_MARGIN)
        if timeouts.stop > 0 and max_restarts(args, env) == 0
        else None
    )
    killed_after: float | None = None
    orphaned = False

    def give_up(now: float) -> bool:
        if clock is not None:  # a stop is under way: its bounds
            stopping, stopped = read_stopping_markers(stop_dir), read_stop_markers(stop_dir)
            return timeouts.stop > 0 and now >= clock.deadline(stopping, stopped, now)
        return orphans is not None and orphans.stuck(len(live_children(child.pid)), now)

    try:
        while True:
            try:
                rc = child.wait(timeout=0.5 if clock is None else 0.2)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if not give_up(now):
                    continue
            _signal_all(process_tree(child.pid), signal.SIGKILL)
            child.wait()
            orphaned = clock is None
            killed_after = now - clock.signalled_at if clock is not None else None
            rc = BOUND_EXIT
            break
        rc = 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    markers = read_stop_markers(stop_dir)
    stopping = read_stopping_markers(stop_dir)
    shutil.rmtree(stop_dir, ignore_errors=True)
    if orphaned and orphans is not None:
        print(
            f"shardwise launch: every worker exited but torchrun did not, {orphans.grace:g} s "
            "later: it is blocked on a rendezvous store that is gone (a lost node?). "
            f"Killed it; exit {BOUND_EXIT}.",
            file=sys.stderr,
            flush=True,
        )
        return BOUND_EXIT
    return _report(received, markers, stopping, rc, killed_after)


def _report(
    received: Sequence[str],
    markers: Sequence[Mapping[str, object]],
    stopping: Sequence[Mapping[str, object]],
    rc: int,
    killed_after: float | None,
) -> int:
    def say(message: str) -> None:
        print(f"shardwise launch: {message}", file=sys.stderr, flush=True)

    if received and clean_stop(markers):
        steps = sorted({int(str(m["step"])) for m in markers})
        where = markers[0].get("checkpoint")
        how = (
            f"torchrun had not exited {killed_after:.1f} s after the signal: killed"
            if killed_after is not None
            else f"torchrun exited {rc}"
        )
        say(
            f"{received[0]} → every rank stopped at step {'/'.join(map(str, steps))} after "
            f"checkpointing to {where}; exit 0 ({how})."
        )
        return 0
    if killed_after is not None:
        say(
            f"{received[0]} {killed_after:.1f} s ago, and {len(stopping)} local rank(s) reached "
            f"a step boundary with every peer, {len(markers)} stopped cleanly: a peer is gone "
            "or a collective hangs. Killed torchrun and its workers without a new checkpoint "
            f"(training resumes from the last one); exit {BOUND_EXIT}."
        )
        return BOUND_EXIT
    if received:
        say(f"{received[0]} but only {len(markers)} rank(s) stopped cleanly; exit {rc or 1}.")
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
