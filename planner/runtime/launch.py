"""``torchrun`` for a pod: forwards SIGTERM, and exits 0 when every rank stopped cleanly.

Kubernetes stops a pod by sending SIGTERM to its first process. When that process is
``torchrun``, it forwards the signal to the workers, waits for them, and then exits
**1** with a ``SignalException`` traceback, even when every worker finished its step,
checkpointed and exited 0 (measured with torch 2.13). The operator, which stops
workers on purpose to reshard, must tell that apart from a crash, so the worker image
starts ``torchrun`` through this module::

    python -m shardwise.planner.runtime.launch --nproc_per_node=2 examples/train_dlrm.py …

It runs ``torchrun`` with the same arguments and a fresh ``SHARDWISE_STOP_DIR``, passes
SIGTERM/SIGINT on, and exits with torchrun's status, except after a stop signal when
every local rank left a marker (:func:`.stop.write_stop_marker`, written after the final
checkpoint): then it exits 0. ``torchrun`` kills workers that take longer than its
shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30 s) to stop, so the pod's
``terminationGracePeriodSeconds`` must exceed it, and it must cover a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from types import FrameType

from shardwise.planner.runtime.stop import STOP_DIR_ENV, read_stop_markers

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def clean_stop(markers: Sequence[dict[str, object]]) -> bool:
    """True when the markers show every local rank stopped after checkpointing."""
    if not markers:
        return False
    expected = {int(str(m.get("local_world_size", 0))) for m in markers}
    return len(expected) == 1 and len(markers) == expected.pop()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        print("All arguments go to torchrun (python -m torch.distributed.run).")
        return 0 if args else 2
    stop_dir = tempfile.mkdtemp(prefix="shardwise-stop-")
    env = {**os.environ, STOP_DIR_ENV: stop_dir}
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env)
    received: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        rc = child.wait()
        rc = 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    markers = read_stop_markers(stop_dir)
    shutil.rmtree(stop_dir, ignore_errors=True)
    if received and clean_stop(markers):
        steps = sorted({int(str(m["step"])) for m in markers})
        where = markers[0].get("checkpoint")
        print(
            f"shardwise launch: {received[0]} → every rank stopped at step "
            f"{'/'.join(map(str, steps))} after checkpointing to {where}; exit 0 "
            f"(torchrun exited {rc}).",
            file=sys.stderr,
            flush=True,
        )
        return 0
    if received:
        print(
            f"shardwise launch: {received[0]} but only {len(markers)} rank(s) stopped cleanly; "
            f"exit {rc or 1}.",
            file=sys.stderr,
            flush=True,
        )
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
