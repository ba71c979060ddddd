"""Time from a Node change to the worker Job at the new size — against the API emulator.

The emulator of ``tests/k8s`` and the operator (kopf's real engine, its planner pool of
one process) run in this process, as in tests/test_operator_resharding.py. A DLRMJob
with ``resharding.debounceSeconds: 0`` runs on one 4-GPU node (2 workers of 2 GPUs);
each round adds a second node (2 → 4 workers, NodeAdded) and then deletes it (4 → 2,
NodeLost). Measured: from the Node create/delete request returning to the new worker
Job being visible at the new size. That includes the watch latency, the debounce pass,
planning for the new world size, the Foreground delete of the old Job and the create of
the new one; it excludes the debounce (0 here) and the workers' own SIGTERM →
checkpoint → exit (no pods in the emulator: a real cluster adds that grace time).

    python benchmarks/reshard_latency.py             # 10 rounds
    python benchmarks/reshard_latency.py --rounds 30 --tables 80
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from k8s.fixtures import OperatorThread  # noqa: E402
from k8s.helpers import NAMESPACE, add_node, dlrmjob, load_crd, table  # noqa: E402
from k8s.server import EmulatorServer  # noqa: E402

from shardwise.operator.kube import KubeApi  # noqa: E402
from shardwise.operator.loop.planner_pool import process_pool  # noqa: E402


def workers_at(kube: KubeApi, name: str, n: int, timeout: float = 60.0) -> float:
    """Poll (2 ms) until the live worker Job runs ``n`` pods; the time it was seen."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        wj = kube.get("batch/v1", "jobs", NAMESPACE, f"{name}-workers")
        if (
            wj is not None
            and not wj["metadata"].get("deletionTimestamp")
            and wj["spec"]["parallelism"] == n
        ):
            return time.perf_counter()
        time.sleep(0.002)
    raise TimeoutError(f"no worker Job at {n} within {timeout} s")


def phases(kube: KubeApi, name: str) -> tuple[float, float]:
    """From ``status.resharding``: (since → startedAt: debounce pass and planning for
    the new size; startedAt → lastAt: old Job stopped, new one created)."""
    import datetime

    def t(key: str) -> datetime.datetime:
        return datetime.datetime.fromisoformat(str(r[key]).replace("Z", "+00:00"))

    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline:
        obj = kube.get("shardwise.dev/v1alpha1", "dlrmjobs", NAMESPACE, name) or {}
        r = (obj.get("status") or {}).get("resharding") or {}
        if r.get("state") == "Done" and r.get("lastAt"):
            return (
                (t("startedAt") - t("since")).total_seconds(),
                (t("lastAt") - t("startedAt")).total_seconds(),
            )
        time.sleep(0.01)
    raise TimeoutError("status.resharding never showed Done")


def summary(xs: list[float]) -> str:
    ms = sorted(1e3 * x for x in xs)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):.0f} ms, p90 {p90:.0f} ms, max {ms[-1]:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tables", type=int, default=26, help="tables in the job (default 26)")
    args = ap.parse_args(argv)

    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create(load_crd())
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    pool = process_pool(1)
    op = OperatorThread(server.url, pool).start()
    results: dict[str, list[float]] = {"NodeAdded 2->4": [], "NodeLost 4->2": []}
    parts: dict[str, list[tuple[float, float]]] = {k: [] for k in results}
    try:
        add_node(kube, "gpu-1", gpus=4)
        body: dict[str, Any] = dlrmjob(
            "bench",
            NAMESPACE,
            [table(i) for i in range(args.tables)],
            workers=(1, 4),
            resharding={"enabled": True, "debounceSeconds": 0},
        )
        kube.create(body)
        workers_at(kube, "bench", 2)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            add_node(kube, "gpu-2", gpus=4)
            results["NodeAdded 2->4"].append(workers_at(kube, "bench", 4) - t0)
            parts["NodeAdded 2->4"].append(phases(kube, "bench"))
            t0 = time.perf_counter()
            kube.delete("v1", "nodes", None, "gpu-2")
            results["NodeLost 4->2"].append(workers_at(kube, "bench", 2) - t0)
            parts["NodeLost 4->2"].append(phases(kube, "bench"))
    finally:
        op.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        kube.close()
        server.stop()
    print(f"{args.rounds} rounds, {args.tables} tables, debounce 0 (emulator, no pods):")
    for what, xs in results.items():
        print(f"  Node change -> worker Job at the new size, {what}: {summary(xs)}")
        planning = summary([a for a, _ in parts[what]])
        print(f"    of which detected -> started (incl. planning): {planning}")
        print(f"    of which started -> new Job created: {summary([b for _, b in parts[what]])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
