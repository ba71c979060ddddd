"""Pods that a lost node will never let go, and when to force their deletion.

Deleting a pod bound to a node only marks it (``deletionTimestamp`` = now + its grace
period): the node's kubelet stops the containers and then confirms. A node that froze,
lost power or dropped off the network never confirms, so the pod stays ``Terminating``
until the node comes back, and a Foreground delete of the worker Job, which a reshard
waits on, never finishes. Kubernetes leaves this to whoever knows the pod is safe to
forget (``kubectl delete --force``, or the ``node.kubernetes.io/out-of-service`` taint).

For a Shardwise pod on a node that is not Ready it is safe once the runtime's stop bound
has passed: a rank cut off from its peers cannot complete a collective, so it can neither
train on nor write a checkpoint (saving is collective too), and its watchdog and
launcher end it within 15 s of the signal by default, if it runs at all. So the operator
force-deletes its own pods that have been terminating for ``lost_pod_seconds`` (30 s; or
their whole grace period, if shorter) on a node that is gone or not Ready, and nothing
while the node is Ready (its kubelet is doing the stopping).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardwise.operator.cluster.capacity import NodeInfo
from shardwise.operator.cluster.startup import PodState


@dataclass(frozen=True)
class Stranded:
    """A pod to force-delete, and why."""

    pod: str
    node: str
    message: str


def stranded_pods(
    pods: Iterable[PodState],
    nodes: Sequence[NodeInfo],
    now: datetime.datetime,
    after_seconds: float,
) -> tuple[list[Stranded], datetime.datetime | None]:
    """The pods terminating for ``after_seconds`` (or their whole grace period) on nodes
    that are gone or not Ready, and the earliest moment another such pod will be due
    (``None``: none will)."""
    ready = {n.name: n.ready for n in nodes}
    out: list[Stranded] = []
    due: datetime.datetime | None = None
    for pod in pods:
        if not (pod.deleting and pod.node) or ready.get(pod.node, False):
            continue
        end = pod.deletion_deadline or now
        deleted_at = end - datetime.timedelta(seconds=pod.deletion_grace_seconds)
        forced_at = min(end, deleted_at + datetime.timedelta(seconds=after_seconds))
        if forced_at > now:
            due = forced_at if due is None else min(due, forced_at)
            continue
        state = "is gone" if pod.node not in ready else "is not Ready"
        waited = (now - deleted_at).total_seconds()
        out.append(
            Stranded(
                pod.name,
                pod.node,
                f"force-deleted pod {pod.name}: its node {pod.node} {state} and it has been "
                f"terminating for {waited:.0f} s; no kubelet will confirm its deletion, and "
                "a worker cut off from its peers has stopped by now",
            )
        )
    return out, due
