"""Which terminating pods the operator force-deletes: only its own, past their grace
period, on nodes that are gone or not Ready (:mod:`shardwise.operator.cluster.lostnodes`)."""

from __future__ import annotations

import datetime

from shardwise.operator.cluster.capacity import NodeInfo
from shardwise.operator.cluster.lostnodes import stranded_pods
from shardwise.operator.cluster.startup import PodState, pod_state

T0 = datetime.datetime(2026, 11, 24, 12, 0, tzinfo=datetime.UTC)


def pod(name: str, node: str, deleted_ago: float | None, grace: int = 120) -> PodState:
    """A pod bound to ``node``, deleted ``deleted_ago`` seconds before T0 (None: not)."""
    meta: dict[str, object] = {"name": name, "namespace": "ml",
                               "labels": {"shardwise.dev/job": "j"}}  # fmt: skip
    if deleted_ago is not None:
        end = T0 + datetime.timedelta(seconds=grace - deleted_ago)
        meta["deletionTimestamp"] = end.strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["deletionGracePeriodSeconds"] = grace
    return pod_state({"metadata": meta, "spec": {"nodeName": node} if node else {}})


def test_only_pods_terminating_long_enough_on_lost_nodes_are_forced() -> None:
    nodes = [NodeInfo("alive"), NodeInfo("frozen", ready=False)]
    pods = [
        pod("a", "alive", 500),  # its kubelet is stopping it: never forced
        pod("b", "frozen", 31),  # 31 s of its 120 s grace on a NotReady node: forced
        pod("c", "frozen", 10),  # 10 s: due 20 s from now
        pod("d", "deleted-node", 40),  # its node is gone: forced
        pod("e", "frozen", None),  # not being deleted: left alone
        pod("f", "", 500),  # never bound: the API server deletes it at once anyway
        pod("g", "frozen", 6, grace=5),  # a grace period shorter than the wait: over
    ]
    forced, due = stranded_pods(pods, nodes, T0, after_seconds=30)
    assert [(s.pod, s.node) for s in forced] == [
        ("b", "frozen"),
        ("d", "deleted-node"),
        ("g", "frozen"),
    ]
    assert "its node frozen is not Ready and it has been terminating for 31 s" in forced[0].message
    assert "its node deleted-node is gone" in forced[1].message
    assert due == T0 + datetime.timedelta(seconds=20)


def test_nothing_to_force_and_nothing_due() -> None:
    assert stranded_pods([pod("a", "alive", 9)], [NodeInfo("alive")], T0, 30) == ([], None)
