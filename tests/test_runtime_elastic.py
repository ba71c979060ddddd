"""Growing in place: an elastic torchrun (``--nnodes=1:3``) that nodes join, one at a time.

This is what a worker pod sees when Kueue's workload slices grow its Job (the operator
raises the Job's parallelism, docs/resharding.md): a new pod's torchrun joins the
rendezvous, the running node's torchrun stops its workers (SIGTERM: they checkpoint at
an agreed step), and every node starts its workers again at the new world size. Each
rank reads the plan for that world from the plans directory (``SHARDWISE_PLAN`` names a
directory of ``plan-<ranks>.json``) and resumes from the stop checkpoint: no step lost.
Launchers on this machine stand for the pods; the real c10d rendezvous, real
restarts, real checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_runtime_torchrun import (
    _env,
    _wait_for_metrics,
    finish,
    free_port_pair,
    plan_cli,
    small_tables,
    start,
    trainer,
)

from shardwise import names
from shardwise.basics import UserError
from shardwise.planner.tables import save_tables
from shardwise.runtime.checkpoint import latest_checkpoint, read_meta
from shardwise.runtime.checkpoint_meta import META_FILE, CheckpointMeta
from shardwise.runtime.plancheck import world_plan_file

LAUNCHER = [sys.executable, "-m", "shardwise.runtime.launch"]


def _node(
    d: Path, rdzv_port: int, metrics_port: int, host: bool, *, most: int = 2, tick: int = 1
) -> subprocess.Popen[str]:
    """One pod's torchrun (through the launcher), as the operator renders an elastic
    worker: ``--nnodes=1:<most>``, restarts allowed, the plans directory mounted.
    ``host``: this node hosts the rendezvous store, as pod 0 does (its name is the
    endpoint). ``tick``: how often its torchrun looks for new members, in seconds."""
    cmd = [
        *LAUNCHER,
        f"--nnodes=1:{most}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{rdzv_port}",
        "--rdzv_id=elastic-test",
        "--max-restarts=4",
        f"--monitor-interval={tick}",
        *trainer(
            "--tables", "tables.yaml", "--steps", "1000000", "--checkpoint-dir", "ckpt",
            "--measure-every", "2", "--summary", "summary.json", "--keep", "8",
        ),
    ]  # fmt: skip
    env = _env(
        SHARDWISE_PLAN=str(d / "plans"),
        SHARDWISE_ELASTIC="1",
        SHARDWISE_METRICS_PORT=str(metrics_port),
        # the last call after the first node: long enough that a restart waits for both
        PET_RDZV_CONF=f"read_timeout=60,last_call_timeout=5,is_host={int(host)}",
        LOGLEVEL="INFO",  # the agents say when they see a node join
    )
    return start(cmd, env, d)


def _stop_checkpoint(ckpt: Path, world_size: int) -> CheckpointMeta:
    """The checkpoint the world of ``world_size`` wrote when it stopped to grow."""
    metas = [read_meta(p) for p in sorted(ckpt.glob("step-*")) if (p / META_FILE).is_file()]
    found = [m for m in metas if m.reason == "stop" and m.world_size == world_size]
    assert found, [(m.step, m.reason, m.world_size) for m in metas]
    return found[-1]


@pytest.mark.slow
def test_nodes_joining_grow_the_world_in_place_and_a_rank_stopped_by_its_peers_restarts(
    tmp_path: Path,
) -> None:
    """One job grows twice, as Kueue's slices grow a Job: 1 → 2 → 3 nodes.

    - 1 → 2: the operator writes the bigger world's plan, then a node joins; the
      running node's torchrun stops its worker (a stop checkpoint at world 1) and both
      start again at world 2 from it.
    - 2 → 3: nodes see a newcomer at their own monitor ticks. Node B looks every 15 s:
      before it sees node C, node A (every 1 s) has usually stopped its worker, so B's
      rank stops only because a peer did. Exiting 0 would end B's run as done (and close
      the rendezvous); it exits 75, and B's torchrun restarts it into the world of 3,
      from the same checkpoint. When B's tick comes first, the roles swap: A's rank is
      the one.

    Each resume starts at the step its world stopped at: nothing lost."""
    d = tmp_path
    save_tables(small_tables((16,) * 6), d / "tables.yaml")
    (d / "plans").mkdir()
    plans = {w: plan_cli(d / "tables.yaml", w, d / f"plan{w}.json") for w in (1, 2, 3)}

    def publish(w: int) -> None:  # the operator writes a world's plan before it grows
        (d / f"plan{w}.json").rename(d / "plans" / names.world_plan_key(w))

    publish(1)
    rdzv, metrics = free_port_pair(), [free_port_pair() + 10 * i for i in range(3)]
    a = _node(d, rdzv, metrics[0], True, most=3)
    b: subprocess.Popen[str] | None = None
    c: subprocess.Popen[str] | None = None
    outs: list[str] = []
    try:
        _wait_for_metrics(metrics[:1], a, timeout=180)  # one node trains at world 1
        publish(2)
        b = _node(d, rdzv, metrics[1], False, most=3, tick=15)
        _wait_for_metrics(metrics[:2], b, timeout=240)  # a world of 2
        publish(3)
        c = _node(d, rdzv, metrics[2], False, most=3)
        _wait_for_metrics(metrics, c, timeout=240)  # all three, at world 3
        for p in (a, b, c):
            os.kill(p.pid, signal.SIGTERM)  # the pods deleted: every node stops cleanly
        outs = [
            finish(p, 120, f"node {n}: no exit after SIGTERM")
            for n, p in zip("abc", (a, b, c), strict=True)
        ]
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [p.returncode for p in (a, b, c) if p is not None] == [0, 0, 0], [
        o[-2000:] for o in outs
    ]
    # One node's rank (whatever its rank number) stopped for a peer, and its torchrun
    # restarted it: B's, unless B's tick came first (then A's). Or B's own tick saw C
    # before A's stop reached B's rank (B's tick falls anywhere in its 15 s; beside two
    # busy loops A's stop once took that long): then B's agent says it saw the newcomer
    # and restarts its worker itself, and no rank stopped for a peer. Either way the
    # product says why each node restarted.
    said = "for a peer's stop, not this node's: exit 75"
    by_peer = [n for n, o in zip("ab", outs, strict=False) if said in o and "exitcode: 75" in o]
    saw_c_itself = by_peer == [] and "Detected 1 new nodes from group_rank" in outs[1]
    assert by_peer in (["a"], ["b"]) or saw_c_itself, [o[-3000:] for o in outs[:2]]
    # each world stopped at a step the next one resumed from, with its own plan
    grew_1_2, grew_2_3 = _stop_checkpoint(d / "ckpt", 1), _stop_checkpoint(d / "ckpt", 2)
    assert (grew_1_2.plan_hash, grew_2_3.plan_hash) == (plans[1].hash, plans[2].hash)
    assert grew_1_2.step < grew_2_3.step
    s = json.loads((d / "summary.json").read_text())
    assert (int(s["start_step"]), s["resumed_world_size"]) == (grew_2_3.step, 2)
    assert s["end_step"] > grew_2_3.step
    last = latest_checkpoint(d / "ckpt")
    assert last is not None
    assert (read_meta(last).world_size, read_meta(last).plan_hash) == (3, plans[3].hash)


def test_an_elastic_rank_waits_for_its_worlds_plan_then_names_what_is_there(
    tmp_path: Path,
) -> None:
    (tmp_path / names.world_plan_key(2)).write_text("{}")
    late = tmp_path / names.world_plan_key(4)
    said: list[str] = []
    writer = threading.Timer(0.3, late.write_text, args=("{}",))
    writer.start()
    t0 = time.monotonic()
    assert world_plan_file(tmp_path, 4, 10, note=said.append, poll=0.05) == late
    assert time.monotonic() - t0 < 5 and len(said) == 1 and "plan-4.json" in said[0]
    with pytest.raises(UserError) as err:
        world_plan_file(tmp_path, 8, 0.2, note=said.append, poll=0.05)
    assert "no plan for 8 ranks" in str(err.value)
    assert "plan-2.json, plan-4.json" in str(err.value)
    assert names.ENV_PLAN_WAIT in str(err.value)
