"""A torchrun worker with no torch work: waits for SIGTERM, then leaves a stop marker
(if its rank is listed in argv[2]) and exits 0. Tests the launcher's exit status."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from shardwise.runtime.stop import GracefulStop, write_stop_marker

STOP = GracefulStop().install()


def main() -> int:
    ready_dir, marking = Path(sys.argv[1]), {int(r) for r in sys.argv[2].split(",") if r}
    rank, local_world = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    (ready_dir / f"ready-{rank}").write_text("")
    deadline = time.monotonic() + 60
    while not STOP.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank in marking:
        write_stop_marker(rank, local_world, 7, "ckpt/step-000000007", STOP.signal_name or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
