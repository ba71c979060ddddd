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

from shardwise import names
from shardwise.operator.kube import KubeApi
from shardwise.planner.plan import Plan

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


def tables_with_heavy(kube: KubeApi, plan_hash: str) -> list[str]:
    """The tables on the rank that holds the heavy table in the plan ``plan_hash``."""
    cm = kube.get("v1", "configmaps", NS, names.plan_configmap_name("drift", plan_hash))
    assert cm is not None, f"no plan ConfigMap for {plan_hash[:8]}"
    plan = Plan.model_validate_json(cm["data"][names.PLAN_KEY])
    ranks = [sorted(t.name for t, _ in held) for held in plan.shards_per_rank()]
    return next(r for r in ranks if HEAVY in r)


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
    assert len(tables_with_heavy(kube, first_plan)) == 4  # the declared plan's straggler

    def decided() -> dict[str, Any] | None:
        rec = loop_state(kube, "drift")
        return (
            rec
            if rec.get("state") in ("Resharding", "Verifying", "Watching") and rec.get("adopted")
            else None
        )

    going = waiting(kube, decided, "the reshard decision")
    print("\nlive summary at the decision:", live_summary(kube, NS, "drift"))
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
    print("\nlive summary at the verdict:", live_summary(kube, NS, "drift"))
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
    # The re-plan read the live costs right: the declared plan put the heavy table with
    # three others; the data reads it 6x as often as declared, so the live plan moves
    # light tables off its rank. How many follows the probe's price ratio, which the
    # machine's load moves: quiet, t0 prices 4-5x a light table and one or two move
    # (those two plans nearly tie); once, with 2 busy processes beside it, the light
    # tables priced lower still and all three moved (the loop predicted max-rank compute
    # 22.9 -> 17.6 ms, t0 alone, and measured max/mean 1.335 -> 1.112). So: t0 is left
    # with 0 to 2 others.
    assert 1 <= len(tables_with_heavy(kube, after["planHash"])) <= 3, tables_with_heavy(
        kube, after["planHash"]
    )
    # The loop judged the reshard on the new workers' measurements, once and for all.
    # What they measure depends on the machine as much as on the plan: quiet, the
    # settled max/mean read 1.01-1.15 and the verdict was "delivered"; with busy
    # processes on the 2 cores the same plan settled at 1.15-1.24, and once (a
    # disturbed machine: the rank of 6 light tables measured 1.6x its price) at 1.29.
    # Short of half the predicted gain, the loop rightly stops instead of trying again.
    assert len(done["reshards"]) == 1
    reasons = [e["reason"] for e in events_for(kube, NS, "drift")]
    assert "ReshardingForImbalance" in reasons
    assert "Resharded" in reasons, "the loop's reshard ends as a node reshard does"
    if done["state"] == "Watching":
        assert done["verdict"].startswith("the reshard delivered"), done
        assert "ReshardDelivered" in reasons
        # delivered: the measured imbalance dropped, and stays down
        assert done["measuredImbalance"] < done["fromImbalance"]
        assert settled < done["fromImbalance"], (settled, done)
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
    loop_now = status["imbalanceLoop"]
    assert loop_now["state"] == "Declined" and not loop_now.get("reshards"), (rec, loop_now)
    assert {p.name for p in local_cluster.pods("drift-workers")} == first
    assert all(p.exit_code is None for p in local_cluster.pods("drift-workers"))
    balanced = condition(status, "Balanced")
    assert balanced is not None and balanced["reason"] == "GainTooSmall"
    reasons = [e["reason"] for e in events_for(kube, NS, "drift")]
    assert "GainTooSmall" in reasons and "ReshardingForImbalance" not in reasons
