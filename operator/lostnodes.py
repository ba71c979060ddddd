"""Pods that a lost node will never let go, and when to force their deletion.

Deleting a pod bound to a node only marks it (``deletionTimestamp`` = now + its grace
period): the node's kubelet stops the containers and then confirms. A node that froze,
lost power or dropped off the network never confirms, so the pod stays ``Terminating``
until the node comes back, and a Foreground delete of the worker Job, which a reshard
waits on, never finishes. Kubernetes leaves this to whoever knows the pod is safe to
forget (``kubectl delete --force``, or the ``node.kubernetes.io/out-of-service`` taint).

For a Shardwise worker it is safe once its grace period is over and its node is not
Ready: a rank cut off from its peers cannot complete a collective, so it can neither
train on nor write a checkpoint (saving is collective too), and the runtime's stop bound
ends it by itself. So the operator force-deletes exactly those pods of its own jobs, and
nothing while the node is Ready (its kubelet is doing the stopping).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardwise.operator.capacity import NodeInfo
from shardwise.operator.startup import PodState


@dataclass(frozen=True)
class Stranded:
    """A pod to force-delete, and why."""

    pod: str
    node: str
    message: str


def stranded_pods(
    pods: Iterable[PodState], nodes: Sequence[NodeInfo], now: datetime.datetime
) -> tuple[list[Stranded], datetime.datetime | None]:
    """The terminating pods past their grace period on nodes that are gone or not Ready,
    and the earliest moment another such pod's grace period ends (``None``: none will)."""
    ready = {n.name: n.ready for n in nodes}
    out: list[Stranded] = []
    due: datetime.datetime | None = None
    for pod in pods:
        if not (pod.deleting and pod.node) or ready.get(pod.node, False):
            continue
        deadline = pod.deletion_deadline or now
        if deadline > now:
            due = deadline if due is None else min(due, deadline)
            continue
        state = "is gone" if pod.node not in ready else "is not Ready"
        out.append(
            Stranded(
                pod.name,
                pod.node,
                f"force-deleted pod {pod.name}: its node {pod.node} {state} and its grace "
                "period is over, so no kubelet will confirm its deletion",
            )
        )
    return out, due
