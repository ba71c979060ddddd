"""Eligible nodes, worker slots, the placement and GPU usage
(:mod:`shardwise.operator.cluster.capacity`)."""

from __future__ import annotations

from typing import Any

from operator_builders import A100, CFG

from shardwise.operator.cluster.capacity import (
    NodeInfo,
    Placement,
    Shortfall,
    Taint,
    choose,
    eligible,
    gpu_memory_bytes,
    gpu_usage,
    less_used,
    node_info,
    pod_gpus,
    worker_slots,
)

GPU_RESOURCE = "nvidia.com/gpu"
POD_LABELS = ("shardwise.dev/job", "shardwise.dev/component")


def test_capacity_follows_selector_taints_and_readiness() -> None:
    nodes = [
        NodeInfo("a", {CFG.gpu_type_label: A100, "pool": "x"}, gpus=8),
        NodeInfo(
            "b",
            {CFG.gpu_type_label: A100, "pool": "x"},
            gpus=8,
            taints=(Taint("gpu", "", "NoSchedule"),),
        ),
        NodeInfo("c", {CFG.gpu_type_label: "H100", "pool": "x"}, gpus=8, ready=False),
        NodeInfo("d", {CFG.gpu_type_label: "H100", "pool": "y"}, gpus=8),
        NodeInfo("e", {"pool": "x"}, gpus=8),  # no GPU type label
    ]
    assert [n.name for n in eligible(nodes, {"pool": "x"}, [], "cuda", CFG)] == ["a"]
    tolerate = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    usable = eligible(nodes, {"pool": "x"}, tolerate, "cuda", CFG)
    assert [n.name for n in usable] == ["a", "b"]
    assert worker_slots(usable, 4, "cuda", CFG) == {A100: 4}
    assert choose({A100: 4, "H100": 4}, 1, 3, 4) == Placement("H100", 3)  # ties: by name
    short = choose({A100: 1}, 2, 4, 8)
    assert (
        isinstance(short, Shortfall) and "needs at least 2 worker(s) of 8 GPU(s)" in short.message
    )
    assert (
        gpu_memory_bytes(
            [NodeInfo("a", {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"})],
            A100,
            "cuda",
            CFG,
        )
        == 80 * 2**30
    )


def test_node_summary_reads_allocatable_readiness_and_cordon() -> None:
    body = {
        "metadata": {"name": "n", "labels": {"x": "y"}},
        "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoExecute"}]},
        "status": {
            "allocatable": {"nvidia.com/gpu": "4"},
            "conditions": [{"type": "Ready", "status": "False"}],
        },
    }
    info = node_info(body, "nvidia.com/gpu")
    assert (info.gpus, info.ready, info.schedulable, info.taints) == (
        4,
        False,
        False,
        (Taint("k", "", "NoExecute"),),
    )


def test_gpu_usage_leaves_out_the_jobs_own_workers_and_finished_pods() -> None:
    def pod(node: str, gpus: int, phase: str = "Running", **labels: str) -> dict[str, Any]:
        return {
            "metadata": {"namespace": "ml", "labels": labels},
            "spec": {"nodeName": node, "containers": [
                {"resources": {"limits": {GPU_RESOURCE: str(gpus)}}},
                {"resources": {"requests": {GPU_RESOURCE: "1"}, "limits": {GPU_RESOURCE: "1"}}},
            ]},
            "status": {"phase": phase},
        }  # fmt: skip

    mine = {"shardwise.dev/job": "a", "shardwise.dev/component": "worker"}
    bodies = [
        pod("n1", 2),  # another workload: 2 + 1 GPUs
        pod("n1", 1, **mine),  # job a's own worker: replaced by a reshard, not subtracted
        pod("n2", 4, phase="Succeeded"),  # finished: holds nothing
        {**pod("n2", 2), "spec": {"containers": []}},  # not bound, no GPUs
    ]
    held = [p for b in bodies if (p := pod_gpus(b, GPU_RESOURCE, *POD_LABELS)) is not None]
    assert gpu_usage(held, "ml", "a", "worker") == {"n1": 3}
    assert gpu_usage(held, "ml", "b", "worker") == {"n1": 5}  # job b counts a's workers
    nodes = [NodeInfo("n1", gpus=8), NodeInfo("n2", gpus=8)]
    assert [n.gpus for n in less_used(nodes, {"n1": 3})] == [5, 8]
