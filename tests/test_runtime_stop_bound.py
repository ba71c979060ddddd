"""A bounded stop when a peer is gone: real processes, no mock of torch.distributed.

The scenario: two torchrun "nodes" (one process each, one c10d rendezvous), started
through the launcher as the worker image starts them. One node freezes (SIGSTOP of its
launcher, torchrun and worker: a node that hangs or lost power). The survivor's worker
is blocked in a collective and, when the frozen node hosted the rendezvous store, its
torchrun in a store call; neither heeds SIGTERM. The survivor's launcher must still
exit within 30 s of SIGTERM, non-zero. Plus the watchdog on its own (a subprocess whose
main thread never returns to Python) and the launcher's bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_runtime_torchrun import _env, plan_cli, small_tables, trainer

from shardwise.planner.tables import save_tables
from shardwise.runtime.env import Timeouts
from shardwise.runtime.launch import (
    EXIT_GRACE,
    KILL_MARGIN,
    OrphanWatch,
    StopClock,
    max_restarts,
    process_tree,
    torchrun_env,
)
from shardwise.runtime.stop import BOUND_EXIT, GracefulStop

HELPERS = Path(__file__).parent / "runtime_helpers"
LAUNCH = [sys.executable, "-m", "shardwise.runtime.launch"]
#: The target: after a hard node loss, the survivors exit within this of SIGTERM.
TARGET_S = 30.0


# --------------------------------------------------------------------------- bookkeeping


def test_stop_clock_waits_for_the_checkpoint_only_when_every_rank_agreed() -> None:
    t = Timeouts(stop=10, checkpoint=300)
    clock = StopClock(t, signalled_at=100.0)
    one = {"rank": 0, "local_world_size": 2}
    two = {"rank": 1, "local_world_size": 2}
    assert clock.deadline([], [], now=101) == 100 + 10 + KILL_MARGIN
    assert clock.deadline([one], [], now=101) == 100 + 10 + KILL_MARGIN  # rank 1 is stuck
    assert clock.deadline([one, two], [], now=101) == 100 + 10 + 300 + KILL_MARGIN
    # the ranks say how long their save may take (the checkpoint timeout at most)
    quick = [{**one, "save_allowance": 12.0}, {**two, "save_allowance": 11.0}]
    assert clock.deadline(quick, [], now=101) == 100 + 10 + 12 + KILL_MARGIN
    slow = [{**one, "save_allowance": 1e9}, two]
    assert clock.deadline(slow, [], now=101) == 100 + 10 + 300 + KILL_MARGIN
    # every rank checkpointed: torchrun gets a few seconds to exit, from then on
    assert clock.deadline([one, two], [one, two], now=130) == 130 + EXIT_GRACE
    assert clock.deadline([one, two], [one, two], now=140) == 130 + EXIT_GRACE


def test_orphaned_torchrun_is_given_up_only_after_it_had_workers() -> None:
    watch = OrphanWatch(grace=15)
    assert not watch.stuck(0, now=0)  # the first rendezvous: no worker yet, for long
    assert not watch.stuck(0, now=1000)
    assert not watch.stuck(2, now=1001)
    assert not watch.stuck(0, now=1002)  # the workers exited: the clock starts
    assert not watch.stuck(1, now=1010)  # ... and stops when one is back
    assert not watch.stuck(0, now=1011)
    assert watch.stuck(0, now=1026)
    assert max_restarts(["--nnodes=2", "x.py", "--max-restarts=3"], {}) == 0  # the script's
    assert max_restarts(["-m", "pkg.train", "--max-restarts", "3"], {}) == 0  # the module's
    assert max_restarts(["--max-restarts", "2", "x.py"], {}) == 2
    assert max_restarts(["--max_restarts=1", "x.py"], {"PET_MAX_RESTARTS": "5"}) == 1
    assert max_restarts(["x.py"], {"PET_MAX_RESTARTS": "5"}) == 5
    assert max_restarts(["--max-restarts=x"], {}) is None


def test_torchrun_env_fits_the_bounds_and_keeps_what_the_user_set() -> None:
    t = Timeouts(stop=10, checkpoint=300, rendezvous=45)
    env = torchrun_env({"A": "1"}, ["--nnodes=2", "x.py"], "/tmp/s", t)
    assert env["SHARDWISE_STOP_DIR"] == "/tmp/s" and env["A"] == "1"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "310"
    assert env["PET_RDZV_CONF"] == "read_timeout=45"
    mine = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20", "PET_RDZV_CONF": "is_host=1"}
    assert {k: torchrun_env(mine, [], "/s", t)[k] for k in mine} == mine
    given = torchrun_env({}, ["--rdzv-conf=join_timeout=9", "x.py"], "/s", t)
    assert "PET_RDZV_CONF" not in given
    off = torchrun_env({}, [], "/s", Timeouts(stop=0))
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in off
    # an elastic torchrun gets its agents' store unshared (a joining node hangs otherwise)
    store = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    assert torchrun_env({}, ["--nnodes=1:4", "x.py"], "/s", t)[store] == "1"
    assert torchrun_env({}, ["--nnodes", "1:4", "x.py"], "/s", t)[store] == "1"
    for fixed in (["--nnodes=2:2", "x.py"], ["--nnodes=2", "x.py"], ["x.py", "--nnodes=1:4"]):
        assert store not in torchrun_env({}, fixed, "/s", t), fixed
    assert torchrun_env({store: "0"}, ["--nnodes=1:4"], "/s", t)[store] == "0"


def test_timeouts_from_the_environment() -> None:
    from shardwise.basics import UserError

    assert Timeouts.from_environ({}) == Timeouts()
    t = Timeouts.from_environ({"SHARDWISE_STOP_TIMEOUT": "0", "SHARDWISE_COLLECTIVE_TIMEOUT": "5"})
    assert (t.stop, t.collective) == (0, 5)
    for bad in ("x", "-1", "inf"):
        with pytest.raises(UserError, match="SHARDWISE_STOP_TIMEOUT"):
            Timeouts.from_environ({"SHARDWISE_STOP_TIMEOUT": bad})
    with pytest.raises(UserError, match="above 0"):
        Timeouts.from_environ({"SHARDWISE_COLLECTIVE_TIMEOUT": "0"})


def test_no_watchdog_when_the_bound_is_off() -> None:
    stop = GracefulStop(bound=0).install()
    try:
        assert stop._watchdog is None
    finally:
        stop.uninstall()


# --------------------------------------------------------------------------- the watchdog


def _helper(mode: str, bound: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "watchdog_worker.py"), mode],
        env={**os.environ, "SHARDWISE_STOP_TIMEOUT": bound},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _wait(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out}")
    return out


def test_watchdog_ends_a_rank_whose_main_thread_never_returns() -> None:
    """The main thread is blocked in C and never runs the Python handler (SIGTERM is
    masked there, as good as a gloo wait): the watchdog hears of the signal through the
    wakeup fd and exits the process at the bound, with a message and status 124."""
    proc = _helper("stuck", "1")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = _wait(proc, 20)
    took = time.monotonic() - started
    assert proc.returncode == BOUND_EXIT, out
    assert 1.0 <= took < 5.0, took
    assert "has not reached a step boundary with every peer" in out
    assert "SHARDWISE_STOP_TIMEOUT=1" in out


def test_save_allowance_follows_the_last_save() -> None:
    stop = GracefulStop(bound=0)
    assert stop.save_allowance() == stop.checkpoint_timeout  # nothing to go by yet
    with stop.checkpointing():
        time.sleep(0.05)
    assert stop.last_save_seconds is not None and stop.last_save_seconds >= 0.05
    assert stop.save_allowance() == pytest.approx(3 * stop.last_save_seconds + 5)


@pytest.mark.slow
def test_watchdog_ends_a_save_that_overruns_its_allowance() -> None:
    """A peer died during a save: the save would wait for the checkpoint timeout
    (300 s); after a 0.1 s save, the rank gives up at 3 × 0.1 + 5 s + the bound."""
    proc = _helper("hung-save", "0.5")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = _wait(proc, 40)
    took = time.monotonic() - started
    assert proc.returncode == BOUND_EXIT, out
    assert 5.0 <= took < 10.0, took


def test_watchdog_waits_for_a_checkpoint_under_way() -> None:
    """A save that was under way when the signal came (2 s here) does not count against
    the bound (0.5 s): the rank reaches its boundary afterwards and exits 0."""
    proc = _helper("save-then-stop", "0.5")
    proc.send_signal(signal.SIGTERM)
    out = _wait(proc, 30)
    assert proc.returncode == 0, out
    assert "stopped=True" in out and "step boundary" not in out


# --------------------------------------------------------------------------- a lost node


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_tree(pid: int) -> None:
    for p in reversed(process_tree(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)  # stopped processes die too


Nodes = list[subprocess.Popen[bytes]]


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Path, Callable[..., Nodes]]]:
    """Start two torchrun nodes of one process each through the launcher; node 0 hosts
    the c10d rendezvous store. Killed whole at the end whatever happened."""
    save_tables(small_tables((16, 16)), tmp_path / "tables.yaml")
    plan_cli(tmp_path / "tables.yaml", 2, tmp_path / "plan.json")
    port = _port()
    nodes: Nodes = []

    def start(**extra_env: str) -> Nodes:
        for node in (0, 1):
            cmd = [
                *LAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lost-node",
                f"--rdzv-conf=is_host={int(node == 0)}", "--local-addr=127.0.0.1",
                *trainer(
                    "--tables", "tables.yaml", "--steps", "1000000", "--log-every", "10",
                    "--measure-every", "0", "--checkpoint-dir", "ckpt", "--checkpoint-every", "5",
                ),
            ]  # fmt: skip
            with (tmp_path / f"node{node}.log").open("wb") as log:
                nodes.append(
                    subprocess.Popen(
                        [str(c) for c in cmd],
                        cwd=tmp_path,
                        env=_env(SHARDWISE_PLAN=str(tmp_path / "plan.json"), **extra_env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        return nodes

    try:
        yield tmp_path, start
    finally:
        for proc in nodes:
            _kill_tree(proc.pid)
            proc.wait()


def _log(d: Path) -> str:
    return "".join((d / f"node{n}.log").read_text(errors="replace") for n in (0, 1))


def _freeze_after_a_checkpoint(d: Path, nodes: Nodes, frozen: int) -> None:
    """Once both nodes trained and checkpointed, ``frozen`` hangs: SIGSTOP of its
    launcher, torchrun and worker (a node that froze or lost power)."""
    deadline = time.monotonic() + 150
    while "checkpoint ckpt/step-000000005" not in _log(d):
        assert all(p.poll() is None for p in nodes), _log(d)[-4000:]
        assert time.monotonic() < deadline, _log(d)[-4000:]
        time.sleep(0.5)
    for pid in process_tree(nodes[frozen].pid):
        os.kill(pid, signal.SIGSTOP)
    time.sleep(2)  # the survivor is now blocked on the frozen peer


def _exit_within(proc: subprocess.Popen[bytes], timeout: float, d: Path) -> float:
    started = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the survivor was still running after {timeout} s:\n{_log(d)[-4000:]}")
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [0, 1], ids=["rendezvous-host-freezes", "other-node-freezes"])
def test_survivor_exits_within_30_s_of_sigterm_after_a_node_freezes(
    two_nodes: tuple[Path, Callable[..., Nodes]], frozen: int
) -> None:
    d, start = two_nodes
    nodes = start()
    _freeze_after_a_checkpoint(d, nodes, frozen)
    survivor = nodes[1 - frozen]
    survivor.send_signal(signal.SIGTERM)  # the kubelet, once the operator deletes the Job
    took = _exit_within(survivor, 60, d)
    print(f"survivor exited {survivor.returncode} {took:.1f} s after SIGTERM")
    log = (d / f"node{1 - frozen}.log").read_text(errors="replace")
    assert took < TARGET_S, log[-4000:]
    assert survivor.returncode != 0, log[-4000:]  # no clean stop: no new checkpoint
    # the rank's watchdog, naming the checkpoint training will resume from
    assert "has not reached a step boundary with every peer" in log
    assert "the last one stands (ckpt/step-" in log
    # When the frozen node hosted the store, the survivor's torchrun may be blocked in a
    # store call at the SIGTERM (then the launcher kills it: BOUND_EXIT) or not (then it
    # exits 1 by itself): either way within the bound.
    if survivor.returncode == BOUND_EXIT:
        assert "Killed torchrun and its workers" in log, log[-4000:]


@pytest.mark.slow
def test_survivor_of_a_frozen_rendezvous_host_exits_without_a_signal(
    two_nodes: tuple[Path, Callable[..., Nodes]],
) -> None:
    """No SIGTERM at all: the survivor's collective fails at its timeout (10 s here; a
    checkpoint every 5 steps is often under way at the freeze, so the checkpoint timeout
    is 10 s too), its worker exits, torchrun stays blocked on the frozen store, and the
    launcher kills it once the workers have been gone for the store timeout (10 s) + 5 s:
    the pod fails on its own instead of running on with no worker."""
    d, start = two_nodes
    nodes = start(
        SHARDWISE_COLLECTIVE_TIMEOUT="10",
        SHARDWISE_CHECKPOINT_TIMEOUT="10",
        SHARDWISE_RDZV_TIMEOUT="10",
    )
    _freeze_after_a_checkpoint(d, nodes, 0)
    took = _exit_within(nodes[1], 90, d)
    print(f"survivor exited {nodes[1].returncode} {took:.1f} s after the freeze, unsignalled")
    log = (d / "node1.log").read_text(errors="replace")
    assert nodes[1].returncode == BOUND_EXIT, log[-4000:]
    said = [ln for ln in log.splitlines() if "imed out" in ln or "rror" in ln or "atchdog" in ln]
    assert "Timed out waiting 10000ms" in log, said[-20:]  # gloo, at the collective timeout
    assert "every worker exited but torchrun did not" in log
