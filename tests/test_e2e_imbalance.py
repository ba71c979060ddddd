"""The closed loop end to end on CPU (docs/resharding.md, "Resharding on a measured
straggler"): the operator on kopf's real engine against the API emulator, real torchrun
workers run by the kubelet stand-in (tests/k8s/kubelet.py), and a DLRMJob whose declared
specs understate one table's pooling: the workers draw that table's lookups 6x as dense
as declared (``--data-pooling``), as real data drifting from its declaration would.

The plan for the declared specs puts the heavy table with three others; rank 0's live
summary shows the straggler; the loop waits out ``sustainSeconds``, re-plans from the
live per-shard costs, reshards through checkpoint → new plan → resume, and verifies on
the new workers' own measurements. Nothing here patches a status by hand.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k8s.helpers import (
    NAMESPACE as NS,
)
from k8s.helpers import (
    add_local_node,
    condition,
    events_for,
    live_summary,
    resumed_step,
    start_cpu_job,
    status_of,
    stopped_step,
    wait_for,
)
from k8s.kubelet import LocalCluster

from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]

#: Pods start in 10-30 s on 2 busy cores; a reshard is a stop, a plan and a start.
TIMEOUT = 300.0
HEAVY = "t0"
#: Eight alike tables; the data reads t0 6x as often as declared: the declared plan puts
#: it with three others (max/mean ~1.25 measured), and t0 with one other balances.
TABLES = [{"name": f"t{i}", "rows": 40_000, "dim": 64, "poolingFactor": 6.0} for i in range(8)]
LOOP = {"enabled": True, "threshold": 1.2, "minGain": 0.1, "maxPerHour": 2, "sustainSeconds": 10}
ARGS = [
    "--data-pooling", f"{HEAVY}=6",
    "--measure-every", "4",
    "--report-every", "8",
    "--report-min-interval", "2",
    "--checkpoint-every", "500",
]  # fmt: skip


def loop_state(kube: KubeApi, name: str) -> dict[str, Any]:
    return status_of(kube, NS, name).get("imbalanceLoop") or {}


def waiting(kube: KubeApi, probe: Callable[[], Any], what: str) -> Any:
    """``wait_for``, printing the job's status when it times out (what the loop saw)."""
    try:
        return wait_for(probe, TIMEOUT, interval=0.5, what=what)
    except AssertionError:
        print("status at the timeout:", status_of(kube, NS, "drift"))
        print("live summary:", live_summary(kube, NS, "drift"))
        raise


