"""Plans a profiling pod refined by measurement: the pod's script refines for the job's
size and its neighbours with the job's settings, publishes them (publish_plans.py), and
the operator runs a published refined plan whose inputs match its own (refined_plans.py,
planmaker.py): ``status.plan.kind: Refined`` with what was measured, else ``ModelOnly``
and why. The operator tests run kopf against the emulator; a profiling pod's work is
done by the test as the pod would do it (its publish step is the real one), and once
for real: the rendered script's refine and publish lines run here on the CPU."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from k8s.helpers import (
    DJ,
    GPU_TYPE,
    NAMESPACE,
    ROOT,
    add_node,
    dlrmjob,
    finish_job,
    table,
    wait_for,
    wait_phase,
)
from k8s.server import EmulatorServer
from kubernetes import client as k8s_client
from operator_builders import A100, CFG, JOB, spec
from test_operator_calibration import kubeconfig

from shardwise import names
from shardwise.basics import UserError
from shardwise.names import profiling_job_name, refined_plan_name
from shardwise.operator.crd import TableEntry, inline_tables, parse_spec
from shardwise.operator.kube import KubeApi
from shardwise.operator.loop.planmaker import on_hosts
from shardwise.operator.models import refined_plans as rp
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.pod import publish_plans
from shardwise.operator.pod.publish_model import ModelFacts, publish_cost_model
from shardwise.operator.render import children as render
from shardwise.planner.plan import Plan, Refinement, table_wise_plan
from shardwise.planner.tables import TableSpec, table_signature
from shardwise.planner.topology import Topology
from shardwise.profiler.refine.worlds import RefinedSet, SizeResult

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
MODEL = ROOT / "planner" / "data" / "costmodel-cpu.pt"


def inputs(**changes: Any) -> PlanInputs:
    base: dict[str, Any] = dict(
        tables=[], planner="neuroshard", seed=0, gpu_type=A100, workers=2, gpus_per_worker=2,
        gpu_memory_bytes=2 * 2**30, memory_reserve=0.15, batch_size_per_rank=4096,
        device="cuda",
    )  # fmt: skip
    return PlanInputs(**(base | changes))


def refined(plan: Plan, start_ms: float = 12.0, final_ms: float = 10.0) -> Plan:
    """``plan`` with a refinement record, as ``refine_measured`` leaves it."""
    world = plan.world_size
    rec = Refinement(
        device="cuda:0",
        batch_size_per_rank=plan.topology.batch_size_per_rank,
        start_hash="s" * 64,
        moves=2,
        kernels_measured=40,
        seconds=31.5,
        comm="nvlink preset",
        start_max_compute_seconds=0.9 * start_ms / 1e3,
        final_max_compute_seconds=0.9 * final_ms / 1e3,
        believed_max_compute_seconds=0.85 * final_ms / 1e3,
        final_per_rank_compute_seconds=[0.9 * final_ms / 1e3] * world,
        start_objective_seconds=start_ms / 1e3,
        final_objective_seconds=final_ms / 1e3,
    )
    return plan.model_copy(update={"refinement": rec})


def tables_of_job(count: int = 6) -> list[TableSpec]:
    """The specs of :func:`dlrmjob`'s tables."""
    return [TableEntry.model_validate(table(i)).to_spec() for i in range(count)]


def plan_for(tables: list[TableSpec], topology: Topology) -> Plan:
    return refined(table_wise_plan(tables, [i % topology.gpus for i in range(len(tables))],
                                   topology, "neuroshard"))  # fmt: skip


