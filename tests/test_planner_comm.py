"""The comm models (docs/comm.md): α–β arithmetic, presets, fitting, choosing, and the
predictor's use of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_tables

import shardwise.planner.comm.choice as choice
import shardwise.planner.comm.model as comm
from shardwise.basics import UserError
from shardwise.planner.comm.choice import honest_comm_measurement, resolve_comm
from shardwise.planner.comm.fit import fit_alpha_beta, load_comm_records
from shardwise.planner.comm.model import (
    PRESETS,
    AlphaBetaComm,
    LearnedComm,
    MeasuredComm,
    exchange_bytes,
)
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.costmodel.artifact import load_bundled
from shardwise.planner.plan import table_wise_plan
from shardwise.planner.topology import Topology

AB = AlphaBetaComm(name="test", alpha_s=1e-3, bytes_per_s=1e6, source="made up")


def test_alpha_beta_prices_the_largest_exchange_and_adds_the_straggler_wait() -> None:
    # W=2, batch 100: rank 0 sends 100·64·4 B and receives 100·128·4 B; rank 1 the other
    # way round; the larger, 51,200 B at 1 MB/s, plus α 1 ms, for every rank.
    fwd, bwd = AB.one([64, 128], [0.010, 0.004], 100)
    assert bwd.tolist() == pytest.approx([0.0522, 0.0522])
    assert fwd.tolist() == pytest.approx([0.0522, 0.0522 + 0.006])  # rank 1 waits 6 ms
    # W=3: rank 0 sends 2 × its 40 columns, receives 20 + 60; rank 2 sends 2 × 60.
    assert exchange_bytes(np.array([[40.0, 20.0, 60.0]]), 1).tolist() == [2 * 60 * 4]


def test_alpha_beta_batches_agree_with_one_and_one_rank_costs_nothing() -> None:
    rng = np.random.default_rng(0)
    dims = rng.integers(0, 64, size=(5, 4)).astype(np.float64) * 4
    delays = rng.random((5, 4)) * 1e-3
    fwd, bwd = AB.all_to_all(dims, delays, 32)
    for m in range(5):
        f1, b1 = AB.one(dims[m].astype(int).tolist(), delays[m].tolist(), 32)
        assert f1 == pytest.approx(fwd[m]) and b1 == pytest.approx(bwd[m])
    alone = AB.all_to_all(np.array([[128.0]]), np.array([[0.5]]), 32)
    assert [a.tolist() for a in alone] == [[[0.0]], [[0.0]]]


def test_a_more_even_placement_exchanges_less() -> None:
    """The model sees placement: moving width off the widest rank shortens the exchange."""
    lopsided = AB.one([256, 32, 32, 32], [0.0] * 4, 128)[1][0]
    even = AB.one([96, 96, 80, 80], [0.0] * 4, 128)[1][0]
    assert even < lopsided


def test_presets_cover_the_interconnect_classes_with_their_sources() -> None:
    assert {"nvlink", "infiniband", "pcie", "ethernet"} <= set(PRESETS)
    for name, p in PRESETS.items():
        assert p.name == name and p.kind == "modelled"
        assert len(p.source) > 80 and p.label
        line = p.describe()
        assert line.startswith(f"modelled: {name} preset (") and "GB/s per GPU" in line
    fast, slow = PRESETS["nvlink"], PRESETS["ethernet"]
    assert fast.one([512, 512], [0, 0], 4096)[1][0] < slow.one([512, 512], [0, 0], 4096)[1][0]
    with pytest.raises(UserError, match="β must be > 0"):
        AlphaBetaComm(name="x", alpha_s=0.0, bytes_per_s=0.0, source="")


def _records(alpha: float, beta: float, noise: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    """Comm records as `shardwise profile comm` writes them, timed by α + bytes/β."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(30):
        w = int(rng.choice([2, 4, 8]))
        dims = (rng.integers(1, 64, size=w) * 4).tolist()
        delays = (rng.random(w) * 0.01).tolist()
        t = AlphaBetaComm("truth", alpha, beta, "").one(dims, delays, 128)
        jitter = 1 + noise * rng.standard_normal(w)
        out.append(
            {
                "index": i,
                "batch_size": 128,
                "world_size": w,
                "dims": dims,
                "delays_s": delays,
                "fwd_s": (t[0] * jitter).tolist(),
                "bwd_s": (t[1] * jitter).tolist(),
            }
        )
    return out


