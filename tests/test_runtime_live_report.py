"""Rank 0's live summary (``shardwise.runtime.live_report``), written for real.

Workers are ``torchrun`` processes with gloo on CPU running the image's default entry,
writing to the API emulator over HTTP through the official client and a kubeconfig
(what a pod's service account gives it). The data drift option makes one table far
heavier than declared, so the summary must name its shard as the costliest and its
rank as the straggler. Also: an unreachable API only warns, the ConfigMap is created
(owned by the DLRMJob) when absent, and the drift option's bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.server import EmulatorServer
from test_runtime_torchrun import TORCHRUN, _env, run, small_tables, trainer

from shardwise import names
from shardwise.basics import UserError
from shardwise.operator.kube import KubeApi
from shardwise.planner.kinds import Kind, even_row_split
from shardwise.planner.live.replan import replan
from shardwise.planner.live.summary import LiveSummary
from shardwise.planner.plan import Plan, Shard, save_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.runtime.dlrm import drifted_specs, parse_pooling
from shardwise.runtime.live_report import ConfigMapWriter, LiveTarget, configmap_body

NS = "ml"
JOB = "job1"
CM = names.live_configmap_name(JOB)
BATCH = 256
#: The table the data read far more than its spec declares.
HEAVY = "table_0002"


def kubeconfig(url: str, path: Path) -> Path:
    """What a pod's service account gives the official client: the API server."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "worker", "user": {}}],
        "contexts": [{"name": "pod", "context": {"cluster": "emulator", "user": "worker"}}],
        "current-context": "pod",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def api() -> Iterator[tuple[EmulatorServer, KubeApi]]:
    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    yield server, kube
    kube.close()
    server.stop()
    assert server.emulator.unexpected == [], "the emulator hit an internal error"


def live_env(url: str, tmp: Path, **extra: str) -> dict[str, str]:
    return _env(
        KUBECONFIG=str(kubeconfig(url, tmp / "kubeconfig")),
        SHARDWISE_NAMESPACE=NS,
        SHARDWISE_JOB=JOB,
        SHARDWISE_LIVE_CONFIGMAP=CM,
        **extra,
    )


def read_summary(kube: KubeApi) -> tuple[dict[str, Any], LiveSummary]:
    body = kube.get("v1", "configmaps", NS, CM)
    assert body is not None, "no live ConfigMap"
    return body, LiveSummary.model_validate_json(body["data"][names.LIVE_KEY])