def write_refined_dir(directory: Path, plans: list[Plan], seed: int = 0) -> None:
    """What ``shardwise refine-plans`` leaves: plan files and the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    sizes = []
    for plan in plans:
        file = f"plan-{plan.world_size}.json"
        (directory / file).write_text(plan.model_dump_json(indent=1))
        sizes.append(SizeResult(plan.world_size, "refined", file=file, plan_hash=plan.hash,
                                torchrec_objective_seconds=0.0131))  # fmt: skip
    done = RefinedSet(directory, sizes, "NVIDIA A100-SXM4-80GB (108 SMs)", "fp-a100", 42.0)
    manifest = done.manifest({"seed": seed})
    (directory / "refined.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- the key


def test_a_refined_plan_matches_only_the_inputs_it_was_made_for() -> None:
    want = rp.Wanted.of(inputs(), "tables-1")
    made = rp.RefinedPlanInfo("dj-refined-4-x", "ml", ("uid-1",), want.key(), want, "h")
    assert rp.choose([made], want) == (made, "")
    for change, why in (
        (dict(batch_size_per_rank=2048), "batch 4096 per rank (the job's: 2048)"),
        (dict(gpu_memory_bytes=4 * 2**30), "GPU memory 2.0 GiB (the job's: 4.0 GiB)"),
        (dict(memory_reserve=0.2), "memory reserve 0.15 (the job's: 0.2)"),
        (dict(seed=3), "planner seed 0 (the job's: 3)"),
        (dict(device="cpu"), "device cuda (the job's: cpu)"),
    ):
        other = rp.Wanted.of(inputs(**change), "tables-1")
        assert other.key() != want.key(), change
        assert rp.choose([made], other) == (
            None,
            f"the refined plan for 4 GPUs (dj-refined-4-x) was made for {why}",
        )
    tables = rp.Wanted.of(inputs(), "tables-2")
    assert "made for other tables" in rp.choose([made], tables)[1]
    bigger = rp.Wanted.of(inputs(workers=3), "tables-1")
    assert rp.choose([made], bigger) == (
        None,
        "no refined plan for 6 GPUs; the profiling pod refined for 4 GPUs",
    )
    two = dataclasses.replace(made, made_for=dataclasses.replace(want, world_size=2))
    assert "refined for 2 and 4 GPUs" in rp.choose([made, two], bigger)[1]
    assert rp.choose([], want) == (None, "no refined plan was published for this job")
    # a key that does not say what its annotation says is never trusted
    forged = dataclasses.replace(made, key=bigger.key())
    assert rp.choose([forged], bigger)[0] is None and rp.choose([forged], want)[0] is None


def test_no_refined_plan_is_expected_and_why() -> None:
    assert rp.not_refining(spec(profiling={"policy": "IfStale"})) is None
    assert "policy is Never" in str(rp.not_refining(spec(profiling={"policy": "Never"})))
    off = spec(profiling={"policy": "Always", "refinement": {"enabled": False}})
    assert rp.not_refining(off) == "spec.profiling.refinement.enabled is false"
    greedy = spec(profiling={"policy": "Always"}, planner={"algorithm": "size-greedy"})
    assert "size-greedy" in str(rp.not_refining(greedy))


# --------------------------------------------------------------------------- publish ↔ parse


def test_publish_and_the_operators_summary_round_trip() -> None:
    tables = tables_of_job()
    topo = Topology(gpus=4, gpu_memory_bytes=2 * 2**30, batch_size_per_rank=4096)
    plan = plan_for(tables, topo)
    entry = SizeResult(4, "refined", file="plan-4.json", torchrec_objective_seconds=0.0131)
    manifest = {"measuredOn": "NVIDIA A100 (108 SMs)", "modelFingerprint": "fp-a100"}
    now = datetime.datetime(2026, 5, 1, 12, tzinfo=datetime.UTC)
    figures = publish_plans.figures(plan, entry.to_json(), manifest, now)
    body = publish_plans.refined_configmap(
        plan, job="dj", job_uid="uid-1", namespace="ml", gpu_type=A100,
        tables_hash="tables-1", seed=0, figures=figures,
    )  # fmt: skip
    meta = body["metadata"]
    info = rp.parse_refined(body)
    assert info is not None
    want = rp.Wanted.of(inputs(), "tables-1")
    assert info.made_for == want and info.key == want.key() and info.plan_hash == plan.hash
    assert meta["name"] == refined_plan_name("dj", 4, want.key())
    assert meta["labels"] == {
        names.LABEL_JOB: "dj",
        names.LABEL_COMPONENT: names.COMPONENT_REFINED_PLAN,
        names.LABEL_GPU_TYPE: A100,
    }
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("DLRMJob", "dj", "uid-1")
    assert Plan.model_validate_json(body["data"][names.PLAN_KEY]) == plan
    assert info.status() == {
        "configMap": meta["name"],
        "device": "cuda:0",
        "measuredOn": "NVIDIA A100 (108 SMs)",
        "batchSizePerRank": 4096,
        "startMaxMs": 12.0,
        "finalMaxMs": 10.0,
        "startMaxComputeMs": 10.8,
        "finalMaxComputeMs": 9.0,
        "torchrecMaxMs": 13.1,
        "moves": 2,
        "kernels": 40,
        "seconds": 31.5,
        "modelFingerprint": "fp-a100",
        "publishedAt": "2026-05-01T12:00:00Z",
    }
    assert rp.choose([info], want)[0] == info
    # another component's ConfigMap, or an unreadable annotation, is no refined plan
    assert rp.parse_refined({**body, "metadata": {**meta, "labels": {}}}) is None
    broken = {**meta, "annotations": {rp.ANN_REFINED: "{"}}
    assert rp.parse_refined({**body, "metadata": broken}) is None


def test_a_plan_larger_than_a_configmap_is_refused(tmp_path: Path) -> None:
    many = [TableSpec(name=f"table_with_a_long_name_{i:05d}", rows=100, dim=4, pooling_factor=1.0)
            for i in range(9000)]  # fmt: skip
    topo = Topology(gpus=8, gpu_memory_bytes=2**34, batch_size_per_rank=64)
    plan = plan_for(many, topo)
    with pytest.raises(UserError, match="more than a ConfigMap holds"):
        publish_plans.refined_configmap(
            plan, job="dj", job_uid="u", namespace="ml", gpu_type=A100, tables_hash="t",
            seed=0, figures={},
        )  # fmt: skip
    small = plan_for(tables_of_job(), Topology(gpus=2, gpu_memory_bytes=2**31))
    write_refined_dir(tmp_path / "r", [plan, small])
    created: list[dict[str, Any]] = []

    class Api:
        def create_namespaced_config_map(self, namespace: str, body: Any, **_: Any) -> None:
            created.append(body)

        def replace_namespaced_config_map(self, *a: Any, **_: Any) -> None:
            raise AssertionError("nothing to replace")

    args = [str(tmp_path / "r"), "--gpu-type", A100, "--namespace", "ml", "--job", "dj",
            "--tables-hash", "t", "--job-uid", "uid-1"]  # fmt: skip
    assert publish_plans.main(args, api=Api()) == 2, "a refused plan is an error"
    published = [rp.parse_refined(b) for b in created]
    assert [p.made_for.world_size for p in published if p is not None] == [2], (
        "the others are still published"
    )
    assert publish_plans.main(args[:-2], api=Api()) == 2, "no uid: no owner, no plan"


# --------------------------------------------------------------------------- the pod's script


def test_the_pod_refines_for_the_jobs_size_and_neighbours_with_its_settings() -> None:
    s = spec(
        workers=(1, 4),
        planner={"batchSizePerRank": 2048, "memoryReserve": 0.2, "options": {"seed": 7}},
        profiling={"refinement": {"budgetSeconds": 240}},
    )
    calibration = render.Calibration("dj-tables-1", "tables-1", 4, None, 80 * 2**30)
    script = render.profiling_script(JOB, s, A100, calibration)
    lines = script.splitlines()
    refine = next(i for i, line in enumerate(lines) if line.startswith("shardwise refine-plans"))
    assert "shardwise calibrate" in lines[refine - 1], "after the calibration"
    words = shlex.split(lines[refine].split(" || ")[0])
    assert words[words.index("--model") + 1] == f"{render.PROFILE_WORK_DIR}/model.pt"
    assert [words[i + 1] for i, w in enumerate(words) if w == "--gpus"] == ["4", "2", "6"], (
        "the job's 2 workers x 2 GPUs first, then one worker fewer and one more"
    )
    opts = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and w != "--gpus"}
    assert opts["--batch-per-rank"] == "2048" and opts["--gpu-memory"] == str(80 * 2**30)
    assert opts["--reserve"] == "0.2" and opts["--seed"] == "7" and opts["--budget"] == "240"
    assert opts["--target-device"] == opts["--measure-on"] == "cuda"
    assert opts["--tables"] == f"{render.PROFILE_TABLES_DIR}/tables.yaml"
    assert opts["--gpus-per-host"] == "2", "each worker pod is a host of the refined plans"
    publish = shlex.split(lines[refine + 1].split(" || ")[0])
    assert publish[:3] == ["python", "-m", "shardwise.operator.pod.publish_plans"]
    assert publish[3] == opts["--out-dir"]
    assert publish[publish.index("--tables-hash") + 1] == "tables-1"
    assert publish[publish.index("--job") + 1] == "dj"
    assert "shardwise.operator.pod.publish_model" in lines[-1], "the model is published last"
    body = render.profiling_job(JOB, s, A100, 1, CFG, calibration)
    env = {e["name"]: e["value"] for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[rp.ENV_JOB_UID] == "uid-1"


def test_the_sizes_stay_within_workers_min_and_max() -> None:
    def sizes(workers: tuple[int, int], world: int, **refinement: Any) -> list[int]:
        s = spec(workers=workers, profiling={"refinement": refinement})
        return rp.world_sizes(s, world)

    assert sizes((2, 2), 4) == [4]
    assert sizes((1, 2), 4) == [4, 2]
    assert sizes((2, 5), 4) == [4, 6]
    assert sizes((1, 5), 4, neighbours=False) == [4]


def test_no_refine_step_when_disabled_or_out_of_time() -> None:
    cal = render.Calibration("dj-tables-1", "tables-1", 4, None, 2**31)

    def script(**changes: Any) -> str:
        return render.profiling_script(JOB, spec(**changes), A100, cal)

    off = script(profiling={"refinement": {"enabled": False}})
    assert "refine-plans" not in off and "publish_plans" not in off
    assert "# no measured refinement: spec.profiling.refinement.enabled is false" in off
    greedy = script(planner={"algorithm": "size-greedy"})
    assert "refine-plans" not in greedy
    # 1800 s: 10 minutes of calibration and 5 of margin leave 900 s: the budget stands
    assert "--budget 300 " in script(profiling={"timeoutSeconds": 1800})
    # 1000 s leave 100 s after the calibration and the margin: the budget is cut to it
    assert "--budget 100 " in script(profiling={"timeoutSeconds": 1000})
    tight = script(profiling={"timeoutSeconds": 600})
    assert "refine-plans" not in tight and "leaves no time" in tight


# --------------------------------------------------------------------------- the operator


def publish_model_as_the_pod_would(
    url: str, job: str, tables: list[TableSpec], gpu_type: str = GPU_TYPE
) -> None:
    api = k8s_client.CoreV1Api(k8s_client.ApiClient(k8s_client.Configuration(host=url)))
    calibration = {"fingerprint_key": "fp-a100", "tables": [table_signature(t) for t in tables]}
    facts = ModelFacts("fp-a100", "NVIDIA A100-SXM4-80GB (108 SMs)", calibration)
    publish_cost_model(MODEL, gpu_type, NS, api, job=job, facts=facts, minutes=10)


def pod_steps(kube: KubeApi, name: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """The profiling Job, and its refine and publish lines as words."""
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    lines = job["spec"]["template"]["spec"]["containers"][0]["command"][2].splitlines()
    refine = next(line for line in lines if line.startswith("shardwise refine-plans"))
    publish = next(line for line in lines if "shardwise.operator.pod.publish_plans" in line)
    return job, shlex.split(refine.split(" || ")[0]), shlex.split(publish.split(" || ")[0])


def do_the_pods_work(
    api_server: EmulatorServer, kube: KubeApi, job: str, tmp_path: Path, tamper: Any = None
) -> dict[str, Any]:
    """What the profiling pod does after calibrating, its measurements made up: plans
    for the sizes its script names, with its settings, published by the real step."""
    name = profiling_job_name(job, GPU_TYPE, 1)
    body, refine, publish = pod_steps(kube, name)
    opts = {w: refine[i + 1] for i, w in enumerate(refine) if w.startswith("--")}
    worlds = [int(refine[i + 1]) for i, w in enumerate(refine) if w == "--gpus"]
    tables = tables_of_job()
    plans = []
    for world in worlds:
        topo = Topology(
            gpus=world,
            gpu_memory_bytes=int(opts["--gpu-memory"]),
            device=opts["--target-device"],  # type: ignore[arg-type]
            batch_size_per_rank=int(opts["--batch-per-rank"]),
            memory_reserve=float(opts["--reserve"]),
        )
        plan = plan_for(tables, topo)
        plans.append(tamper(plan) if tamper is not None else plan)
    write_refined_dir(tmp_path / "refined", plans, seed=int(opts["--seed"]))
    env = {e["name"]: e["value"] for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
    api = k8s_client.CoreV1Api(k8s_client.ApiClient(k8s_client.Configuration(host=api_server.url)))
    argv = [str(tmp_path / "refined"), *publish[4:], "--job-uid", env[rp.ENV_JOB_UID]]
    assert publish_plans.main(argv, api=api) == 0
    publish_model_as_the_pod_would(api_server.url, job, tables)
    finish_job(kube, NS, name, ok=True)
    return body


def test_the_operator_runs_the_refined_plan_made_for_its_inputs(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, tmp_path: Path
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("ref", NS, policy="Always"))
    do_the_pods_work(api_server, kube, "ref", tmp_path)
    status = wait_phase(kube, NS, "ref", "Running")
    plan = status["plan"]
    assert plan["kind"] == "Refined" and "why" not in plan
    r = plan["refinement"]
    assert (r["device"], r["batchSizePerRank"], r["moves"], r["seconds"]) == (
        "cuda:0",
        4096,
        2,
        31.5,
    )
    assert (r["startMaxMs"], r["finalMaxMs"], r["torchrecMaxMs"]) == (12.0, 10.0, 13.1)
    assert r["measuredOn"].startswith("NVIDIA A100") and r["configMap"].startswith("ref-refined-4-")
    # the plan ConfigMap holds the refined plan itself: the planner did not run
    cm = kube.get("v1", "configmaps", NS, plan["configMap"])
    assert cm is not None
    ran = Plan.model_validate_json(cm["data"][names.PLAN_KEY])
    published = kube.get("v1", "configmaps", NS, r["configMap"])
    assert published is not None
    # made for 4 GPUs as one host (the pod refines for a world size), it runs on the
    # job's hosts: 2 worker pods of 2 GPUs, rehashed, the placement as refined
    refined_plan = Plan.model_validate_json(published["data"][names.PLAN_KEY])
    assert refined_plan.topology.gpus_per_host is None and ran.topology.gpus_per_host == 2
    assert ran == on_hosts(refined_plan, ran.topology) and ran.tables == refined_plan.tables
    assert ran.refinement is not None and ran.hash == plan["hash"] == ran.content_hash()
    assert (
        published["metadata"]["ownerReferences"][0]["uid"]
        == cm["metadata"]["ownerReferences"][0]["uid"]
    )
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert "refined by measurement on cuda:0: 12.00 -> 10.00 ms measured" in planned["message"]


def test_model_only_says_why_when_no_refined_plan_fits(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, tmp_path: Path
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("never", NS, policy="Never"))
    never = wait_phase(kube, NS, "never", "Running")["plan"]
    assert never["kind"] == "ModelOnly"
    assert never["why"] == "spec.profiling.policy is Never: no profiling pod refines plans"

    # the refined plan for the job's 4 GPUs names a table the job does not have (its
    # signatures, and so its key, are the job's): it is not used, and why says so
    def rename(plan: Plan) -> Plan:
        if plan.world_size != 4:
            return plan
        tables = [t.model_copy(update={"name": "x" + t.name}) for t in plan.tables]
        return plan.model_copy(update={"tables": tables})

    kube.create(dlrmjob("bad", NS, policy="Always"))
    do_the_pods_work(api_server, kube, "bad", tmp_path, tamper=rename)
    bad = wait_phase(kube, NS, "bad", "Running")["plan"]
    assert bad["kind"] == "ModelOnly" and "refinement" not in bad
    assert bad["why"].startswith("the refined plan bad-refined-4-"), bad["why"]
    assert "is not valid here" in bad["why"]


# --------------------------------------------------------------------------- for real


@pytest.mark.slow
def test_the_pods_refine_and_publish_lines_run_for_real(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, tmp_path: Path
) -> None:
    """The rendered script's own lines, on this CPU: `shardwise refine-plans` plans and
    measures the job's 4 tiny tables for 2 ranks (the job's) and 4 (one worker more)
    within their budget, `publish_plans` publishes them to the emulator, and
    the operator runs the one for 2 ranks."""
    add_node(kube, "node-1", gpus=4)
    start_operator()
    tiny = [
        {"name": f"t{i}", "rows": rows, "dim": dim, "poolingFactor": pool}
        for i, (rows, dim, pool) in enumerate(
            [(2000, 16, 3.0), (5000, 32, 5.0), (800, 8, 1.5), (3000, 16, 8.0)]
        )
    ]
    planner = {"device": "cpu", "gpuMemory": "1Gi", "batchSizePerRank": 16}
    # 90 s, not the minimum 30: planning comes out of the budget, and beside two busy
    # loops planning a world once left 0-1.5 s of its 15 s ("not refined … give a
    # larger --budget"). Refinement of 4 tiny tables ends early when no move is left.
    profiling = {"policy": "Always", "refinement": {"budgetSeconds": 90}}
    kube.create(dlrmjob("live", NS, tiny, workers=(1, 2), planner=planner, profiling=profiling))
    name = profiling_job_name("live", "cpu", 1)
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    lines = container["command"][2].splitlines()
    steps = [line for line in lines if "refine-plans" in line or "publish_plans" in line]
    assert len(steps) == 2 and "--gpus 2 --gpus 4 " in steps[0]
    work, tables_dir = tmp_path / "work", tmp_path / "tables"
    work.mkdir()
    tables_dir.mkdir()
    shutil.copy(MODEL, work / "model.pt")  # what the calibration would have written
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "tables")
    copied = kube.get("v1", "configmaps", NS, volume["configMap"]["name"])
    assert copied is not None
    (tables_dir / "tables.yaml").write_text(copied["data"]["tables.yaml"])
    script = "set -eu\n" + "\n".join(steps) + "\n"
    script = script.replace(render.PROFILE_WORK_DIR, str(work))
    script = script.replace(render.PROFILE_TABLES_DIR, str(tables_dir))
    env = {
        **os.environ,
        **{e["name"]: e["value"] for e in container["env"]},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "KUBECONFIG": str(kubeconfig(api_server.url, tmp_path / "kubeconfig")),
        "SHARDWISE_MODEL_CACHE": str(work / "cache"),
        "COLUMNS": "200",
    }
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "warning" not in log, log
    assert "published the refined plan for 2 GPUs as live-refined-2-" in log, log
    specs = inline_tables(parse_spec(kube.get(*DJ, NS, "live")["spec"]))
    publish_model_as_the_pod_would(api_server.url, "live", specs, "cpu")
    finish_job(kube, NS, name, ok=True)
    status = wait_phase(kube, NS, "live", "Running", timeout=60)
    plan = status["plan"]
    assert plan["kind"] == "Refined", plan
    r = plan["refinement"]
    assert r["device"] == "cpu" and r["batchSizePerRank"] == 16
    assert r["finalMaxMs"] <= r["startMaxMs"] and r["kernels"] > 0
    assert r["measuredOn"].startswith("cpu:")