def test_fit_recovers_alpha_and_beta_despite_the_straggler_wait() -> None:
    got = fit_alpha_beta(_records(2e-4, 3e9), "synthetic")
    assert got.name == "fitted" and got.kind == "modelled"
    assert got.alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert got.bytes_per_s == pytest.approx(3e9, rel=1e-6)
    noisy = fit_alpha_beta(_records(2e-4, 3e9, noise=0.05), "noisy")
    assert noisy.bytes_per_s == pytest.approx(3e9, rel=0.15)
    assert "30 records, W 2–8" in noisy.describe() and "median error" in noisy.describe()


def test_fit_refuses_what_shows_no_bandwidth() -> None:
    one_size = [dict(r, dims=[64, 64], world_size=2) for r in _records(1e-4, 1e9)[:3]]
    for r in one_size:
        r["delays_s"], r["fwd_s"], r["bwd_s"] = [0.0, 0.0], [1e-3, 1e-3], [1e-3, 1e-3]
    with pytest.raises(UserError, match="at least 2 sizes"):
        fit_alpha_beta(one_size, "tiny")
    shrinking = _records(1e-3, 1e9)
    for r in shrinking:  # bigger exchanges faster: no bandwidth in that
        size = float(exchange_bytes(np.array([r["dims"]], dtype=float), 128)[0])
        r["bwd_s"] = [1.0 / size] * r["world_size"]
        r["fwd_s"] = np.array(r["bwd_s"]) + comm.straggler_wait(np.array([r["delays_s"]]))[0]
        r["fwd_s"] = r["fwd_s"].tolist()
    with pytest.raises(UserError, match="do not grow with the bytes"):
        fit_alpha_beta(shrinking, "odd")
    with pytest.raises(UserError, match="record 0: a comm record needs"):
        fit_alpha_beta([{"index": 0, "dims": [4, 4]}], "broken")


def _dataset(directory: Path, records: list[dict[str, Any]], kind: str = "comm") -> Path:
    directory.mkdir()
    (directory / "dataset.json").write_text(json.dumps({"kind": kind}))
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (directory / "records.jsonl").write_text(lines + '{"index": 99, "torn')
    return directory


def test_fitted_reads_a_comm_dataset(tmp_path: Path) -> None:
    d = _dataset(tmp_path / "comm", _records(5e-5, 2e10))
    assert len(load_comm_records(d)) == 30  # the torn last line is skipped
    got = resolve_comm(f"fitted:{d}", world=4, device="cpu", predictor=None, measuring=True)
    assert isinstance(got, AlphaBetaComm) and got.bytes_per_s == pytest.approx(2e10, rel=1e-6)
    assert str(d) in got.describe()
    other = _dataset(tmp_path / "compute", [], kind="compute")
    with pytest.raises(UserError, match="is a 'compute' dataset"):
        resolve_comm(f"fitted:{other}", world=4, device="cpu", predictor=None, measuring=True)
    with pytest.raises(UserError, match="not a readable comm dataset"):
        load_comm_records(tmp_path / "missing")