def two_rank_plan(tables: list[TableSpec]) -> Plan:
    """Tables alternate between the ranks; the first 32-wide table is cut in two, the
    fourth is row-wise over both ranks and the fifth data-parallel."""
    shards = [[Shard(rank=i % 2, col_offset=0, cols=t.dim)] for i, t in enumerate(tables)]
    shards[1] = [Shard(rank=0, col_offset=0, cols=16), Shard(rank=1, col_offset=16, cols=16)]
    cut = even_row_split(tables[3].rows, 2)
    shards[3] = [Shard(rank=r, cols=16, row_offset=o, rows=n) for r, (o, n) in enumerate(cut)]
    shards[4] = [Shard(rank=r, cols=16) for r in range(2)]
    kinds: list[Kind | None] = [None, None, None, "row_wise", "data_parallel"]
    topology = Topology(gpus=2, gpu_memory_bytes=1 << 30, device="cpu", batch_size_per_rank=BATCH)
    return Plan.from_shards(tables, shards, topology, "test", kinds=kinds)


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_two_ranks_write_a_live_summary_that_names_the_heavy_shard(
    api: tuple[EmulatorServer, KubeApi], tmp_path: Path
) -> None:
    server, kube = api
    tables = small_tables((16, 32, 128, 16, 16))
    save_tables(tables, tmp_path / "tables.yaml")
    plan = two_rank_plan(tables)
    save_plan(plan, tmp_path / "plan.json")
    # What the operator creates with the worker Job: the ConfigMap, empty, its labels.
    kube.create({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CM, "namespace": NS,
                     "labels": {names.LABEL_JOB: JOB, names.LABEL_COMPONENT: names.COMPONENT_LIVE}},
        "data": {},
    })  # fmt: skip
    factor = round(600 / next(t.pooling_factor for t in tables if t.name == HEAVY), 2)
    steps = 200
    proc = run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            *trainer(
                "--tables", "tables.yaml", "--steps", str(steps), "--measure-every", "2",
                "--report-every", "5", "--report-min-interval", "0",
                "--data-pooling", f"{HEAVY}={factor}", "--summary", "s.json",
            ),
        ],
        live_env(server.url, tmp_path, SHARDWISE_PLAN=str(tmp_path / "plan.json")),
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "warning" not in proc.stdout, proc.stdout[-4000:]
    body, live = read_summary(kube)
    # The operator's labels stay: the workers only merge their key in.
    assert body["metadata"]["labels"][names.LABEL_COMPONENT] == names.COMPONENT_LIVE
    assert (live.plan_hash, live.world_size, live.batch_size_per_rank) == (plan.hash, 2, BATCH)
    assert (live.step, live.steps, live.start_step, live.device) == (steps, steps, 0, "cpu")
    assert live.first_step_at and live.written_at >= live.first_step_at
    assert live.complete(), live.ranks
    assert [r.rank for r in live.ranks] == [0, 1] and all(r.pod for r in live.ranks)
    assert all(r.step_ms > 0 and r.fwd_compute_ms > 0 and r.bwd_compute_ms > 0 for r in live.ranks)
    # Probed shards are the plan's, on their own ranks, with their rows and columns (a
    # budget of 1 % on a busy machine may not reach every one in a short run; the heavy
    # one, yes): row ranges and data-parallel copies are shards like the others.
    expected = {
        (t.name, s.rank, s.row_offset, s.row_count(t.rows), s.col_offset, s.cols)
        for t in plan.tables
        for s in t.shards
    }
    seen = {(s.table, s.rank, s.row_offset, s.rows, s.col_offset, s.cols) for s in live.shards}
    assert seen <= expected, seen - expected
    assert {s.rank for s in live.shards} == {0, 1}, live.shards
    # Each rank says how many shards its probe can time: the plan's on that rank.
    held = [sum(s.rank == r for t in plan.tables for s in t.shards) for r in (0, 1)]
    assert [r.probe_shards for r in live.ranks] == held
    # ... and what its kernels cost with every bag empty (the live fit's fixed part).
    assert all(r.probe_empty_ms > 0 for r in live.ranks), live.ranks
    assert {p.rank for p in live.points()} <= {0, 1}
    got, want = live.probed()
    assert want == len(expected) and got == len(live.shards)
    costliest = max(live.shards, key=lambda s: s.ms)
    assert costliest.table == HEAVY, live.shards
    # Far above a typical light shard: each shard's cost is the median of its few probe
    # windows, and on a busy machine one light shard's can be disturbed (2 busy
    # processes beside it: one light shard at 6.96 ms against 0.7-3.5 for the others,
    # the heavy one at 13.6), so the margin is taken on the light shards' median.
    light = [s.ms for s in live.shards if s.table != HEAVY]
    assert costliest.ms > 2 * statistics.median(light), live.shards
    # The heavy table's rank is the straggler the operator would see.
    straggler = live.straggler()
    assert straggler is not None and straggler.rank == costliest.rank, live.ranks
    assert (live.imbalance() or 0) > 1.2, live.ranks
    # The probe stayed within its budget, and ran.
    assert live.probe.windows >= 1 and live.probe.train_seconds > 0
    assert live.probe.overhead <= 0.01, live.probe
    # The re-planner takes it: the row-wise and data-parallel tables stay where they are.
    again = replan(plan, tables, plan.topology, live)
    for old, new in zip(plan.tables[3:], again.plan.tables[3:], strict=True):
        assert (new.kind, new.shards) == (old.kind, old.shards)


