"""The closed loop's end-to-end scenarios (tests/test_e2e_loop_scenarios.py): the
operator on kopf's real engine against the API emulator, real torchrun workers run by
the kubelet stand-in, and a DLRMJob whose data drift from its declared specs
(``--data-pooling``). :func:`run_scenario` watches the
job as a user would (``status.live``, ``status.imbalanceLoop``, Events), asserts the
scenario's expected outcome and prints its figures (``pytest -s`` shows them).

Each scenario starts its own emulator, operator and pods (function-scoped fixtures; no
fixed ports or paths), so scenarios can run in parallel.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from k8s.helpers import NAMESPACE as NS
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

Start = Callable[..., "OperatorThread"]

#: Pods start in 10-30 s on 2 busy cores; a reshard is a stop, a plan and a start.
TIMEOUT = 300.0
#: The loop at test values: a short sustain, summaries every 2 s.
LOOP = {"enabled": True, "threshold": 1.2, "minGain": 0.1, "maxPerHour": 2, "sustainSeconds": 5}
#: Trainer options: sampled steps every 4, a gathering every 8, a write every 2 s.
ARGS = [
    "--measure-every", "4",
    "--report-every", "8",
    "--report-min-interval", "2",
    "--checkpoint-every", "100000",
]  # fmt: skip
#: The targets: balanced after, and the measured fall at least half the predicted one.
BALANCED = 1.15
DELIVERED_SHARE = 0.5
#: The reasons a re-plan is declined with (the ``Balanced`` condition's).
DECLINES = ("GainTooSmall", "GainWithinUncertainty", "ReshardDoesNotPay")
#: The target: the loop decides within 2 minutes of the straggler showing.
DECISION_SECONDS = 120.0
#: Beside other tests: the most a verdict's median max/mean may read above the one it
#: started from (a 2-core machine's summaries swing 0.1 between two a minute apart), and
#: the reshards a generation may make (the first, and one that learnt from it).
NOISE = 0.15
MAX_RESHARDS = 2
#: How long the new workers' summaries are collected after the verdict.
SETTLE_SECONDS = 6.0
#: How often the job is looked at: held to its targets, every half second (the decision
#: time is a target); beside other tests, every second (each look is a request the API
#: emulator serves on the same cores; rank 0 writes a summary every 2 s, so none is
#: missed).
POLL_TARGETS, POLL_SUITE = 0.5, 1.0


def tables(n: int, *, rows: int = 20_000, dims: list[int] | None = None, pooling: float = 6.0,
           declared: dict[str, float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``n`` tables ``t0..`` (``dims`` cycled; pooling ``pooling`` unless ``declared``
    names another)."""
    widths = dims or [64]
    return [
        {
            "name": f"t{i}",
            "rows": rows,
            "dim": widths[i % len(widths)],
            "poolingFactor": (declared or {}).get(f"t{i}", pooling),
        }
        for i in range(n)
    ]


@dataclass(frozen=True)
class Scenario:
    """A job whose data drift from its declaration, and what the loop must do."""

    name: str
    tables: list[dict[str, Any]]
    #: ``--data-pooling``: each named table read this many times as densely as declared.
    drift: dict[str, float]
    #: One gloo rank per pod.
    ranks: int = 2
    batch: int = 256
    #: "reshard" (one reshard that delivers) or "decline" (none, with the figures).
    expect: str = "reshard"
    #: Checked on the declared plan before anything else: the scenario is what it says.
    precondition: Callable[[list[list[str]]], bool] = lambda ranks: True
    loop: dict[str, Any] = field(default_factory=dict)


def plan_ranks(kube: KubeApi, job: str, plan_hash: str) -> list[list[str]]:
    """The tables on each rank of the plan ``plan_hash``."""
    cm = kube.get("v1", "configmaps", NS, names.plan_configmap_name(job, plan_hash))
    assert cm is not None, f"no plan ConfigMap for {plan_hash[:8]}"
    plan = Plan.model_validate_json(cm["data"][names.PLAN_KEY])
    return [sorted(t.name for t, _ in held) for held in plan.shards_per_rank()]


def loop_state(kube: KubeApi, job: str) -> dict[str, Any]:
    return status_of(kube, NS, job).get("imbalanceLoop") or {}


def live_info(kube: KubeApi, job: str, plan_hash: str) -> dict[str, Any]:
    """The live re-plan's figures as its plan ConfigMap's summary keeps them."""
    cm = kube.get("v1", "configmaps", NS, names.plan_configmap_name(job, plan_hash))
    text = (((cm or {}).get("metadata") or {}).get("annotations") or {}).get(names.ANN_PLAN)
    return dict((json.loads(text) if text else {}).get("live") or {})


def ranks_line(live: Any) -> str:
    """Each rank's measured compute, ms."""
    return " / ".join(f"{r.compute_ms:.2f}" for r in live.measured()) if live else "-"


