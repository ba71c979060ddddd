"""Bad input ends in a clear message: 422 from the schema, an InvalidSpec condition for
what no schema can express, an infeasible plan that names the table and the memory,
missing capacity or tables that wait and then run."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from k8s.helpers import (
    NAMESPACE,
    ROOT,
    TEST_CONFIG,
    add_node,
    condition,
    dlrmjob,
    events_for,
    status_of,
    wait_for,
    wait_phase,
)
from k8s.server import EmulatorServer

from shardwise.operator.kube import ApiError, KubeApi
from shardwise.planner.tables import TableSpec, dump_tables

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_the_schema_refuses_invalid_jobs_with_422(
    api_server: EmulatorServer, kube: KubeApi, path: Path
) -> None:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = NS  # as `kubectl apply -n NS -f` does
    with pytest.raises(ApiError) as err:
        kube.create(body)
    assert err.value.status == 422
    field = path.read_text().split("# expect-field: ")[1].splitlines()[0]
    assert any(c["field"] == field for c in err.value.body["details"]["causes"])
    assert kube.list("shardwise.dev/v1alpha1", "dlrmjobs", NS) == []


def test_what_the_schema_cannot_express_fails_the_job(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    tables = [
        {
            "name": "t0",
            "rows": 1000,
            "dim": 16,
            "poolingFactor": 1.0,
            "accessHist": [0.5] + [0.1] * 16,
        }
    ]
    template = {
        "image": "example/shardwise:0.1.0",
        "resources": {"limits": {"nvidia.com/gpu": 4}},
    }
    kube.create(dlrmjob("odd", NS, tables, template=template))
    status = wait_phase(kube, NS, "odd", "Failed")
    invalid = condition(status, "SpecValid")
    assert invalid["status"] == "False" and invalid["reason"] == "InvalidSpec"
    message = invalid["message"]
    assert "spec.tables.inline[0].accessHist (table 't0'): " in message and "sums to 2.1" in message
    assert (
        "spec.template.resources.limits[nvidia.com/gpu]: 4 contradicts gpusPerWorker (2)" in message
    )
    assert condition(status, "Failed")["reason"] == "InvalidSpec"
    wait_for(
        lambda: any(
            e["reason"] == "InvalidSpec" and e["type"] == "Warning"
            for e in events_for(kube, NS, "odd")
        ),
        what="a Warning event",
    )
    assert api_server.emulator.count("create", "jobs") == 0
    assert api_server.emulator.count("create", "configmaps") == 0


def test_infeasible_plan_names_the_table_and_the_memory(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """A table no GPUs hold even row-wise over all of them: Failed with the planner's
    figures, once; the same inputs are not planned again (nor the Warnings repeated)
    however often the loop wakes, until they change."""
    add_node(kube, "gpu-1", gpus=4)
    op = start_operator()
    runs: list[float] = []
    run = op.planner.run

    async def counted(request: Any) -> Any:
        runs.append(time.monotonic())
        return await run(request)

    op.planner.run = counted  # type: ignore[method-assign]
    tables = [
        {"name": "small", "rows": 1000, "dim": 16, "poolingFactor": 1.0},
        {"name": "huge_ids", "rows": 150_000_000, "dim": 128, "poolingFactor": 1.0},
    ]
    kube.create(dlrmjob("toobig", NS, tables, gpu_memory="1Gi"))
    status = wait_phase(kube, NS, "toobig", "Failed")
    planned = condition(status, "Planned")
    assert planned["status"] == "False" and planned["reason"] == "Infeasible"
    message = planned["message"]
    assert message.startswith(
        "table huge_ids (150000000 rows x 128 fp32) needs 72.1 GiB whole, and even row-wise "
        "over all 4 GPUs each holds 18.0 GiB (weights 17.9 GiB + optimizer 143.1 MiB + I/O "
        "buffers"
    ), message
    assert "870.4 MiB after a 15% reserve of 1.0 GiB" in message, "the GPU memory is named"
    assert "GPUs of 21.2 GiB (spec.planner.gpuMemory" in message
    assert "116 GPUs (spec.workers.max × spec.gpusPerWorker, on nodes that have them)" in message
    assert "--gpu" not in message
    assert condition(status, "Failed")["reason"] == "Infeasible"
    add_node(kube, "gpu-2", gpus=1)  # wakes the loop; the job's placement stays
    time.sleep(2.0)
    assert len(runs) == 1, runs
    warnings = [e for e in events_for(kube, NS, "toobig") if e["reason"] == "Infeasible"]
    said = sorted((e["type"], e["message"].split(":")[0], e.get("count", 1)) for e in warnings)
    assert said == [("Warning", "Failed=True", 1), ("Warning", "Planned=False", 1)]
    assert all(message in e["message"] for e in warnings)
    assert api_server.emulator.count("create", "jobs") == 0
    assert api_server.emulator.count("create", "configmaps") == 0


def test_missing_capacity_waits_for_nodes(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-small", gpus=1)
    start_operator()
    kube.create(dlrmjob("waiting", NS, workers=(2, 2)))
    status = wait_phase(kube, NS, "waiting", "Pending")
    capacity = condition(status, "Capacity")
    assert capacity["reason"] == "InsufficientCapacity"
    assert "needs at least 2 worker(s) of 2 GPU(s)" in capacity["message"]
    add_node(kube, "gpu-big", gpus=4)
    status = wait_phase(kube, NS, "waiting", "Running")
    assert status["workers"] == 2


#: Tables that cannot be read: a ConfigMap that does not exist, and one whose YAML is broken.
UNREADABLE = {
    "missing": ("TablesNotFound", "ConfigMap ml/job-tables does not exist"),
    "broken": ("InvalidTables", "ConfigMap ml/job-tables key tables.yaml"),
}


def series(events: list[dict[str, Any]]) -> str:
    """The Event objects about a job and their occurrences, as the test prints them."""
    counts = ", ".join(f"{e['reason']} x{e.get('count', 1)}" for e in events)
    total = sum(int(e.get("count") or 1) for e in events)
    return f"{len(events)} Event objects, {total} occurrences: {counts}"


@pytest.mark.parametrize("problem", sorted(UNREADABLE))
@pytest.mark.parametrize("policy", ["Never", "IfStale"])
def test_unreadable_tables_warn_once_and_retry_with_backoff(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, policy: str, problem: str
) -> None:
    """Tables that cannot be read: one Warning Event series about them, its count raised
    by each read that fails alike (as Kubernetes aggregates repeats), and nothing else
    new: no Event announces planning or a cost model for tables no one could read, so a
    retry announces nothing again. The job's Events are SpecValid's, Capacity's and the
    tables' (three objects), the condition does not flap between Planning and the tables'
    reason, and the reads back off (0.5 s, doubling up to 2 s: a compressed copy of
    30 s doubling, where 150 s hold the first three reads). Both policies: Never
    (planning) and IfStale, the default (the profiling decision)."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator(
        config=dataclasses.replace(
            TEST_CONFIG, tables_retry_seconds=0.5, max_tables_retry_seconds=2.0
        )
    )
    if problem == "broken":
        kube.create({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "job-tables", "namespace": NS},
            "data": {"tables.yaml": "tables: [{name: t0, rows: 10\n  dim: [8"},
        })  # fmt: skip
    reason, said = UNREADABLE[problem]
    body = dlrmjob("stuck", NS, policy=policy)
    body["spec"]["tables"] = {"configMapRef": {"name": "job-tables"}}
    kube.create(body)
    emu = api_server.emulator

    def reads() -> int:
        return emu.count("get", "configmaps", name="job-tables", namespace=NS)

    wait_for(lambda: reads() >= 1, what="the first read")
    first = time.monotonic()
    wait_for(lambda: reads() >= 4, timeout=15, what="three retries")
    # retries after 0.5, 1 and 2 s: 3.5 s at least (0.5 s each would take 1.5)
    assert time.monotonic() - first >= 3.0

    def about_tables() -> list[dict[str, Any]]:
        return [e for e in events_for(kube, NS, "stuck") if e["reason"] == reason]

    # one series, counted: each read that failed alike (posted async)
    wait_for(lambda: sum(e["count"] for e in about_tables()) >= 4, what="the retries counted")
    events = events_for(kube, NS, "stuck")
    print(f"{policy}, {problem} tables, {reads()} reads: {series(events)}")
    assert sorted(e["reason"] for e in events) == sorted(["Valid", "Placed", reason]), events
    again = [e for e in events if e["reason"] != reason and e.get("count", 1) > 1]
    assert again == [], again  # nothing but the tables' Warning is announced twice
    (warning,) = about_tables()
    assert warning["type"] == "Warning" and said in warning["message"], warning
    # each failed read counted once: none twice, none by a second reader (the planner)
    assert reads() - 1 <= warning["count"] <= reads(), (reads(), warning)
    status = status_of(kube, NS, "stuck")
    planned = condition(status, "Planned")
    assert planned is not None and planned["reason"] == reason
    assert condition(status, "CostModelReady") is None  # not announced, so not dropped


