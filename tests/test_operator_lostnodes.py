"""Which terminating pods the operator force-deletes: only its own, past their grace
period, on nodes that are gone or not Ready (:mod:`shardwise.operator.lostnodes`)."""

from __future__ import annotations

import datetime

from shardwise.operator.capacity import NodeInfo
from shardwise.operator.lostnodes import stranded_pods
from shardwise.operator.startup import PodState, pod_state

T0 = datetime.datetime(2026, 11, 24, 12, 0, tzinfo=datetime.UTC)


def pod(name: str, node: str, deleting_until: datetime.datetime | None) -> PodState:
    meta: dict[str, object] = {"name": name, "namespace": "ml",
                               "labels": {"shardwise.dev/job": "j"}}  # fmt: skip
    if deleting_until is not None:
        meta["deletionTimestamp"] = deleting_until.strftime("%Y-%m-%dT%H:%M:%SZ")
    return pod_state({"metadata": meta, "spec": {"nodeName": node} if node else {}})


def test_only_overdue_pods_on_lost_nodes_are_forced() -> None:
    nodes = [NodeInfo("alive"), NodeInfo("frozen", ready=False)]
    past, future = T0 - datetime.timedelta(seconds=1), T0 + datetime.timedelta(seconds=30)
    pods = [
        pod("a", "alive", past),  # its kubelet is stopping it: never forced
        pod("b", "frozen", past),  # grace over, node NotReady: forced
        pod("c", "frozen", future),  # still in its grace period: due in 30 s
        pod("d", "deleted-node", past),  # its node is gone: forced
        pod("e", "frozen", None),  # not being deleted: left alone
        pod("f", "", past),  # never bound: the API server deletes it at once anyway
    ]
    forced, due = stranded_pods(pods, nodes, T0)
    assert [(s.pod, s.node) for s in forced] == [("b", "frozen"), ("d", "deleted-node")]
    assert "its node frozen is not Ready" in forced[0].message
    assert "its node deleted-node is gone" in forced[1].message
    assert due == future


def test_nothing_to_force_and_nothing_due() -> None:
    assert stranded_pods([pod("a", "alive", T0)], [NodeInfo("alive")], T0) == ([], None)