@pytest.mark.slow
def test_an_unreachable_api_only_warns_once(tmp_path: Path) -> None:
    """One rank without torchrun; its API server refuses connections: one warning that
    says what to fix, and the run trains to the end."""
    tables = small_tables((16, 16))
    save_tables(tables, tmp_path / "tables.yaml")
    topology = Topology(gpus=1, gpu_memory_bytes=1 << 30, device="cpu", batch_size_per_rank=BATCH)
    plan = Plan.from_shards(tables, [[Shard(rank=0, col_offset=0, cols=16)]] * 2, topology, "t")
    save_plan(plan, tmp_path / "plan.json")
    env = live_env("http://127.0.0.1:9", tmp_path, SHARDWISE_PLAN=str(tmp_path / "plan.json"))
    proc = run(
        [
            sys.executable,
            *trainer(
                "--tables", "tables.yaml", "--steps", "12", "--report-every", "3",
                "--report-min-interval", "0", "--summary", "s.json",
            ),
        ],
        env,
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    warnings = [
        line for line in proc.stdout.splitlines() if "cannot write the live summary" in line
    ]
    assert len(warnings) == 1, proc.stdout[-4000:]
    assert f"{NS}/{CM}" in warnings[0] and "get and patch" in warnings[0]
    assert names.ENV_LIVE_CONFIGMAP in warnings[0]
    summary = yaml.safe_load((tmp_path / "s.json").read_text())
    assert summary["end_step"] == 12 and summary["live"]["write_failures"] >= 2
    assert summary["live"]["writes"] == 0


# --------------------------------------------------------------------------- the writer


def test_the_writer_creates_the_configmap_owned_by_the_job(
    api: tuple[EmulatorServer, KubeApi],
) -> None:
    """Absent (the operator has not made it yet): created with the job's labels and
    owned by the DLRMJob; present: only the key is merged in. The DLRMJob exists, as
    it does when its workers run: an object owned by a uid that does not exist is
    collected (on a cluster and by the emulator, 50 ms after it is made), which a
    loaded run once saw between the writer's close and the last read."""
    from k8s.helpers import dlrmjob, load_crd
    from kubernetes import client

    server, kube = api
    kube.create(load_crd())
    uid = kube.create(dlrmjob(JOB, NS))["metadata"]["uid"]
    conf = client.Configuration(host=server.url)
    target = LiveTarget(NS, CM, JOB, uid)
    warned: list[str] = []
    writer = ConfigMapWriter(
        target, api=lambda: client.CoreV1Api(client.ApiClient(conf)), warn=warned.append
    )
    writer.submit('{"step": 1}')
    assert writer.flush(10), warned
    body = kube.get("v1", "configmaps", NS, CM)
    assert body is not None and body["data"] == {names.LIVE_KEY: '{"step": 1}'}
    assert body["metadata"]["labels"] == {
        names.LABEL_JOB: JOB,
        names.LABEL_COMPONENT: names.COMPONENT_LIVE,
    }
    (owner,) = body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (names.KIND, JOB, uid)
    assert "blockOwnerDeletion" not in owner  # the workers may not set it
    kube.patch("v1", "configmaps", NS, CM, {"data": {"other": "kept"}})
    writer.submit('{"step": 2}')
    writer.submit('{"step": 3}')  # the newest wins
    assert writer.close(10)
    body = kube.get("v1", "configmaps", NS, CM)
    assert body is not None and body["data"] == {names.LIVE_KEY: '{"step": 3}', "other": "kept"}
    assert warned == [] and writer.failures == 0


def test_a_forbidden_write_names_the_permission() -> None:
    """A service account without a Role on configmaps: the API server's 403, warned once
    with what to grant; a Role with get and patch then lets the writes through."""
    from k8s.emulator import ApiEmulator
    from k8s.rbac import RbacAuthorizer, service_account
    from kubernetes import client

    authz = RbacAuthorizer(tokens={"worker-token": service_account(NS, "shardwise-worker")})
    emulator = ApiEmulator()
    emulator.authorizer = authz
    server = EmulatorServer(emulator).start()
    try:
        conf = client.Configuration(host=server.url)
        conf.api_key = {"BearerToken": "worker-token"}
        conf.api_key_prefix = {"BearerToken": "Bearer"}
        warned: list[str] = []
        writer = ConfigMapWriter(
            LiveTarget(NS, CM, JOB),
            api=lambda: client.CoreV1Api(client.ApiClient(conf)),
            warn=warned.append,
        )
        for step in range(2):
            writer.submit(f'{{"step": {step}}}')
            assert writer.flush(10)
        assert len(warned) == 1 and writer.failures == 2, warned
        assert "HTTP 403" in warned[0] and "needs get and patch" in warned[0]
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "w", "namespace": NS},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "verbs": ["get", "patch", "create"]}],
        }  # fmt: skip
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "w", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "w"},
            "subjects": [{"kind": "ServiceAccount", "name": "shardwise-worker", "namespace": NS}],
        }  # fmt: skip
        authz.add(role)
        authz.add(binding)
        writer.submit('{"step": 2}')
        assert writer.close(10)
        assert writer.writes == 1 and len(warned) == 2 and "again" in warned[1]
        stored = emulator.objects("configmaps", NS)
        assert [o["data"][names.LIVE_KEY] for o in stored] == ['{"step": 2}']
    finally:
        server.stop()


