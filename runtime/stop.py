"""Graceful stop: SIGTERM (or SIGINT) makes the trainer finish its step, checkpoint, exit 0,
and a bounded one when a peer is gone.

The operator reshards a running job by stopping its workers and starting new ones on
another world size from the last checkpoint, so a stop must never lose a step. The
handler only sets a flag; the training loop asks :meth:`GracefulStop.should_stop`
between steps. Ranks receive the signal at slightly different moments (one pod before
another), so ``should_stop`` is a collective: every rank calls it at the same step,
and they all stop together if any of them was signalled (an ``all_reduce`` of one
integer). Installing the handler first thing also keeps a rank alive when ``torchrun``
terminates it because a peer failed: it goes on to print its own error (see
:mod:`.plancheck`).

**A peer that is gone.** When a node freezes or loses power, its peers block inside a
collective (an all-to-all of the step) that nothing will complete. Python runs signal
handlers only between bytecodes, so a rank blocked in C++ never even sees the flag. So
:meth:`GracefulStop.install` also starts a watchdog thread that learns of the signal
from the interpreter's wakeup fd (written by the C-level handler at once, whatever the
main thread is doing). If the rank has not reached a step boundary agreed with every
peer (``should_stop`` returned True) within ``SHARDWISE_STOP_TIMEOUT`` seconds (default
10; 0 turns the bound off), it says so and exits at once with status
:data:`BOUND_EXIT`, without a checkpoint: the last one stands, and the steps since are
lost (at most the trainer's checkpoint interval). A checkpoint that began before the
signal (:meth:`GracefulStop.checkpointing`) gets its :meth:`~GracefulStop.save_allowance`
on top: three times the last save's duration plus 5 s (the checkpoint timeout, before
any save finished), because a save is collective too and a peer that died during it
would otherwise hold the stop for the whole checkpoint timeout (300 s by default).

Markers in ``SHARDWISE_STOP_DIR`` (when set) tell :mod:`.launch` how the stop goes:
``stopping-<rank>.json`` when the rank reached the agreed boundary (or is inside a
checkpoint), so the launcher waits for the checkpoint; ``rank-<rank>.json`` after the
final checkpoint (:func:`write_stop_marker`), so it exits 0, because ``torchrun``
itself exits 1 after forwarding a SIGTERM, even when every worker stopped cleanly.
Stdlib only (torch is imported inside ``should_stop``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from shardwise import names
from shardwise.basics import UserError
from shardwise.runtime.env import Timeouts

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Exit status of a rank (and of :mod:`.launch`) that gave up waiting for its peers
#: after a stop signal, as ``timeout(1)`` exits when its bound expires.
BOUND_EXIT = 124
#: A save taking longer than this many times the last one, plus :data:`SAVE_SLACK_S`, is
#: taken to hang on a lost peer (saves of the same tables take about as long each time).
SAVE_SLACK_FACTOR = 3.0
SAVE_SLACK_S = 5.0
#: Exit status of an elastic rank that stopped only because a peer was signalled (its
#: own torchrun had not yet seen the world change): not 0, which would end this node's
#: run as done, so its torchrun restarts it into the new world (``EX_TEMPFAIL``).
PEER_STOP_EXIT = 75


def _timeouts_from_environ() -> Timeouts:
    """The ``SHARDWISE_*_TIMEOUT`` variables, or the defaults when they are malformed:
    this runs before the trainer can report errors, and its own check of them does so."""
    try:
        return Timeouts.from_environ()
    except UserError:
        return Timeouts()


class GracefulStop:
    """A stop request from a signal, agreed on by every rank between steps, with a
    bound on the wait for that agreement.

    ``bound``: seconds from the signal to the agreed step boundary before the rank
    exits on its own (:data:`BOUND_EXIT`); ``None`` reads ``SHARDWISE_STOP_TIMEOUT``
    (default 10), 0 turns the watchdog off."""

    def __init__(
        self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS, *, bound: float | None = None
    ) -> None:
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_name: str | None = None
        self.received_at: float | None = None
        timeouts = _timeouts_from_environ()
        self.bound = timeouts.stop if bound is None else bound
        self.checkpoint_timeout = timeouts.checkpoint
        #: Seconds the last completed save took (``None`` before the first).
        self.last_save_seconds: float | None = None
        #: Named in the watchdog's message (the trainer sets it after each save or load).
        self.last_checkpoint: str | None = None
        self._settled = threading.Event()  # agreed boundary reached, or uninstalled
        self._checkpoint_started: float | None = None  # monotonic, while saving
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watchdog: threading.Thread | None = None

    def install(self) -> GracefulStop:
        """Catch the signals and start the watchdog (main thread only); call before
        anything slow."""
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.bound > 0:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # the interpreter requires it
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._wakeup = (read_fd, write_fd)
            self._settled.clear()
            self._watchdog = threading.Thread(
                target=self._watch, args=(read_fd,), name="shardwise-stop-watchdog", daemon=True
            )
            self._watchdog.start()
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._settled.set()
            read_fd, write_fd = self._wakeup
            os.close(write_fd)  # the watchdog's read returns b"" and it ends
            if self._watchdog is not None:
                self._watchdog.join(timeout=5)
            os.close(read_fd)
            self._wakeup = self._watchdog = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.time()

    def request(self, reason: str = "request") -> None:
        """Ask for a stop from code, as a signal would (e.g. a step budget or a test).
        The watchdog is not armed: the code asking is not blocked."""
        if self.signal_name is None:
            self.signal_name = reason
            self.received_at = time.time()

    @property
    def requested(self) -> bool:
        """This rank was signalled (other ranks may not have been yet)."""
        return self.signal_name is not None

    def should_stop(self, group: Any = None) -> bool:
        """True on every rank if any rank was signalled. A collective: call it on every
        rank at the same step. Without an initialised process group it is local.

        True also means every peer answered at this step boundary: the watchdog stands
        down, and a ``stopping`` marker tells the launcher the checkpoint is under way."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            stop = self.requested
        else:
            backend = dist.get_backend(group)
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
            flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            stop = bool(flag.item())
        if stop:
            if self.signal_name is None:
                self.signal_name = "peer"  # another rank was signalled
                self.received_at = time.time()
            write_stopping_marker("agreed", self.save_allowance())
            self._settled.set()
        return stop

    def save_allowance(self) -> float:
        """How long a save may take before it is taken to hang: ``SAVE_SLACK_FACTOR`` ×
        the last save + ``SAVE_SLACK_S``, at most the checkpoint timeout (all of it
        before the first save, whose duration nothing predicts)."""
        if self.last_save_seconds is None:
            return self.checkpoint_timeout
        guess = SAVE_SLACK_FACTOR * self.last_save_seconds + SAVE_SLACK_S
        return min(self.checkpoint_timeout, guess)

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a checkpoint save: a signal arriving meanwhile waits for the save, for
        its :meth:`save_allowance`, before the stop bound starts counting."""
        started = time.monotonic()
        self._checkpoint_started = started
        try:
            yield
        finally:
            self._checkpoint_started = None
        self.last_save_seconds = time.monotonic() - started

    # ------------------------------------------------------------------ the watchdog

    def _watch(self, read_fd: int) -> None:
        wanted = {int(s) for s in self._signals}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or self._settled.is_set():
                return  # uninstalled, or the stop is already agreed
            if wanted & set(data):
                break
        since = time.monotonic()
        deadline = since + self.bound
        marked = False
        while not self._settled.wait(0.1):
            now = time.monotonic()
            started = self._checkpoint_started
            if started is not None:  # a save under way: it may finish, within its allowance
                allowance = self.save_allowance()
                deadline = max(deadline, min(now, started + allowance) + self.bound)
                if not marked:
                    write_stopping_marker("checkpointing", allowance)
                    marked = True
            if now >= deadline:
                self._give_up(now - since)

    def _give_up(self, waited: float) -> NoReturn:
        tag = f"[rank {os.environ.get('RANK', '0')}/{os.environ.get('WORLD_SIZE', '1')}]"
        last = self.last_checkpoint or "none yet"
        print(
            f"{tag} stop: a stop signal came {waited:.1f} s ago and this rank has not reached "
            "a step boundary with every peer: a peer is gone or a collective hangs. Exiting "
            f"now with status {BOUND_EXIT}, without a checkpoint; the last one stands ({last}). "
            f"({names.ENV_STOP_TIMEOUT}={self.bound:g})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(BOUND_EXIT)


# --------------------------------------------------------------------------- markers


def _write_marker(name: str, content: dict[str, Any]) -> Path | None:
    directory = os.environ.get(names.ENV_STOP_DIR)
    if not directory:
        return None
    path = Path(directory) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(content))
    tmp.replace(path)
    return path


def write_stop_marker(
    rank: int, local_world_size: int, step: int, checkpoint: str | None, reason: str
) -> Path | None:
    """Tell :mod:`.launch` this rank stopped cleanly after checkpointing (no-op unless
    ``SHARDWISE_STOP_DIR`` is set). Written atomically: a marker is complete or absent."""
    return _write_marker(
        f"rank-{rank}.json",
        {
            "rank": rank,
            "local_world_size": local_world_size,
            "step": step,
            "checkpoint": checkpoint,
            "reason": reason,
        },
    )


def write_stopping_marker(state: str, save_allowance: float) -> Path | None:
    """Tell :mod:`.launch` this rank's stop is under way with its peers alive (``agreed``)
    or waits for a checkpoint (``checkpointing``), and how long the save may take; rank
    from torchrun's environment."""
    rank = int(os.environ.get("RANK", "0"))
    return _write_marker(
        f"stopping-{rank}.json",
        {
            "rank": rank,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "state": state,
            "save_allowance": save_allowance,
        },
    )


def clear_markers() -> None:
    """Remove this node's markers (no-op unless ``SHARDWISE_STOP_DIR`` is set). An
    elastic restart leaves the last round's markers behind, which would tell
    :mod:`.launch` that ranks still training had stopped: local rank 0 of the new round
    clears them before any rank can write one (each needs rank 0 in the process group
    first)."""
    directory = os.environ.get(names.ENV_STOP_DIR)
    if not directory:
        return
    for p in Path(directory).glob("*.json"):
        p.unlink(missing_ok=True)


def _read_markers(directory: str | Path, pattern: str) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(directory).glob(pattern)):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda m: int(m.get("rank", 0)))


def read_stop_markers(directory: str | Path) -> list[dict[str, Any]]:
    """The markers the ranks of this node wrote after their final checkpoint, by rank."""
    return _read_markers(directory, "rank-*.json")


def read_stopping_markers(directory: str | Path) -> list[dict[str, Any]]:
    """The ranks of this node whose stop is under way (:func:`write_stopping_marker`)."""
    return _read_markers(directory, "stopping-*.json")
