"""Worker runtime parts, in-process: optimizer-state remapping, cost arithmetic, the
Prometheus export, the stop flag, checkpoint bookkeeping; and the launcher's exit
status with real torchrun processes (stdlib workers, no training)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shardwise.basics import UserError
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.topology import Topology
from shardwise.runtime.checkpoint import (
    CheckpointMeta,
    TableLayout,
    checkpoint_problems,
    latest_checkpoint,
    read_meta,
    remap_rowwise,
    weight_key,
)
from shardwise.runtime.launch import clean_stop
from shardwise.runtime.live_cost import (
    PHASES,
    CostSample,
    Marks,
    WorkerMetrics,
    phases_from_marks,
)
from shardwise.runtime.stop import GracefulStop, read_stop_markers, write_stop_marker

HELPERS = Path(__file__).parent / "runtime_helpers"

# --------------------------------------------------------------------------- row-wise state


def test_remap_keeps_an_unchanged_split() -> None:
    values = torch.rand(3, 10)
    cols = [(0, 8), (8, 16), (24, 8)]
    assert torch.equal(remap_rowwise(cols, values, cols), values)
    # Listed in another order: each new block still gets its own columns' state.
    assert torch.equal(remap_rowwise(cols, values, cols[::-1]), values.flip(0))


def test_remap_of_a_merge_is_the_width_weighted_mean() -> None:
    """Row-wise Adagrad keeps mean(g²) over a shard's columns; for a union of shards
    that mean is exactly the width-weighted mean of theirs."""
    grads = torch.rand(5, 10, 32)  # steps × rows × columns

    def state(cols: list[tuple[int, int]]) -> torch.Tensor:
        return torch.stack([grads[:, :, a : a + w].pow(2).mean(-1).sum(0) for a, w in cols])

    old = [(0, 8), (8, 24)]
    merged = remap_rowwise(old, state(old), [(0, 32)])
    assert torch.allclose(merged, state([(0, 32)]), rtol=1e-5)
    four = [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert torch.allclose(
        remap_rowwise(four, state(four), [(0, 16), (16, 16)]), state([(0, 16), (16, 16)]), rtol=1e-5
    )


def test_remap_of_a_cut_copies_the_parent_value() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = remap_rowwise([(0, 8), (8, 8)], values, [(0, 4), (4, 8), (12, 4)])
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]))


def test_remap_refuses_other_columns() -> None:
    with pytest.raises(ValueError, match="covered"):
        remap_rowwise([(0, 8)], torch.zeros(1, 3), [(0, 16)])


# --------------------------------------------------------------------------- cost arithmetic


def test_phases_from_marks() -> None:
    marks = Marks(
        fwd_start=0.0,
        fwd_kernels=[(1.0, 1.5), (2.0, 2.25)],  # input dist 1.0, compute 0.75
        fwd_end=3.0,  # first kernel to output ready: 2.0, of which 0.75 compute
        bwd_start=10.0,
        bwd_kernels=[(10.5, 11.0), (12.0, 12.5)],  # compute 1.0, span 2.5
    )
    sample = phases_from_marks(marks, lambda a, b: b - a)
    assert sample == CostSample(
        fwd_compute=0.75, bwd_compute=1.0, fwd_comm=1.25, bwd_comm=1.5, input_dist=1.0
    )
    assert sample is not None and sample.total == pytest.approx(4.5)
    assert sample.as_dict()["total"] == sample.total


def test_a_step_without_kernels_is_no_sample() -> None:
    assert (
        phases_from_marks(Marks(fwd_start=0.0, fwd_end=1.0, bwd_start=2.0), lambda a, b: b - a)
        is None
    )


# --------------------------------------------------------------------------- Prometheus


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_names_labels_and_medians() -> None:
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, namespace="ns", job="j", rank=3, window=3)
    m.set_info(plan_hash="abc", planner="p", world_size=4, device="cpu", batch_size=8)
    for t in (0.1, 0.3, 0.2, 5.0):
        m.observe_step(t, loss=t)
    for k in (1.0, 2.0, 9.0):
        m.observe_cost(CostSample(k, 2 * k, 3 * k, 4 * k, 0.5 * k))
    got = _samples(registry)
    base = (("job", "j"), ("namespace", "ns"), ("rank", "3"))
    cost = "shardwise_embedding_cost_seconds"
    assert got[(cost, tuple(sorted((*base, ("phase", "fwd_compute")))))] == 2.0  # median
    assert got[(cost, tuple(sorted((*base, ("phase", "total")))))] == 20.0
    assert got[(cost, tuple(sorted((*base, ("phase", "input_dist")))))] == 1.0
    assert got[("shardwise_worker_steps_total", base)] == 4
    assert got[("shardwise_embedding_cost_samples_total", base)] == 3
    assert got[("shardwise_worker_step_seconds", base)] == 0.3  # median of the last 3
    assert got[("shardwise_worker_loss", base)] == 5.0
    info = [k for k in got if k[0] == "shardwise_worker_info"]
    assert len(info) == 1 and ("plan_hash", "abc") in info[0][1]
    assert set(m.medians()) == {*PHASES, "input_dist", "total"}


def test_metrics_endpoint_serves_this_registry_only() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, namespace="", job="", rank=0)
    assert m.serve(0) is None  # port 0: off
    server = m.serve(port, addr="127.0.0.1")
    try:
        m.observe_step(0.01)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'shardwise_worker_steps_total{job="",namespace="",rank="0"} 1.0' in text
        assert "python_gc_objects_collected_total" not in text  # not the global registry
        with pytest.raises(UserError, match=f"cannot serve metrics on port {port}"):
            WorkerMetrics(CollectorRegistry(), namespace="", job="", rank=1).serve(
                port, addr="127.0.0.1"
            )
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- stop flag


def test_sigterm_sets_the_flag_and_nothing_else() -> None:
    stop = GracefulStop().install()
    try:
        assert not stop.requested and not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert stop.requested and stop.signal_name == "SIGTERM"
        assert stop.should_stop()  # no process group: this rank alone decides
        os.kill(os.getpid(), signal.SIGINT)  # a second signal keeps the first reason
        time.sleep(0.05)
        assert stop.signal_name == "SIGTERM"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_stop_markers_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert write_stop_marker(0, 2, 5, None, "SIGTERM") is None  # no directory: no marker
    monkeypatch.setenv("SHARDWISE_STOP_DIR", str(tmp_path))
    write_stop_marker(1, 2, 5, "c/step-5", "SIGTERM")
    assert not clean_stop(read_stop_markers(tmp_path))  # rank 0 missing
    write_stop_marker(0, 2, 5, "c/step-5", "SIGTERM")
    markers = read_stop_markers(tmp_path)
    assert [m["rank"] for m in markers] == [0, 1] and clean_stop(markers)
    assert not clean_stop([])


# --------------------------------------------------------------------------- checkpoint files


def _meta(tables: list[TableLayout], step: int = 5) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        world_size=2,
        plan_hash="h",
        planner="p",
        reason="final",
        saved_at=0.0,
        module_path="sparse_arch.embedding_bag_collection",
        tables=tables,
    )


def _layout(name: str, rows: int, dim: int) -> TableLayout:
    return TableLayout(
        name=name, rows=rows, dim=dim, dtype="fp32", weight_key=weight_key(name), columns=[(0, dim)]
    )


def test_latest_pointer(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None  # nothing yet: start afresh
    (tmp_path / "latest").write_text("step-000000005\n")
    with pytest.raises(UserError, match="not a complete checkpoint"):
        latest_checkpoint(tmp_path)  # the directory is missing its description
    step = tmp_path / "step-000000005"
    step.mkdir()
    (step / "shardwise.json").write_text(_meta([_layout("a", 10, 8)]).model_dump_json())
    assert latest_checkpoint(tmp_path) == step
    assert read_meta(step).tables[0].name == "a"
    (step / "shardwise.json").write_text("{}")
    with pytest.raises(UserError, match="not a checkpoint description"):
        read_meta(step)


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    from shardwise.runtime.checkpoint import _prune, checkpoint_dir

    for step in (100, 150, 200, 50):
        checkpoint_dir(tmp_path, step).mkdir()
    current = checkpoint_dir(tmp_path, 150)  # a resume from an older step saved here
    _prune(tmp_path, 2, current)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000150", "step-000000200"]
    _prune(tmp_path, 1, current)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000150"]


def test_flat_optimizer_entries_keep_the_nested_names() -> None:
    """The fused optimizer's state goes to DCP as flat entries (a rank without tables
    has none, rather than an empty dict DCP cannot load) under the names DCP gave the
    nested dict: checkpoints written either way are the same files."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from shardwise.runtime.checkpoint import _optimizer_entries

    fused = {
        weight_key("a"): {"a.momentum1": torch.zeros(3)},
        weight_key("b"): {"b.momentum1": torch.zeros(2), "b.other": torch.zeros(1)},
    }
    nested, _ = flatten_state_dict({"embedding_optimizer": fused})
    assert _optimizer_entries(fused).keys() == nested.keys()
    assert _optimizer_entries({}) == {}