def probe_line(live: Any) -> str:
    """Each shard's probe cost (± its spread) and each rank's empty call, ms."""
    if not live:
        return "-"
    shards = " ".join(
        f"{s.table}@{s.rank}={s.ms:.2f}±{s.spread_ms:.2f}"
        for s in sorted(live.shards, key=lambda s: (s.rank, s.table))
    )
    empty = " / ".join(f"{r.probe_empty_ms:.2f}" for r in live.measured())
    return f"{shards}; empty calls {empty}"


def run_scenario(
    sc: Scenario,
    kube: KubeApi,
    start_operator: Start,
    cluster: LocalCluster,
    *,
    targets: bool = True,
) -> dict[str, Any]:
    """Run ``sc`` to its outcome, assert it, print and return its figures.

    With ``targets`` (``make scenarios``, a machine of its own) the scenario must reach
    its expected outcome and the targets. Without (the suite, beside other tests on the
    same cores) a scenario with a better plan asserts what the product said and why:
    a reshard announced, with no step lost and a verdict that names its figures, never
    one that measured worse beyond noise, never a second that did not deliver; or a
    decline that names its figures, the first workers training on.
    """
    job = "loop"
    for i in range(sc.ranks):
        add_local_node(kube, f"cpu-{i}")
    start_operator()
    args = [*ARGS, "--data-pooling", ",".join(f"{k}={v:g}" for k, v in sc.drift.items())]
    start_cpu_job(
        kube, job, steps=1_000_000, batch=sc.batch, workers=(sc.ranks, sc.ranks),
        tables=sc.tables, args=args, resharding={"onImbalance": {**LOOP, **sc.loop}},
    )  # fmt: skip
    threshold = float({**LOOP, **sc.loop}["threshold"])
    poll = POLL_TARGETS if targets else POLL_SUITE

    def watch(probe: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        try:
            return wait_for(probe, timeout, interval=poll, what=what)
        except AssertionError:
            print(f"\n[{sc.name}] status at the timeout:", status_of(kube, NS, job))
            print(f"[{sc.name}] live summary:", live_summary(kube, NS, job))
            raise

    def imbalanced() -> dict[str, Any] | None:
        live = status_of(kube, NS, job).get("live") or {}
        return live if (live.get("measuredImbalance") or 0) > threshold else None

    before = watch(imbalanced, "the straggler in status.live")
    seen = time.monotonic()
    first_plan = before["planHash"]
    declared = plan_ranks(kube, job, first_plan)
    assert sc.precondition(declared), f"[{sc.name}] the declared plan is not the case: {declared}"
    first_pods = {p.name for p in cluster.pods(f"{job}-workers")}

    declines: list[str] = []  # re-plans declined on the way (asking for more evidence)

    def decided() -> dict[str, Any] | None:
        rec = loop_state(kube, job)
        if rec.get("state") == "Declined":
            if sc.expect == "decline":
                return rec
            if rec.get("message") not in declines:
                declines.append(str(rec.get("message")))
        return rec if rec.get("attempts") else None

    # The decision's time bound is a target (``make scenarios``, a machine of its own):
    # beside the suite's other tests the same decision may come later, and is judged on
    # what it says, not on when.
    within = DECISION_SECONDS if targets else TIMEOUT
    if targets or sc.expect == "decline":
        decision = watch(decided, "the loop's decision", within)
    else:
        # Under load the loop may decline a gain it cannot vouch for: it must say so.
        try:
            decision = wait_for(decided, DECISION_SECONDS, interval=poll, what="a reshard")
        except AssertionError:
            decision = loop_state(kube, job)
            if decision.get("state") == "Declined":
                sc = replace(sc, expect="decline")
            else:  # a reshard on its way (announced, not yet started): the rest of the wait
                decision = watch(decided, "a late reshard", within - DECISION_SECONDS)
    decision_seconds = time.monotonic() - seen
    at_decision = live_summary(kube, NS, job)
    figures: dict[str, Any] = {
        "scenario": sc.name,
        "declared plan": declared,
        "before: max/mean": before.get("measuredImbalance"),
        "before: ranks ms": ranks_line(at_decision),
        "before: probe ms": probe_line(at_decision),
        "decision s after the straggler": round(decision_seconds, 1),
        "decision": decision.get("message"),
        "declined first": declines,
        "probe overhead": before.get("probeOverhead"),
    }
    if targets:
        assert decision_seconds <= DECISION_SECONDS, f"[{sc.name}] decided late"
    if sc.expect == "decline":
        assert decision["state"] == "Declined", decision
        time.sleep(SETTLE_SECONDS)  # more summaries come in: the decline stands, the pods stay
        settled = loop_state(kube, job).get("state")

        def declined() -> dict[str, Any] | None:
            status = status_of(kube, NS, job)
            rec = status.get("imbalanceLoop") or {}
            return status if rec.get("state") == "Declined" or rec.get("reshards") else None

        # A decline judged on a noisy probe is looked at again once the probe's spread
        # has narrowed (operator/decide/imbalance.py): the look again must decline too
        # (a reshard instead fails below at once).
        status = watch(declined, "the decline, looked at again", DECISION_SECONDS)
        rec = status["imbalanceLoop"]
        again = "" if settled == "Declined" else f" (looked at again: {settled}, then Declined)"
        figures[f"after {SETTLE_SECONDS:g} s"] = f"{settled}{again}"
        _print(figures)
        print("  live summary:", at_decision.to_json() if at_decision else None)
        assert rec["state"] == "Declined" and not rec.get("reshards"), rec
        # the reason names its figures: the measured max and what the re-plan found
        balanced = condition(status, "Balanced")
        # Its status is whether the latest summary's imbalance is within the threshold:
        # on a shared machine a summary can swing under it while the decline stands.
        assert balanced is not None and balanced["status"] in ("False", "True"), balanced
        assert balanced["reason"] in DECLINES and " ms" in balanced["message"], balanced
        assert {p.name for p in cluster.pods(f"{job}-workers")} == first_pods
        assert all(p.exit_code is None for p in cluster.pods(f"{job}-workers"))
        reasons = [e["reason"] for e in events_for(kube, NS, job)]
        assert balanced["reason"] in reasons and "ReshardingForImbalance" not in reasons
        return figures

    if decision.get("attempts") != 1:
        _print(figures)
        print("  evidence:", decision.get("evidence"))
        print("  live summary:", at_decision.to_json() if at_decision else None)
    assert decision.get("attempts") == 1, f"[{sc.name}] expected a reshard: {decision}"

    def verified() -> dict[str, Any] | None:
        rec = loop_state(kube, job)
        done = rec.get("state") in ("Watching", "Stopped") and rec.get("measuredMaxMilliseconds")
        return rec if done else None

    done = watch(verified, "the reshard verified")
    after_plan = status_of(kube, NS, job)["live"]["planHash"]
    seen_after: dict[str, tuple[float, float]] = {}
    until = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < until:
        live = status_of(kube, NS, job).get("live") or {}
        if live.get("planHash") == after_plan and "measuredImbalance" in live:
            seen_after[live["writtenAt"]] = (
                live["measuredImbalance"], live["measuredMaxComputeMilliseconds"]
            )  # fmt: skip
        time.sleep(poll)
    samples = [(s[1], s[2]) for s in _verify_samples(done)] + list(seen_after.values())
    after_imb = statistics.median(s[0] for s in samples)
    after_max = statistics.median(s[1] for s in samples)
    from_max, predicted = done["fromMaxMilliseconds"], done["predictedMaxMilliseconds"]
    from_imb, meant = done["fromImbalance"], done.get("predictedImbalance", 1.0)
    info = live_info(kube, job, after_plan)
    # no step lost: the new workers resume at the step the old ones checkpointed
    logs = [cluster.kubelet.log(p.name) for p in cluster.pods(f"{job}-workers")]
    stopped = [s for s in map(stopped_step, logs) if s is not None]
    resumed = [s for s in map(resumed_step, logs) if s is not None]
    figures.update({
        "live plan": plan_ranks(kube, job, after_plan),
        "live prices": info.get("fit"),
        "predicted max ms": round(predicted, 2),
        "predicted gain": done.get("predictedGain"),
        "uncertainty": done.get("uncertainty"),
        "max/mean": f"{from_imb:.3f} -> {after_imb:.3f} (median after; predicted {meant:.3f})",
        "max-rank compute ms": f"{from_max:.2f} -> {after_max:.2f} (predicted {predicted:.2f})",
        "reshard s": round(done.get("reshardSeconds", 0.0), 1),
        "steps lost": max(stopped) - max(resumed) if stopped and resumed else "?",
        "verdict": done.get("verdict"),
    })  # fmt: skip
    _print(figures)
    reasons = [e["reason"] for e in events_for(kube, NS, job)]
    # the loop's reshard was announced, and ended as a node reshard does
    assert "ReshardingForImbalance" in reasons and "Resharded" in reasons, reasons
    assert stopped and resumed and max(resumed) == max(stopped), (stopped, resumed)
    if not targets:
        # What the product says, at any load: one reshard, its verdict with the figures;
        # one that did not deliver is evidence, never a second reshard that does not.
        assert 1 <= len(done["reshards"]) <= MAX_RESHARDS, done
        assert "max/mean" in str(done.get("verdict")), done
        assert after_imb <= from_imb + NOISE, f"[{sc.name}] measured worse: {figures}"
        return figures
    assert len(done["reshards"]) == 1, done
    assert done["state"] == "Watching" and "ReshardDelivered" in reasons, done
    assert after_imb <= BALANCED, f"[{sc.name}] max/mean after {after_imb:.3f}"
    # The max-rank compute falls by at least half the predicted fall, in units of the
    # mean rank's (moves keep the total work; the machine's speed, which 2 shared cores
    # change between two summaries a minute apart, cancels): max/mean.
    assert from_imb - after_imb >= DELIVERED_SHARE * (from_imb - meant), figures
    return figures


def _verify_samples(rec: dict[str, Any]) -> list[tuple[str, float, float]]:
    return [
        (v["writtenAt"], v["imbalance"], v["maxMilliseconds"])
        for v in rec.get("verifySummaries") or []
    ]


def _print(figures: dict[str, Any]) -> None:
    print(f"\n=== closed loop scenario: {figures['scenario']}")
    for key, value in figures.items():
        if key != "scenario":
            print(f"  {key}: {value}")
