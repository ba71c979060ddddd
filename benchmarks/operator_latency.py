"""How fast the operator turns a DLRMJob into its plan ConfigMap, and how much memory it
holds with 50 jobs — against the API emulator of ``tests/k8s``.

The emulator runs in this process; the operator runs as ``shardwise operator`` would,
in a subprocess (so its resident memory is its own), with its planner pool (one
``spawn`` process, measured apart). Profiling is skipped (``policy: Never``: the
bundled model), so the time is watch latency + spec parsing + NeuroShard + writing the
ConfigMap. The cluster: 4 nodes of 8 GPUs with 80 GiB each.

    python benchmarks/operator_latency.py            # 80 and 856 tables, 50 jobs
    python benchmarks/operator_latency.py --jobs 10 --tables 80
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from k8s.helpers import add_node, load_crd  # noqa: E402
from k8s.server import EmulatorServer  # noqa: E402

from shardwise.operator.kube import KubeApi  # noqa: E402
from shardwise.planner.synthetic import generate_tables  # noqa: E402
from shardwise.planner.tables import TableSpec  # noqa: E402

NS = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def inline(tables: list[TableSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "rows": t.rows,
            "dim": t.dim,
            "poolingFactor": t.pooling_factor,
            "dtype": t.dtype,
            "accessHist": list(t.access_hist),
        }
        for t in tables
    ]


def dlrmjob(name: str, tables: list[TableSpec], workers: int) -> dict[str, Any]:
    return {
        "apiVersion": "shardwise.dev/v1alpha1",
        "kind": "DLRMJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "tables": {"inline": inline(tables)},
            "gpusPerWorker": 8,
            "workers": {"min": 1, "max": workers},
            "template": {"image": "example/shardwise:0.1.0"},
            "planner": {"algorithm": "neuroshard", "gpuMemory": "80Gi"},
            "profiling": {"policy": "Never"},
        },
    }


def plan_of(server: EmulatorServer, job: str) -> dict[str, Any] | None:
    for cm in server.emulator.objects("configmaps", NS):
        labels = cm["metadata"].get("labels", {})
        if (
            labels.get("shardwise.dev/job") == job
            and labels.get("shardwise.dev/component") == "plan"
        ):
            return cm
    return None


def plan_created(server: EmulatorServer, job: str) -> bool:
    return plan_of(server, job) is not None


def wait(probe: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def start_operator(url: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    code = (
        "import typer\nfrom shardwise.cli.operator import operator_cmd\ntyper.run(operator_cmd)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--server",
            url,
            "--namespace",
            NS,
            "--health-port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=str(ROOT),
    )

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    wait(ready, 120, "the operator to be ready")
    return proc, port


def time_to_plan(
    server: EmulatorServer, kube: KubeApi, name: str, tables: list[TableSpec]
) -> tuple[float, float]:
    """Seconds from the create request to the plan ConfigMap, and the planner's share."""
    body = dlrmjob(name, tables, workers=4)
    start = time.perf_counter()
    kube.create(body)
    wait(lambda: plan_created(server, name), 900, f"the plan of {name}")
    total = time.perf_counter() - start
    cm = plan_of(server, name)
    assert cm is not None
    summary = json.loads(cm["metadata"]["annotations"]["shardwise.dev/plan"])
    return total, float(summary["planningSeconds"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, nargs="*", default=[80, 856])
    p.add_argument("--repeats", type=int, default=3, help="jobs timed per table count")
    p.add_argument("--jobs", type=int, default=50, help="jobs alive for the memory figure")
    args = p.parse_args()

    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create(load_crd())
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    for i in range(4):
        add_node(kube, f"gpu-{i}", gpus=8, memory_mib=81920)
    proc, _ = start_operator(server.url)
    idle = rss_mib(proc.pid)
    try:
        # The first plan warms the planner process (torch import, bundled model).
        time_to_plan(server, kube, "warmup", generate_tables(8, 99, batch_size=8192))
        print(f"operator ready; RSS {idle:.0f} MiB idle (planner process started on first plan)")
        print("creation -> plan ConfigMap (profiling skipped), 32 GPUs:")
        print(
            f"{'tables':>6} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7} {'planner s':>9}"
        )
        for count in args.tables:
            tables = generate_tables(count, 0, batch_size=8192)
            runs = [
                time_to_plan(server, kube, f"t{count}-{r}", tables) for r in range(args.repeats)
            ]
            times = [t for t, _ in runs]
            planner = statistics.median(p for _, p in runs)
            print(
                f"{count:>6} {len(times):>4} {statistics.median(times):>9.2f} "
                f"{min(times):>7.2f} {max(times):>7.2f} {planner:>9.2f}"
            )
        small = generate_tables(20, 1, batch_size=8192)
        start = time.perf_counter()
        for i in range(args.jobs):
            kube.create(dlrmjob(f"many-{i}", small, workers=1))
        wait(
            lambda: all(plan_created(server, f"many-{i}") for i in range(args.jobs)),
            900,
            f"{args.jobs} plans",
        )
        elapsed = time.perf_counter() - start
        alive = len(kube.list("shardwise.dev/v1alpha1", "dlrmjobs", NS))
        time.sleep(2.0)  # let the status writes settle
        planners = children_of(proc.pid)
        planner_rss = sum(rss_mib(pid) for pid in planners)
        print(
            f"{alive} DLRMJobs alive ({args.jobs} of 20 tables planned in {elapsed:.1f} s): "
            f"operator RSS {rss_mib(proc.pid):.0f} MiB; planner process(es) "
            f"{planner_rss:.0f} MiB ({len(planners)} process(es))"
        )
        print(f"API requests served by the emulator: {len(server.emulator.calls())}")
    finally:
        proc.terminate()
        proc.wait(30)
        kube.close()
        server.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