def test_the_loop_sees_the_straggler_reshards_once_and_the_measured_max_drops(
    kube: KubeApi, start_operator: Start, local_cluster: LocalCluster
) -> None:
    add_local_node(kube, "cpu-1")
    add_local_node(kube, "cpu-2")
    start_operator()
    start_cpu_job(
        kube, "drift", steps=1_000_000, batch=512, workers=(2, 2), tables=TABLES,
        args=ARGS, resharding={"onImbalance": LOOP},
    )  # fmt: skip

    def imbalanced() -> dict[str, Any] | None:
        live = status_of(kube, NS, "drift").get("live") or {}
        return live if (live.get("measuredImbalance") or 0) > LOOP["threshold"] else None

    before = wait_for(imbalanced, TIMEOUT, interval=0.5, what="the straggler in status.live")
    seen = time.monotonic()
    first_plan = before["planHash"]

    def decided() -> dict[str, Any] | None:
        rec = loop_state(kube, "drift")
        return (
            rec
            if rec.get("state") in ("Resharding", "Verifying", "Watching") and rec.get("adopted")
            else None
        )

    going = waiting(kube, decided, "the reshard decision")
    decision_seconds = time.monotonic() - seen
    assert decision_seconds <= 120, f"decided {decision_seconds:.0f} s after the straggler showed"

    def verified() -> dict[str, Any] | None:
        rec = loop_state(kube, "drift")
        return (
            rec
            if rec.get("state") in ("Watching", "Stopped") and rec.get("measuredMaxMilliseconds")
            else None
        )

    done = waiting(kube, verified, "the reshard verified")
    status = status_of(kube, NS, "drift")
    after = status["live"]
    print(
        f"\nstraggler seen -> decision {decision_seconds:.1f} s; before {before}; "
        f"decided {going}; after {after}; loop {done}"
    )
    # Balanced, by the median of the summaries over the next 15 s (one summary is a
    # median of sampled steps already; the machine's load moves it between summaries).
    # Absolute milliseconds are not compared: two summaries a minute apart on 2 shared
    # cores differ by the load, which max/mean cancels.
    seen_after: dict[str, tuple[int, float]] = {}
    until = time.monotonic() + 15
    while time.monotonic() < until:
        live = status_of(kube, NS, "drift").get("live") or {}
        if live.get("planHash") == after["planHash"] and "measuredImbalance" in live:
            seen_after[live["writtenAt"]] = (live["step"], live["measuredImbalance"])
        time.sleep(0.5)
    settled = statistics.median(
        [imb for _, imb in seen_after.values()] or [after["measuredImbalance"]]
    )
    print(f"measured (step, max/mean) after the reshard: {sorted(seen_after.values())}")
    assert after["planHash"] != first_plan
    # The reshard removed measured imbalance, and the loop judged it once and for all.
    # How much is left depends on the machine as much as on the plan: quiet, the
    # settled max/mean read 1.01-1.15 and the verdict was always "delivered"; with 2
    # busy processes on the 2 cores the same re-plan settles at 1.15-1.24 (the cores'
    # sharing is an imbalance no placement removes), which can fall short of half the
    # predicted gain, and then the loop rightly stops instead of trying again.
    assert settled < done["fromImbalance"], (settled, done)
    assert done["measuredImbalance"] < done["fromImbalance"]
    assert len(done["reshards"]) == 1
    reasons = [e["reason"] for e in events_for(kube, NS, "drift")]
    assert "ReshardingForImbalance" in reasons
    if done["state"] == "Watching":
        assert done["verdict"].startswith("the reshard delivered"), done
        assert "ReshardDelivered" in reasons
    else:
        assert done["state"] == "Stopped" and "did not deliver" in done["verdict"], done
        assert "ReshardDidNotDeliver" in reasons
        time.sleep(10)  # a stopped loop never reshards again
        assert len(loop_state(kube, "drift")["reshards"]) == 1

    # no step lost: the new workers resume at the step the old ones checkpointed on stop
    runs = list(local_cluster.pods("drift-workers"))
    logs = {p.name: local_cluster.kubelet.log(p.name) for p in runs}
    stopped = [s for s in (stopped_step(log) for log in logs.values()) if s is not None]
    resumed = [s for s in (resumed_step(log) for log in logs.values()) if s is not None]
    assert stopped and resumed and max(resumed) == max(stopped), (stopped, resumed)


def test_a_gain_below_the_minimum_is_declined_and_the_workers_keep_running(
    kube: KubeApi, start_operator: Start, local_cluster: LocalCluster
) -> None:
    """The same straggler with minGain 5 (a 6x faster max rank): the loop re-plans once,
    declines with the figures, and the first workers train on, never replaced."""
    add_local_node(kube, "cpu-1")
    add_local_node(kube, "cpu-2")
    start_operator()
    start_cpu_job(
        kube, "drift", steps=1_000_000, batch=512, workers=(2, 2), tables=TABLES,
        args=ARGS, resharding={"onImbalance": {**LOOP, "minGain": 5.0}},
    )  # fmt: skip

    def declined() -> dict[str, Any] | None:
        rec = loop_state(kube, "drift")
        return rec if rec.get("state") == "Declined" else None

    rec = waiting(kube, declined, "the decline")
    assert rec["message"].startswith("GainTooSmall: "), rec
    first = {p.name for p in local_cluster.pods("drift-workers")}
    time.sleep(20)  # more summaries come in: the decline stands
    status = status_of(kube, NS, "drift")
    assert status["imbalanceLoop"]["state"] == "Declined" and not status["imbalanceLoop"].get(
        "reshards"
    )
    assert {p.name for p in local_cluster.pods("drift-workers")} == first
    assert all(p.exit_code is None for p in local_cluster.pods("drift-workers"))
    balanced = condition(status, "Balanced")
    assert balanced is not None and balanced["reason"] == "GainTooSmall"
    reasons = [e["reason"] for e in events_for(kube, NS, "drift")]
    assert "GainTooSmall" in reasons and "ReshardingForImbalance" not in reasons
