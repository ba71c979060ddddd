"""A process whose main thread is stuck the way a rank is stuck in a collective with a
lost peer, to test the stop watchdog. argv[1]: what to do after writing ``ready`` to
stdout, then waiting for SIGTERM:

- ``stuck``: block in C with SIGTERM masked in this thread, so the Python handler never
  runs (as in a gloo wait): only the watchdog can end the process;
- ``save-then-stop``: be inside :meth:`GracefulStop.checkpointing` for 2 s (a save
  that began before the signal), then reach the boundary (``should_stop``), exit 0;
- ``hung-save``: save once (0.1 s), then, after the signal, start a save that never
  ends (a peer died during it): only the watchdog can end the process, once the save
  has overrun its allowance.

The bound comes from ``SHARDWISE_STOP_TIMEOUT``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from shardwise.runtime.stop import GracefulStop

STOP = GracefulStop().install()


def main() -> int:
    mode = sys.argv[1]
    if mode == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # delivered elsewhere
        print("ready", flush=True)
        threading.Event().wait()  # never returns: the watchdog must exit the process
        return 3
    import torch  # noqa: F401  (should_stop imports it: not inside the 0.5 s bound)

    if mode == "hung-save":
        with STOP.checkpointing():
            time.sleep(0.1)
    print("ready", flush=True)
    while not STOP.requested:
        time.sleep(0.01)
    with STOP.checkpointing():
        time.sleep(2.0 if mode == "save-then-stop" else 3600)
    stopped = STOP.should_stop()  # no process group: this rank decides alone
    print(f"stopped={stopped}", flush=True)
    sys.stdout.flush()
    os._exit(0 if stopped else 4)


if __name__ == "__main__":
    sys.exit(main())