def test_checkpoint_of_other_tables_names_them() -> None:
    plan = Plan(
        world_size=2,
        planner="p",
        topology=Topology(gpus=2, gpu_memory_bytes=2**30),
        tables=[
            PlanTable(name=n, rows=10, dim=8, shards=[Shard(rank=0, col_offset=0, cols=8)])
            for n in ("a", "b")
        ],
    ).with_hash()
    meta = _meta([_layout("a", 10, 16), _layout("c", 10, 8)])
    problems = checkpoint_problems(meta, plan, "sparse_arch.embedding_bag_collection")
    assert "table 'a' is 10x16 fp32 in the checkpoint but 10x8 fp32 in the plan" in problems
    assert "table 'b' is not in the checkpoint" in problems
    assert "table 'c' is in the checkpoint but not in the plan" in problems
    assert any("'sparse_arch" in p for p in checkpoint_problems(meta, plan, ""))


# --------------------------------------------------------------------------- the launcher


@pytest.mark.slow
@pytest.mark.parametrize(("marking", "clean"), [("0,1", True), ("0", False)])
def test_launcher_exit_status_after_sigterm(tmp_path: Path, marking: str, clean: bool) -> None:
    """torchrun exits 1 after a SIGTERM whatever its workers did; the launcher exits 0
    exactly when every local rank left a marker (stopped after checkpointing)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardwise.runtime.launch",
            "--standalone",
            "--nproc_per_node=2",
            str(HELPERS / "stop_worker.py"),
            str(tmp_path),
            marking,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    if clean:
        assert proc.returncode == 0, out
        assert "every rank stopped at step 7" in out
    else:
        assert proc.returncode != 0, out
        assert "only 1 rank(s) stopped cleanly" in out