@pytest.mark.parametrize("policy", ["Never", "IfStale"])
def test_tables_from_a_configmap_created_later_are_read_at_once(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, policy: str
) -> None:
    """The ConfigMap is created after the job: the operator watches it while it is
    missing, so the job goes on at once, not at the next retry (10 minutes away here;
    the waits below allow for planning on a loaded machine)."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator(config=dataclasses.replace(TEST_CONFIG, tables_retry_seconds=600))
    body = dlrmjob("refd", NS, policy=policy)
    body["spec"]["tables"] = {"configMapRef": {"name": "dlrm-tables"}}
    kube.create(body)
    status = wait_for(
        lambda: (
            (
                c := condition(
                    kube.get("shardwise.dev/v1alpha1", "dlrmjobs", NS, "refd").get("status") or {},
                    "Planned",
                )
            )
            and c["reason"] == "TablesNotFound"
            and c
        ),
        what="TablesNotFound",
    )
    assert "ConfigMap ml/dlrm-tables does not exist" in status["message"]
    specs = [TableSpec(name=f"c{i}", rows=5000 + i, dim=16, pooling_factor=2.0) for i in range(5)]
    kube.create({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dlrm-tables", "namespace": NS},
        "data": {"tables.yaml": dump_tables(specs, "yaml")},
    })  # fmt: skip
    if policy == "IfStale":  # read at once: profiling starts on the tables
        wait_for(
            lambda: (
                (condition(status_of(kube, NS, "refd"), "Planned") or {}).get("reason")
                != "TablesNotFound"
            ),
            timeout=120,
            what="the tables read",
        )
        return
    status = wait_phase(kube, NS, "refd", "Running", timeout=180)
    assert status["plan"]["tables"] == 5
    cm = kube.get("v1", "configmaps", NS, status["plan"]["configMap"])
    assert "c4" in cm["data"]["tables.yaml"]
