"""A profiling pod's script, run for real: the operator renders it for a DLRMJob,
and it calibrates a cost model on the job's tiny tables (``shardwise calibrate``, a
short budget) and publishes it to the API emulator; the job then plans with it and its
status says how it was calibrated. The pod's mounts are local directories here, its
service account a kubeconfig for the emulator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from k8s.helpers import NAMESPACE, add_node, dlrmjob, finish_job, wait_for, wait_phase
from k8s.server import EmulatorServer

from shardwise.names import profiling_job_name
from shardwise.operator.kube import KubeApi
from shardwise.operator.render import children as render

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
QUICK = "--tiny --max-samples 24"
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
TINY = [
    {"name": f"t{i}", "rows": rows, "dim": dim, "poolingFactor": pool}
    for i, (rows, dim, pool) in enumerate(
        [(2000, 16, 3.0), (5000, 32, 5.0), (800, 8, 1.5), (3000, 16, 8.0)]
    )
]


def kubeconfig(url: str, path: Path) -> Path:
    """What the pod's service account gives the official client: the API server."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "profiler", "user": {}}],
        "contexts": [{"name": "pod", "context": {"cluster": "emulator", "user": "profiler"}}],
        "current-context": "pod",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def run_pod(kube: KubeApi, job: dict[str, Any], url: str, root: Path) -> tuple[str, str]:
    """Run the Job's container as its pod would: its volumes as local directories."""
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    script = container["command"][2]
    places = {
        render.PROFILE_TABLES_DIR: root / "tables",
        render.PROFILE_WORK_DIR: root / "work",
        render.PROFILE_BASE_DIR: root / "base",
    }
    for volume in pod["volumes"]:
        cm = volume.get("configMap")
        if volume["name"] == "tables":
            body = kube.get("v1", "configmaps", NS, cm["name"])
            assert body is not None, "the operator created the tables ConfigMap"
            places[render.PROFILE_TABLES_DIR].mkdir(parents=True)
            for key, text in body["data"].items():
                (places[render.PROFILE_TABLES_DIR] / key).write_text(text)
    for mount, local in places.items():
        script = script.replace(mount, str(local))
    # the calibration's own test options: small networks, few samples (a fast test)
    script = script.replace("shardwise calibrate ", f"shardwise calibrate {QUICK} ")
    env = {
        **os.environ,
        **{e["name"]: e["value"] for e in container["env"]},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "KUBECONFIG": str(kubeconfig(url, root / "kubeconfig")),
        "COLUMNS": "200",
    }
    env["SHARDWISE_MODEL_CACHE"] = str(root / "work" / "cache")
    done = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return script, done.stdout + done.stderr


@pytest.mark.slow
def test_the_profiling_pod_calibrates_on_the_jobs_tables_and_publishes(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, tmp_path: Path
) -> None:
    add_node(kube, "node-1", gpus=4)
    start_operator()
    planner = {"device": "cpu", "gpuMemory": "1Gi", "batchSizePerRank": 16}
    profiling = {"policy": "IfStale", "calibrationMinutes": 1, "backoffSeconds": 1}
    kube.create(dlrmjob("calib", NS, TINY, workers=(1, 1), planner=planner, profiling=profiling))
    name = profiling_job_name("calib", "cpu", 1)
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    start = time.monotonic()
    script, log = run_pod(kube, job, api_server.url, tmp_path)
    seconds = time.monotonic() - start
    assert "--minutes 1 --measure-on cpu" in script
    assert "published the cpu cost model as shardwise-costmodel-cpu-0" in log, log
    # and, before it, the job's plan refined by measurement with the calibrated model
    assert "published the refined plan for 2 GPUs as calib-refined-2-" in log, log
    assert seconds < 200, f"a 1-minute budget took {seconds:.0f} s"
    finish_job(kube, NS, name, ok=True)  # as the Job controller, once the pod exited 0

    status = wait_phase(kube, NS, "calib", "Running", timeout=60)
    assert status["plan"]["kind"] == "Refined", status["plan"]
    assert status["plan"]["refinement"]["finalMaxMs"] <= status["plan"]["refinement"]["startMaxMs"]
    model = status["costModel"]
    assert (model["source"], model["configMap"]) == ("Published", "shardwise-costmodel-cpu")
    cal = model["calibration"]
    assert (cal["tablesCovered"], cal["tablesTotal"]) == (4, 4)
    assert (cal["gpus"], cal["batchPerRank"], cal["budgetMinutes"]) == (2, 16, 1)
    assert cal["machine"].startswith("cpu:") and cal["fingerprint"] == model["fingerprint"]
    assert set(cal["speedFactors"]) == {"fwd", "bwd", "comm"}
    assert all(f > 0 for f in cal["speedFactors"].values())
    assert cal["samples"]["compute"] > 0 and 0 < cal["seconds"] <= seconds
    assert "final.rank_mape" in cal["metrics"], cal["metrics"]
    assert cal["phases"][0] == "anchors" and cal["base"] == "the bundled CPU model"

    # the same tables in another job: the published model covers them, no profiling
    kube.create(
        dlrmjob("calib-two", NS, TINY, workers=(1, 1), planner=planner, profiling=profiling)
    )
    second = wait_phase(kube, NS, "calib-two", "Running", timeout=60)
    assert second["costModel"]["calibration"]["tablesCovered"] == 4
    assert kube.get("batch/v1", "jobs", NS, profiling_job_name("calib-two", "cpu", 1)) is None
