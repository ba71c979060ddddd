"""The child objects (:mod:`shardwise.operator.render`)."""

from __future__ import annotations

from operator_builders import A100, CFG, JOB, spec

from shardwise import names
from shardwise.operator import constants as c
from shardwise.operator import render


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


def test_cpu_jobs_request_no_gpus_and_profile_without_comm() -> None:
    cpu = spec(planner={"device": "cpu", "gpuMemory": "4Gi"}, gpusPerWorker=4)
    body = render.worker_job(JOB, cpu, "p", "a" * 64, 2, "cpu", CFG)
    pod = body["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "nodeSelector" not in pod
    assert "profile comm" not in render.profiling_script(JOB, cpu, "cpu")
    gpu = spec(gpusPerWorker=8)
    assert "--world-size 2 --world-size 4 --world-size 8" in render.profiling_script(JOB, gpu, A100)


def test_profiling_jobs_carry_their_settings_hash() -> None:
    s = spec(profiling={"policy": "IfStale"})
    body = render.profiling_job(JOB, s, A100, 3, CFG)
    h = body["metadata"]["annotations"][names.ANN_SETTINGS_HASH]
    assert h == render.profiling_settings_hash(JOB, s, A100, CFG)
    assert (
        h
        == render.profiling_job(JOB, s, A100, 4, CFG)["metadata"]["annotations"][
            names.ANN_SETTINGS_HASH
        ]
    ), "the attempt number is not a setting"
    other = spec(profiling={"policy": "IfStale", "computeSamples": 400})
    assert render.profiling_settings_hash(JOB, other, A100, CFG) != h
    container = body["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
