"""What the live summary and the per-shard probe cost a training run, measured.

The same short CPU training (``python -m shardwise.runtime.train`` under ``torchrun``,
2 ranks, gloo) runs with the live summary on (``SHARDWISE_LIVE_CONFIGMAP`` set, the
shard probe on, the defaults: a gathering every 20 steps, a write every 15 s at most,
to the API emulator of ``tests/k8s`` over HTTP) and off (unset: nothing is gathered),
in pairs whose order alternates, so a machine that slows down over the runs weighs on
both sides alike. Each run's step time is its training loop's wall time per step
(``loop_seconds`` of the run summary: probe windows, gatherings and writes included).

Printed: each pair's step times, the overhead (on / off − 1) per pair, its median and a
95 % interval (t over the pairs; on a shared machine other jobs' load moves runs by more
than the effect, so the interval can be wide), and what the live side accounts for
itself, which that load blurs far less: the probe's own share of the training time (the
live summary's ``probe``: the rank whose probe took the largest share) and rank 0's time
in gatherings (the all-gather, which includes waiting for the slowest rank, and
building the summary) as a share of its loop.

    python benchmarks/live_overhead.py                     # 8 pairs of 200 steps
    python benchmarks/live_overhead.py --pairs 6 --steps 500
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from k8s.server import EmulatorServer  # noqa: E402

from shardwise import names  # noqa: E402
from shardwise.operator.kube import KubeApi  # noqa: E402
from shardwise.planner.live.summary import LiveSummary  # noqa: E402
from shardwise.planner.plan import Plan, Shard, save_plan  # noqa: E402
from shardwise.planner.synthetic import generate_tables  # noqa: E402
from shardwise.planner.tables import TableSpec, save_tables  # noqa: E402
from shardwise.planner.topology import Topology  # noqa: E402

NS, JOB = "ml", "bench"
CM = names.live_configmap_name(JOB)
#: Two-sided 97.5 % quantiles of Student's t by degrees of freedom (1..10), then 1.96.
T975 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23]


def tables(count: int, batch: int) -> list[TableSpec]:
    """Generated specs (pooling, histograms) cut to small tables: quick on 2 cores."""
    specs = generate_tables(count, 0, batch_size=4 * batch)
    return [
        s.model_copy(update={"rows": min(s.rows, 2000 * (i + 2)), "dim": 16})
        for i, s in enumerate(specs)
    ]


def plan(specs: list[TableSpec], batch: int) -> Plan:
    shards = [[Shard(rank=i % 2, col_offset=0, cols=t.dim)] for i, t in enumerate(specs)]
    topology = Topology(gpus=2, gpu_memory_bytes=1 << 30, device="cpu", batch_size_per_rank=batch)
    return Plan.from_shards(specs, shards, topology, "bench")


def kubeconfig(url: str, path: Path) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e", "cluster": {"server": url}}],
        "users": [{"name": "w", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "e", "user": "w"}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def run_once(work: Path, steps: int, batch: int, live: bool, url: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SHARDWISE_METRICS_PORT": "0",
        "SHARDWISE_PLAN": str(work / "plan.json"),
        "SHARDWISE_NAMESPACE": NS,
        "SHARDWISE_JOB": JOB,
        "KUBECONFIG": str(kubeconfig(url, work / "kubeconfig")),
    }
    env.pop(names.ENV_LIVE_CONFIGMAP, None)
    if live:
        env[names.ENV_LIVE_CONFIGMAP] = CM
    out = work / ("on.json" if live else "off.json")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "shardwise.runtime.train", "--tables", "tables.yaml", "--steps", str(steps),
        "--batch-size", str(batch), "--log-every", "0", "--summary", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"training failed ({done.returncode}):\n{done.stdout[-3000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and its 95 % t interval."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan, math.nan
    t = T975[len(xs) - 2] if len(xs) - 1 <= len(T975) else 1.96
    half = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="on/off pairs (default 8)")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    ap.add_argument("--batch", type=int, default=512, help="samples per rank (default 512)")
    ap.add_argument("--tables", type=int, default=12, help="tables (default 12)")
    args = ap.parse_args(argv)

    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    specs = tables(args.tables, args.batch)
    print(
        f"{args.pairs} pairs of {args.steps} steps, 2 CPU ranks, {len(specs)} tables, "
        f"batch {args.batch} per rank; machine: {os.cpu_count()} CPUs",
        flush=True,
    )
    overheads, shares, accounted, rows = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        save_tables(specs, work / "tables.yaml")
        save_plan(plan(specs, args.batch), work / "plan.json")
        for pair in range(args.pairs):
            times: dict[bool, float] = {}
            probe, gathering = None, 0.0
            for live in (True, False) if pair % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                s = run_once(work, args.steps, args.batch, live, server.url)
                times[live] = float(s["loop_seconds"]) / (s["end_step"] - s["start_step"])
                if live:
                    body = kube.get("v1", "configmaps", NS, CM) or {}
                    summary = LiveSummary.model_validate_json(body["data"][names.LIVE_KEY])
                    probe = summary.probe
                    shares.append(probe.overhead)
                    gathering = s["live"]["report_seconds"] / s["loop_seconds"]
                    own = s["live"]["probe_seconds"] + s["live"]["report_seconds"]
                    accounted.append(own / s["loop_seconds"])
                print(
                    f"  pair {pair + 1} {'on ' if live else 'off'}: "
                    f"{1e3 * times[live]:.2f} ms/step ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            overhead = times[True] / times[False] - 1
            overheads.append(overhead)
            assert probe is not None
            rows.append((pair + 1, times[False], times[True], overhead, probe, gathering))
    kube.close()
    server.stop()

    print("\npair  off ms/step  on ms/step  overhead  probe share (windows)  rank 0 gathering")
    for pair, off, on, overhead, probe, gathering in rows:
        print(
            f"{pair:>4}  {1e3 * off:11.2f}  {1e3 * on:10.2f}  {100 * overhead:+7.2f} %"
            f"  {100 * probe.overhead:11.2f} % ({probe.windows:>3})  {100 * gathering:14.2f} %"
        )
    mean, lo, hi = interval(overheads)
    median = statistics.median(overheads)
    print(
        f"\noverhead of the live summary + probe: median {100 * median:+.2f} %, mean "
        f"{100 * mean:+.2f} % (95 % interval {100 * lo:+.2f} … {100 * hi:+.2f} %, "
        f"{len(overheads)} pairs)"
    )
    print(
        "probe's own accounted share of the training time: median "
        f"{100 * statistics.median(shares):.2f} %, max {100 * max(shares):.2f} % (budget 1 %)"
    )
    print(
        "rank 0's probe + gatherings as a share of its loop: median "
        f"{100 * statistics.median(accounted):.2f} %, max {100 * max(accounted):.2f} %"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