def _hardware(monkeypatch: pytest.MonkeyPatch, cores: int, gpus: int) -> None:
    monkeypatch.setattr(choice.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.setattr(choice, "_cuda_count", lambda: gpus)


def test_honest_measurement_needs_a_core_or_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _hardware(monkeypatch, cores=2, gpus=0)
    assert honest_comm_measurement(2, None) is None
    why = honest_comm_measurement(8, None)
    assert why is not None and "8 ranks but 2 CPU core(s)" in why and "scheduler" in why
    _hardware(monkeypatch, cores=2, gpus=8)
    assert honest_comm_measurement(8, None) is None
    assert honest_comm_measurement(8, "cpu") is not None  # the GPUs are not used


def test_auto_measures_or_learns_where_honest_else_declares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pred = CostPredictor(load_bundled())
    _hardware(monkeypatch, cores=16, gpus=0)
    measured = resolve_comm("auto", world=8, device=None, predictor=pred, measuring=True)
    assert isinstance(measured, MeasuredComm) and measured.describe().startswith("auto → meas")
    learned = resolve_comm("auto", world=8, device=None, predictor=pred, measuring=False)
    assert isinstance(learned, LearnedComm) and learned.predictor is pred
    no_model = resolve_comm("auto", world=8, device=None, predictor=None, measuring=False)
    assert isinstance(no_model, AlphaBetaComm) and no_model.name == "nvlink"
    _hardware(monkeypatch, cores=2, gpus=0)
    small = resolve_comm("auto", world=8, device=None, predictor=pred, measuring=True)
    big = resolve_comm("auto", world=16, device=None, predictor=pred, measuring=False)
    assert (small.name, big.name) == ("nvlink", "hgx-h100")  # hosts of 8 above 8 GPUs
    assert small.describe().startswith("auto → modelled: nvlink preset")
    assert "8 gloo processes on 2 core(s)" in small.describe()
    assert PRESETS["nvlink"].auto_reason is None  # the preset itself is untouched
    forced = resolve_comm("measured", world=8, device=None, predictor=None, measuring=True)
    assert "NOT honest here" in forced.describe()


def test_explicit_values_and_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    pred = CostPredictor(load_bundled())
    args: dict[str, Any] = {"world": 4, "device": None, "predictor": pred, "measuring": False}
    assert resolve_comm("pcie", **args) is PRESETS["pcie"]
    assert resolve_comm("InfiniBand", **args) is PRESETS["infiniband"]
    assert isinstance(resolve_comm("model", **args), LearnedComm)
    with pytest.raises(UserError, match="only the evaluator measures"):
        resolve_comm("measured", **args)
    with pytest.raises(UserError, match="no cost model is at hand"):
        resolve_comm("model", **{**args, "predictor": None})
    with pytest.raises(UserError) as bad:
        resolve_comm("nvlinc", **args)
    for word in ("'nvlinc'", "auto", "measured", "model", "fitted:DIR", "alpha-beta:", *PRESETS):
        assert word in str(bad.value)
    with pytest.raises(UserError, match="only the evaluator measures"):
        MeasuredComm().one([4, 4], [0.0, 0.0], 8)
    own = resolve_comm("alpha-beta:30,6.25", **args)
    assert isinstance(own, AlphaBetaComm)
    assert (own.alpha_s, own.bytes_per_s) == pytest.approx((30e-6, 6.25e9))
    assert own.describe() == "modelled: alpha-beta:30,6.25 (declared; α 30 µs, 6.25 GB/s per GPU)"
    for bad_value in ("alpha-beta:30", "alpha-beta:x,1", "alpha-beta:30,0"):
        with pytest.raises(UserError, match="alpha-beta"):
            resolve_comm(bad_value, **args)


def test_learned_comm_is_the_predictors_network() -> None:
    pred = CostPredictor(load_bundled())
    learned = pred.comm_model
    assert isinstance(learned, LearnedComm) and learned.kind == "learned"
    dims = np.array([[16.0, 32.0, 64.0], [64.0, 64.0, 0.0]])
    delays = np.array([[0.0, 1e-3, 2e-3], [0.0, 0.0, 0.0]])
    fwd, bwd = learned.all_to_all(dims, delays, 128)
    want_f, want_b = pred.comm_many(dims, delays, 128)
    assert fwd.tolist() == want_f.tolist() and bwd.tolist() == want_b.tolist()
    assert learned.one([16, 32, 64], [0.0, 1e-3, 2e-3], 128)[0] == pytest.approx(fwd[0])
    assert learned.describe().startswith("learned: the cost model's all-to-all network")


def test_predict_plan_uses_the_comm_model_at_the_jobs_batch() -> None:
    tables = make_tables(6)
    topo = Topology(gpus=2, gpu_memory_bytes=2**34, device="cpu", batch_size_per_rank=32)
    plan = table_wise_plan(tables, [0, 0, 0, 0, 1, 1], topo, "test")
    model = load_bundled()
    declared = CostPredictor(model, PRESETS["ethernet"]).predict_plan(plan, tables)
    assert declared.batch_size_per_rank == 32  # the job's batch, not a default
    comp = CostPredictor(model).compute(
        [[(t, t.dim) for t in tables[:4]], [(t, t.dim) for t in tables[4:]]], 64
    )
    dims = [sum(t.dim for t in tables[:4]), sum(t.dim for t in tables[4:])]
    fwd, bwd = PRESETS["ethernet"].one(dims, comp[:, 0].tolist(), 32)
    assert [r.fwd_comm_s for r in declared.ranks] == pytest.approx(fwd.tolist())
    assert [r.bwd_comm_s for r in declared.ranks] == pytest.approx(bwd.tolist())
    assert declared.comm == PRESETS["ethernet"].describe()
    assert declared.to_json()["comm"] == declared.comm
    learned = CostPredictor(model).predict_plan(plan, tables, 32)
    assert learned.comm.startswith("learned:")
    assert [r.fwd_compute_s for r in learned.ranks] == [r.fwd_compute_s for r in declared.ranks]
    assert [r.bwd_comm_s for r in learned.ranks] != [r.bwd_comm_s for r in declared.ranks]
