"""Nothing outlives a killed operator: its planner processes exit with it, and so does
multiprocessing's resource tracker (:func:`shardwise.operator.loop.planner_pool.exit_with_parent`).

The operator runs as ``shardwise operator -n …`` does for development, a real process
against the API emulator, and is killed with SIGKILL while its planner process plans a
job of 400 tables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from k8s.helpers import NAMESPACE, add_node, dlrmjob, status_of, wait_for
from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi

pytest_plugins = ["k8s.fixtures"]

#: CPU seconds after which a planner process is past its warm-up and planning.
WARMED_UP_CPU_SECONDS = 8.0


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid → (parent pid, command line)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":  # a zombie has exited; only its parent's wait is missing
            out[int(entry.name)] = (int(fields[1]), cmdline)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid``, with their command lines."""
    procs = _processes()
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, cmd) in procs.items():
            if ppid == parent and child not in found:
                found[child] = cmd
                todo.append(child)
    return found


CHILD = (
    "import os, time\n"
    "from shardwise.operator.loop.planner_pool import exit_with_parent\n"
    "exit_with_parent(os.getppid(), every=0.05)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(60)\n"
)


def test_the_watch_exits_when_the_parent_is_gone() -> None:
    """A parent that starts a watched child and exits at once: the child follows."""
    parent = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE)\n"
        "print(child.stdout.readline().decode().strip(), flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, check=True
    )
    child = int(out.stdout.split()[0])
    wait_for(lambda: child not in _processes(), timeout=10, what=f"process {child} to exit")


def test_the_watch_stays_while_the_parent_lives() -> None:
    """In a child of this test (not in the test process, which must not keep a watch):
    the parent lives, so the child runs on to its end."""
    code = (
        "import os, time\n"
        "from shardwise.operator.loop.planner_pool import exit_with_parent\n"
        "exit_with_parent(os.getppid(), every=0.01)\n"
        "time.sleep(0.3)\n"
        "print('alive')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "alive"), out.stderr


@pytest.mark.slow
def test_a_killed_operator_leaves_no_process_behind(
    api_server: EmulatorServer,
    kube: KubeApi,
    tmp_path: Path,
    unused_tcp_port_factory: Callable[[], int],
) -> None:
    add_node(kube, "gpu-1", gpus=8)
    ports = [str(unused_tcp_port_factory()) for _ in range(2)]
    log = (tmp_path / "operator.log").open("w")
    operator = subprocess.Popen(
        [sys.executable, "-m", "shardwise", "operator", "-n", NAMESPACE,
         "--server", api_server.url, "--health-port", ports[0], "--metrics-port", ports[1]],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        kube.create(dlrmjob("big", NAMESPACE, tables=400, workers=(1, 1), gpus_per_worker=8))

        def planning() -> dict[int, str] | None:
            """The operator's processes once its planner has worked past its warm-up
            (torch and the bundled model) on the job, which is still Planning."""
            assert operator.poll() is None, (tmp_path / "operator.log").read_text()
            family = descendants(operator.pid)
            planners = [p for p, cmd in family.items() if "spawn_main" in cmd]
            busy = any(cpu_seconds(p) > WARMED_UP_CPU_SECONDS for p in planners)
            phase = status_of(kube, NAMESPACE, "big").get("phase")
            return family if busy and phase == "Planning" else None

        family = wait_for(planning, timeout=180, interval=0.2, what="the operator to plan")
        planner = next(p for p, cmd in family.items() if "spawn_main" in cmd)
        spent = cpu_seconds(planner)
        operator.send_signal(signal.SIGKILL)
        operator.wait(timeout=30)
        start = time.monotonic()

        def survivors() -> dict[int, str]:
            alive = _processes()
            return {pid: cmd for pid, cmd in family.items() if pid in alive}

        try:
            wait_for(lambda: not survivors(), timeout=10, interval=0.1, what="no survivor")
        except AssertionError:
            left = survivors()
            for pid in left:  # not left running for the rest of the suite
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"still alive 10 s after SIGKILL: {left}") from None
        print(
            f"\n{len(family)} processes below the operator "
            f"({', '.join(sorted({c.split()[-1][:40] for c in family.values()}))}); "
            f"all gone {time.monotonic() - start:.2f} s after SIGKILL; the planner had "
            f"{spent:.1f} s of CPU, the job was still Planning"
        )
    finally:
        if operator.poll() is None:
            os.killpg(operator.pid, signal.SIGKILL)
        log.close()
