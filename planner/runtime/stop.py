"""Graceful stop: SIGTERM (or SIGINT) makes the trainer finish its step, checkpoint, exit 0.

The operator reshards a running job by stopping its workers and starting new ones on
another world size from the last checkpoint, so a stop must never lose a step. The
handler only sets a flag; the training loop asks :meth:`GracefulStop.should_stop`
between steps. Ranks receive the signal at slightly different moments (one pod before
another), so ``should_stop`` is a collective: every rank calls it at the same step,
and they all stop together if any of them was signalled (an ``all_reduce`` of one
integer). Installing the handler first thing also keeps a rank alive when ``torchrun``
terminates it because a peer failed: it goes on to print its own error (see
:mod:`.plancheck`).

After the final checkpoint each rank writes a marker file into ``SHARDWISE_STOP_DIR``
when that is set: :mod:`.launch` reads the markers to exit 0, because ``torchrun``
itself exits 1 after forwarding a SIGTERM, even when every worker stopped cleanly.
Stdlib only (torch is imported inside ``should_stop``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

STOP_DIR_ENV = "SHARDWISE_STOP_DIR"
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A stop request from a signal, agreed on by every rank between steps."""

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_name: str | None = None
        self.received_at: float | None = None

    def install(self) -> GracefulStop:
        """Catch the signals (main thread only); call before anything slow."""
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.time()

    def request(self, reason: str = "request") -> None:
        """Ask for a stop from code, as a signal would (e.g. a step budget or a test)."""
        if self.signal_name is None:
            self.signal_name = reason
            self.received_at = time.time()

    @property
    def requested(self) -> bool:
        """This rank was signalled (other ranks may not have been yet)."""
        return self.signal_name is not None

    def should_stop(self, group: Any = None) -> bool:
        """True on every rank if any rank was signalled. A collective: call it on every
        rank at the same step. Without an initialised process group it is local."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        backend = dist.get_backend(group)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stop = bool(flag.item())
        if stop and self.signal_name is None:
            self.signal_name = "peer"  # another rank was signalled
            self.received_at = time.time()
        return stop


def write_stop_marker(
    rank: int, local_world_size: int, step: int, checkpoint: str | None, reason: str
) -> Path | None:
    """Tell :mod:`.launch` this rank stopped cleanly after checkpointing (no-op unless
    ``SHARDWISE_STOP_DIR`` is set). Written atomically: a marker is complete or absent."""
    directory = os.environ.get(STOP_DIR_ENV)
    if not directory:
        return None
    path = Path(directory) / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "rank": rank,
                "local_world_size": local_world_size,
                "step": step,
                "checkpoint": checkpoint,
                "reason": reason,
            }
        )
    )
    tmp.replace(path)
    return path


def read_stop_markers(directory: str | Path) -> list[dict[str, Any]]:
    """The markers the ranks of this node wrote, by rank."""
    out = []
    for p in sorted(Path(directory).glob("rank-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda m: int(m.get("rank", 0)))
