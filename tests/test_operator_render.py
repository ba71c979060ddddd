"""The child objects (:mod:`shardwise.operator.render.children`)."""

from __future__ import annotations

import re
from typing import Any

from operator_builders import A100, CFG, JOB, NOW, spec

from shardwise import names
from shardwise.operator.config import OperatorConfig
from shardwise.operator.crd import inline_tables
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.render import children as render
from shardwise.operator.render import container as c
from shardwise.planner.tables import parse_tables


def test_worker_command_honours_the_users_command() -> None:
    custom = spec(template={"image": "x", "command": ["bash", "-c", "run.sh"], "args": ["--fast"]})
    assert render.worker_command(JOB, custom, 3) == (["bash", "-c", "run.sh"], ["--fast"])
    default = spec(template={"image": "x", "checkpointDir": "/ckpt", "args": ["--steps", "5"]})
    cmd, args = render.worker_command(JOB, default, 3)
    assert cmd == list(c.LAUNCHER) and args[0] == "--nnodes=3"
    assert args[-7:] == [
        c.DEFAULT_ENTRY,
        "--tables",
        names.TABLES_PATH,
        "--checkpoint-dir",
        "/ckpt",
        "--steps",
        "5",
    ]
    body = render.worker_job(JOB, custom, "dj-plan-x", "f" * 64, 3, A100, CFG)
    env = {e["name"]: e["value"] for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (
        env[names.ENV_NNODES] == "3"
        and env[names.ENV_RDZV_ENDPOINT] == "dj-workers-0.dj-workers:29500"
    )


def test_template_hash_ignores_suspend_but_not_the_plan() -> None:
    a = render.worker_job(JOB, spec(), "p1", "a" * 64, 2, A100, CFG)
    b = render.worker_job(JOB, spec(suspend=True), "p1", "a" * 64, 2, A100, CFG)
    d = render.worker_job(JOB, spec(), "p2", "b" * 64, 2, A100, CFG)
    key = names.ANN_TEMPLATE_HASH
    assert a["metadata"]["annotations"][key] == b["metadata"]["annotations"][key]
    assert a["metadata"]["annotations"][key] != d["metadata"]["annotations"][key]


def _worker_pod(s: Any, config: OperatorConfig, job: render.JobMeta = JOB) -> dict[str, Any]:
    body = render.worker_job(job, s, "p", "a" * 64, 2, A100, config)
    pod: dict[str, Any] = body["spec"]["template"]["spec"]
    return pod


def test_workers_learn_their_live_configmap_and_may_write_it() -> None:
    """Rank 0 writes the live summary to the ConfigMap named in its env, through the
    template's account, else the operator's where that exists, else the default."""
    pod = _worker_pod(spec(), CFG)
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env[names.ENV_LIVE_CONFIGMAP] == "dj-live" == names.live_configmap_name(JOB.name)
    assert "serviceAccountName" not in pod, "no account configured: the namespace's default"
    cfg = OperatorConfig(worker_service_account="shardwise-worker")
    assert _worker_pod(spec(), cfg)["serviceAccountName"] == "shardwise-worker"
    own = spec(template={"image": "x", "serviceAccountName": "team-sa"})
    assert _worker_pod(own, cfg)["serviceAccountName"] == "team-sa", "the template wins"
    # Only where the account exists: a pod naming a missing one is never created.
    scoped = OperatorConfig(
        worker_service_account="shardwise-worker",
        worker_service_account_namespaces=frozenset({"ml", "team-a"}),
    )
    assert _worker_pod(spec(), scoped)["serviceAccountName"] == "shardwise-worker"
    elsewhere = render.JobMeta("dj", "team-b", "uid-2", 1)
    assert "serviceAccountName" not in _worker_pod(spec(), scoped, elsewhere)
    assert _worker_pod(own, scoped, elsewhere)["serviceAccountName"] == "team-sa"


def test_the_live_configmap_starts_empty_and_goes_with_the_job() -> None:
    body = render.live_configmap(JOB)
    meta = body["metadata"]
    assert (body["apiVersion"], body["kind"], body["data"]) == ("v1", "ConfigMap", {})
    assert meta["name"] == names.live_configmap_name("dj") and meta["namespace"] == "ml"
    assert meta["labels"] == {names.LABEL_JOB: "dj", names.LABEL_COMPONENT: names.COMPONENT_LIVE}
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == "uid-1" and owner["kind"] == names.KIND and owner["controller"]
    assert "immutable" not in body, "rank 0 patches it"


def calibration(base: CostModelInfo | None = None, world: int = 4) -> render.Calibration:
    return render.Calibration("dj-tables-0123abcd", "t" * 16, world, base)


def test_cpu_jobs_request_no_gpus() -> None:
    cpu = spec(planner={"device": "cpu", "gpuMemory": "4Gi"}, gpusPerWorker=4)
    body = render.worker_job(JOB, cpu, "p", "a" * 64, 2, "cpu", CFG)
    pod = body["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "nodeSelector" not in pod
    prof = render.profiling_job(JOB, cpu, "cpu", 1, CFG, calibration())["spec"]["template"]
    assert "resources" not in prof["spec"]["containers"][0]
    assert "nodeSelector" not in prof["spec"]
    assert "--measure-on cpu" in prof["spec"]["containers"][0]["command"][2]


def test_profiling_calibrates_on_the_jobs_tables_and_batch() -> None:
    s = spec(
        planner={"batchSizePerRank": 2048, "gpuMemory": "2Gi"}, profiling={"calibrationMinutes": 7}
    )
    script = render.profiling_script(JOB, s, A100, calibration(world=8))
    calibrate = next(line for line in script.splitlines() if "shardwise calibrate" in line)
    assert calibrate.split()[2:15] == [
        "--tables", f"{render.PROFILE_TABLES_DIR}/tables.yaml",
        "--gpus", "8", "--batch-per-rank", "2048", "--minutes", "7", "--measure-on", "cuda",
        '"$@"', "--seed", "1",
    ]  # fmt: skip
    assert calibrate.split()[15:17] == ["--gpu-memory", str(2 * 1024**3)], "plans fill as the job's"
    unsized = render.profiling_script(JOB, spec(gpu_memory=None), A100, calibration(world=8))
    assert "--gpu-memory" not in unsized, "no spec.planner.gpuMemory: calibrate's default"
    assert "shardwise.operator.pod.base_model" not in script, "no published model: the bundled one"
    assert "set -- --base-name 'the bundled CPU model'" in script.splitlines()
    assert script.splitlines()[-1] == (
        f"python -m shardwise.operator.pod.publish_model {render.PROFILE_WORK_DIR}/model.pt "
        f"--gpu-type {A100} --namespace ml --job dj --minutes 7"
    )
    body = render.profiling_job(JOB, s, A100, 1, CFG, calibration(world=8))
    pod = body["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tables"]["configMap"] == {"name": "dj-tables-0123abcd"}
    assert volumes["work"] == {"name": "work", "emptyDir": {}}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {render.PROFILE_TABLES_DIR, render.PROFILE_WORK_DIR, "/tmp"}
    assert body["metadata"]["annotations"][names.ANN_TABLES_HASH] == "t" * 16


def test_the_budget_ends_before_the_attempts_deadline() -> None:
    def budget(**profiling: int) -> str:
        script = render.profiling_script(JOB, spec(profiling=profiling), A100, calibration())
        return script.split("--minutes ")[1].split()[0]

    assert budget() == "10"
    assert budget(calibrationMinutes=120) == "115", "7200 s less 5 minutes"
    assert budget(calibrationMinutes=120, timeoutSeconds=7500) == "120"
    assert budget(timeoutSeconds=600) == "5" and budget(timeoutSeconds=60) == "1"


def test_profiling_starts_from_the_published_model() -> None:
    base = CostModelInfo(A100, "shardwise-costmodel-a100", NOW, "fp", "ab" * 32, "ml", chunks=2)
    body = render.profiling_job(JOB, spec(), A100, 1, CFG, calibration(base))
    pod = body["spec"]["template"]["spec"]
    script = pod["containers"][0]["command"][2]
    assert (
        f"if python -m shardwise.operator.pod.base_model {render.PROFILE_BASE_DIR} --chunks 2 "
        f"--sha256 {'ab' * 32} --out {render.PROFILE_WORK_DIR}/base.pt; "
        f"then set -- --base-model {render.PROFILE_WORK_DIR}/base.pt --base-name "
        "'the published model shardwise-costmodel-a100 (published 2026-05-01T12:00:00Z)'; fi"
    ) in script.splitlines()
    chunks = [v["configMap"] for v in pod["volumes"] if v["name"].startswith("base-")]
    assert chunks == [
        {"name": "shardwise-costmodel-a100-0", "optional": True},
        {"name": "shardwise-costmodel-a100-1", "optional": True},
    ]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["base-1"] == f"{render.PROFILE_BASE_DIR}/1"


def test_the_tables_configmap_is_named_by_its_content() -> None:
    tables = inline_tables(spec())
    body = render.tables_configmap(JOB, tables)
    assert body["immutable"] is True and body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert re.fullmatch(r"dj-tables-[0-9a-f]{8}", body["metadata"]["name"])
    assert parse_tables(body["data"]["tables.yaml"], "yaml") == tables
    assert body["metadata"]["labels"][names.LABEL_COMPONENT] == names.COMPONENT_PROFILER
    other = render.tables_configmap(JOB, tables[:-1])
    assert other["metadata"]["name"] != body["metadata"]["name"]


def test_profiling_jobs_carry_their_settings_hash() -> None:
    s = spec(profiling={"policy": "IfStale"})
    body = render.profiling_job(JOB, s, A100, 3, CFG, calibration())
    h = body["metadata"]["annotations"][names.ANN_SETTINGS_HASH]
    assert h == render.profiling_settings_hash(JOB, s, A100, CFG, calibration())
    again = render.profiling_job(JOB, s, A100, 4, CFG, calibration())
    assert h == again["metadata"]["annotations"][names.ANN_SETTINGS_HASH], (
        "the attempt number is not a setting"
    )
    other = spec(profiling={"policy": "IfStale", "calibrationMinutes": 3})
    assert render.profiling_settings_hash(JOB, other, A100, CFG, calibration()) != h
    assert render.profiling_settings_hash(JOB, s, A100, CFG, calibration(world=8)) != h
    container = body["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