def test_a_failing_write_warns_once_and_never_raises() -> None:
    def refuse() -> Any:
        raise ConnectionRefusedError("connection refused")

    warned: list[str] = []
    writer = ConfigMapWriter(LiveTarget(NS, CM, JOB), api=refuse, warn=warned.append)
    for step in range(3):
        writer.submit(f'{{"step": {step}}}')
        assert writer.flush(5)
    assert writer.close(5)
    assert len(warned) == 1 and writer.failures == 3 and writer.writes == 0
    assert "ConnectionRefusedError" in warned[0] and "patch" in warned[0]


def test_the_body_without_a_uid_has_no_owner() -> None:
    body = configmap_body(LiveTarget(NS, CM, JOB), "{}")
    assert "ownerReferences" not in body["metadata"]
    assert body["metadata"]["labels"][names.LABEL_JOB] == JOB


# --------------------------------------------------------------------------- data drift


def _specs() -> list[TableSpec]:
    return [TableSpec(name=f"t{i}", rows=100 + i, dim=8, pooling_factor=2.0) for i in range(7)]


def test_drifted_specs_scale_the_named_pooling_and_keep_the_rest() -> None:
    declared = _specs()
    drawn = [t.model_copy(update={"pooling_factor": 3.0}) for t in declared]
    out = drifted_specs(declared, drawn, {"t1": 4.0})
    assert [t.pooling_factor for t in out] == [3.0, 12.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert [(t.name, t.rows, t.dim) for t in out] == [(t.name, t.rows, t.dim) for t in declared]
    assert drifted_specs(declared) == declared


def test_drifted_specs_refuse_other_shapes_and_unknown_names() -> None:
    declared = _specs()
    wider = [t.model_copy(update={"dim": 16}) if t.name == "t3" else t for t in declared]
    with pytest.raises(UserError, match=r"data\.yaml: table 't3' has dim 16.*declared table has 8"):
        drifted_specs(declared, wider, source="data.yaml")
    with pytest.raises(UserError, match="table 't6' is declared but missing"):
        drifted_specs(declared, declared[:-1])
    with pytest.raises(UserError, match=r"no table 'nope'; tables are e\.g\. t0, t1.*\(7 in all\)"):
        drifted_specs(declared, None, {"nope": 2.0})
    with pytest.raises(UserError, match=r"'t0' × 1000: pooling_factor 2000 is above"):
        drifted_specs(declared, None, {"t0": 1000.0})


def test_data_pooling_flag_syntax() -> None:
    assert parse_pooling("a=2, b=0.5") == {"a": 2.0, "b": 0.5}
    for bad in ("a", "a=0", "a=x", "=2", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_pooling(bad)
