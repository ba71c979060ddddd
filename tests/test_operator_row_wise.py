"""A DLRMJob with a table larger than one GPU, on kopf's real engine against the API
emulator: planned row-wise (no longer refused), shown in status and Events, run by a
worker Job whose pods are the plan's hosts, and re-planned row-wise at the new size when
a node goes. (A table no GPUs hold even row-wise fails once with the planner's figures
and is not planned again until the inputs change: tests/test_operator_errors.py.)

The GPUs are made small (``planner.gpuMemory: 64Mi``, 54.4 MiB usable) so that a
1.2-million-row table (about 151 MiB with its optimizer state) is larger than a GPU and
than a worker pod's two GPUs together, while the plan stays small and quick. The planner
is lookup-greedy: every planner places such tables by one shared rule before placing the
rest (planner/oversized.py), and NeuroShard's search would make the test 2.5x longer on
2 busy cores (24 s against 9 s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k8s.helpers import NAMESPACE as NS
from k8s.helpers import add_node, condition, events_for, table, wait_for, wait_phase
from k8s.server import EmulatorServer
from test_operator_resharding import done, elastic, live_workers

from shardwise import names
from shardwise.operator.kube import KubeApi
from shardwise.planner.plan import Plan
from shardwise.planner.tables import parse_tables

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
BIG = {"name": "big", "rows": 1_200_000, "dim": 32, "poolingFactor": 4.0}
TABLES = [BIG, *(table(i) for i in range(5))]


def plan_of(kube: KubeApi, status: dict[str, Any]) -> Plan:
    cm = kube.get("v1", "configmaps", NS, status["plan"]["configMap"])
    assert cm is not None
    plan = Plan.model_validate_json(cm["data"][names.PLAN_KEY])
    tables = parse_tables(cm["data"][names.TABLES_KEY], "yaml", "the plan ConfigMap")
    assert [t.name for t in tables] == [t["name"] for t in TABLES]
    assert plan.problems(tables, require_hash=True) == [], "valid for the workers' tables"
    return plan


def assert_row_wise(plan: Plan, ranks: int) -> None:
    """``big`` row-wise over every rank in TorchRec's even cut; hosts of 2 GPUs."""
    assert plan.version == 2 and plan.world_size == ranks
    assert (plan.topology.gpus_per_host, plan.topology.hosts) == (2, ranks // 2)
    big = next(t for t in plan.tables if t.name == "big")
    assert big.kind == "row_wise"
    cut = sorted((s.rank, s.row_offset, s.rows) for s in big.shards)
    block = 1_200_000 // ranks
    assert cut == [(r, r * block, block) for r in range(ranks)]


def test_a_table_larger_than_a_gpu_runs_row_wise_and_reshards_row_wise(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    add_node(kube, "gpu-2", gpus=4)
    start_operator()
    kube.create(elastic("wide", tables=TABLES, gpu_memory="64Mi", algorithm="lookup-greedy"))
    wj = wait_for(lambda: live_workers(kube, "wide", 4), what="4 workers")
    status = wait_phase(kube, NS, "wide", "Running")
    plan = plan_of(kube, status)
    assert_row_wise(plan, 8)
    shown = status["plan"]
    assert shown["hash"] == plan.hash and shown["kinds"]["row_wise"] == 1
    assert sum(shown["kinds"].values()) == 6 and shown["kinds"] == plan.kinds()
    assert shown["tablesByKind"]["row_wise"] == {"tables": ["big"], "more": 0}
    planned = condition(status, "Planned")
    assert planned is not None and "1 row-wise (big)" in planned["message"], planned
    event = wait_for(
        lambda: next((e for e in events_for(kube, NS, "wide") if e["reason"] == "PlanReady"), None),
        what="the plan's Event",
    )
    assert event["type"] == "Normal" and "1 row-wise (big)" in event["message"], event
    # the worker pods are the plan's hosts: torchrun's local world is gpus_per_host
    container = wj["spec"]["template"]["spec"]["containers"][0]
    assert "--nproc_per_node=2" in container["args"] and "--nnodes=4" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[names.ENV_PLAN_HASH] == plan.hash
    volumes = wj["spec"]["template"]["spec"]["volumes"]
    assert {"name": "shardwise-plan", "configMap": {"name": shown["configMap"]}} in volumes

    # a node goes: the job reshards to 2 workers, the big table row-wise over 4 GPUs
    kube.delete("v1", "nodes", None, "gpu-2")
    wait_for(lambda: live_workers(kube, "wide", 2), what="2 workers")
    after = wait_for(lambda: done(kube, "wide", 2), what="resharded to 2")
    assert after["resharding"]["reason"] == "NodeLost" and after["worldSize"] == 4
    assert after["plan"]["configMap"] != shown["configMap"]
    assert_row_wise(plan_of(kube, after), 4)
    assert after["plan"]["tablesByKind"]["row_wise"] == {"tables": ["big"], "more": 0}
