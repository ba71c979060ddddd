"""The cost-model artifact and its batched, cached inference (no training here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.costmodel import (
    CommNet,
    ComputeNet,
    CostModel,
    CostPredictor,
    artifact,
    load_bundled,
)
from shardwise.planner.plan import Plan, RankCost, Shard, Topology, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.evaluate import Evaluation

FINGERPRINT = {
    "device": "cpu:test",
    "device_type": "cpu",
    "cores": 2,
    "torch": "2.13.0+cpu",
    "fbgemm": "1.8.0+cpu",
    "python": "3.11.7",
}


@pytest.fixture
def model() -> CostModel:
    torch.manual_seed(0)
    return CostModel(
        ComputeNet(hidden=16),
        CommNet(hidden=16),
        {"fingerprint": FINGERPRINT, "created_at": "now", "code_version": "0.1.0"},
    )


def _sets(tables: list[TableSpec], n: int, seed: int = 0) -> list[list[tuple[TableSpec, int]]]:
    rng = np.random.default_rng(seed)
    return [
        [(tables[int(i)], tables[int(i)].dim) for i in rng.choice(len(tables), size=k)]
        for k in rng.integers(1, 8, size=n)
    ]


def test_save_load_round_trip_predicts_identically(model: CostModel, tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    model.save(path)
    loaded = CostModel.load(path)
    assert loaded.metadata == model.metadata
    tables = make_tables(20)
    sets = _sets(tables, 50)
    a, b = CostPredictor(model), CostPredictor(loaded)
    np.testing.assert_array_equal(a.compute(sets, 1024), b.compute(sets, 1024))
    dims, delays = [64, 0, 128, 12], [0.0, 0.01, 0.002, 0.0]
    for x, y in zip(a.comm(dims, delays), b.comm(dims, delays), strict=True):
        np.testing.assert_array_equal(x, y)
    # weights_only loading: the payload is plain data
    torch.load(path, weights_only=True)


def test_model_without_comm_round_trips(model: CostModel, tmp_path: Path) -> None:
    bare = dataclasses.replace(model, comm=None)
    bare.save(tmp_path / "m.pt")
    loaded = CostModel.load(tmp_path / "m.pt")
    assert loaded.comm is None
    with pytest.raises(UserError, match="no communication model"):
        CostPredictor(loaded).comm([4, 8], [0.0, 0.0])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_a_user_error(model: CostModel, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "m.pt"
    model.save(path)
    data = path.read_bytes()
    path.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"not a model" * 100, "empty": b""}[damage]
    )
    with pytest.raises(UserError, match=r"m\.pt"):
        CostModel.load(path)


def test_foreign_file_and_unknown_version(model: CostModel, tmp_path: Path) -> None:
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(UserError, match="not a Shardwise cost model"):
        CostModel.load(other)
    payload = model.to_payload()
    payload["format_version"] = 99
    future = tmp_path / "future.pt"
    torch.save(payload, future)
    with pytest.raises(UserError, match="format version 99"):
        CostModel.load(future)
    with pytest.raises(UserError, match="no such"):
        CostModel.load(tmp_path / "missing.pt")


def test_damaged_state_dict_is_a_user_error(model: CostModel, tmp_path: Path) -> None:
    payload = model.to_payload()
    del payload["compute"]["state_dict"]["head.0.weight"]
    path = tmp_path / "damaged.pt"
    torch.save(payload, path)
    with pytest.raises(UserError, match="damaged"):
        CostModel.load(path)


def test_missing_bundled_model_says_make_pretrain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(artifact, "BUNDLED_MODEL", tmp_path / "nope.pt")
    with pytest.raises(UserError, match="make pretrain"):
        load_bundled()


def test_compute_shapes_empty_sets_and_mixed_precision(model: CostModel) -> None:
    pred = CostPredictor(model)
    t32 = TableSpec(name="a", rows=1000, dim=16, pooling_factor=3.0)
    t16 = TableSpec(name="b", rows=5000, dim=32, pooling_factor=7.0, dtype="fp16")
    out = pred.compute([[], [(t32, 16)], [(t16, 32)], [(t32, 16), (t16, 32)]], 512)
    assert out.shape == (4, 2)
    assert (out[0] == 0).all()
    assert (out[1:] > 0).all()
    # one kernel per precision, summed, as the profiler measures a mixed rank
    np.testing.assert_allclose(out[3], out[1] + out[2], rtol=1e-6)
    # order of the set does not matter (the encodings are summed)
    np.testing.assert_allclose(pred.compute([[(t16, 32), (t32, 16)]], 512)[0], out[3], rtol=1e-6)
    assert pred.compute([], 512).shape == (0, 2)


def test_cache_hit_is_identical_and_skips_the_net(model: CostModel) -> None:
    pred = CostPredictor(model)
    sets = _sets(make_tables(30), 2000)
    first = pred.compute(sets, 2048)
    calls = pred.net_calls
    assert calls >= 1
    second = pred.compute(sets, 2048)
    np.testing.assert_array_equal(first, second)
    assert pred.net_calls == calls  # no network call on a hit (speed: the benchmark)
    # another batch size is another key
    pred.compute(sets[:3], 256)
    assert pred.net_calls > calls
    # cached results equal a cold predictor's, set by set
    fresh = CostPredictor(model)
    np.testing.assert_allclose(fresh.compute(sets[:5], 2048), first[:5], rtol=1e-6)
    pred.clear_cache()
    np.testing.assert_allclose(pred.compute(sets[:5], 2048), first[:5], rtol=1e-6)
    # a tiny cache that overflows mid-call still answers every set
    small = CostPredictor(model, max_cache=10)
    small.compute(sets[:8], 2048)
    np.testing.assert_allclose(small.compute(sets[:30], 2048), first[:30], rtol=1e-6)


def test_comm_any_world_size_and_cache(model: CostModel) -> None:
    pred = CostPredictor(model)
    for w in (2, 3, 8, 16, 32):
        dims = [4 * (i + 1) for i in range(w)]
        delays = [0.001 * i for i in range(w)]
        fwd, bwd = pred.comm(dims, delays)
        assert fwd.shape == bwd.shape == (w,)
        assert (fwd > 0).all() and (bwd > 0).all()
        # the forward includes the straggler wait
        assert (fwd >= max(delays) - np.asarray(delays) - 1e-12).all()
    calls = pred.net_calls
    pred.comm([4, 8], [0.0, 0.0])
    pred.comm([4, 8], [0.0, 0.0])
    assert pred.net_calls == calls + 1
    assert [a.tolist() for a in pred.comm([64], [0.0])] == [[0.0], [0.0]]


def _plan(tables: list[TableSpec], world: int) -> Plan:
    topo = Topology(gpus=world, gpu_memory_bytes=2**34, device="cpu")
    return table_wise_plan(tables, [i % world for i in range(len(tables))], topo, "test")


def test_predict_plan_has_the_evaluators_json_shape(model: CostModel) -> None:
    tables = make_tables(12)
    plan = _plan(tables, 4)
    prediction = CostPredictor(model).predict_plan(plan, tables, batch_size_per_rank=128)
    measured = Evaluation(
        plan_hash=plan.hash,
        planner=plan.planner,
        world_size=4,
        batch_size_per_rank=128,
        device="cpu",
        ranks=[RankCost(r, 1.0, 1.0, 1.0, 1.0) for r in range(4)],
        repeats=1,
        max_per_repeat=[4.0],
        allocator_mitigated=True,
    ).to_json()
    got = prediction.to_json()
    assert set(measured) <= set(got)
    assert [set(r) for r in got["ranks"]] == [set(r) for r in measured["ranks"]]  # type: ignore[attr-defined]
    assert got["world_size"] == 4 and got["plan_hash"] == plan.hash
    totals = [r.total_s for r in prediction.ranks]
    assert got["max_s"] == pytest.approx(max(totals))
    assert got["imbalance_max_over_mean"] == pytest.approx(max(totals) / np.mean(totals))
    predicted = prediction.predicted()
    assert predicted.per_rank_seconds == pytest.approx(totals)
    assert predicted.imbalance == pytest.approx(1 - np.mean(totals) / max(totals))


def test_predict_plan_matches_its_parts(model: CostModel) -> None:
    """Compute at the global batch; comm delays are the ranks' forward compute."""
    tables = make_tables(6)
    halves = [
        [
            Shard(rank=0, col_offset=0, cols=t.dim // 2),
            Shard(rank=1, col_offset=t.dim // 2, cols=t.dim // 2),
        ]
        for t in tables
    ]
    topology = Topology(gpus=2, gpu_memory_bytes=2**34, device="cpu")
    plan = Plan.from_shards(tables, halves, topology, "cw")
    pred = CostPredictor(model)
    got = pred.predict_plan(plan, tables, batch_size_per_rank=64)
    halves = [[(t, t.dim // 2) for t in tables]] * 2
    comp = CostPredictor(model).compute(halves, 128)
    assert got.ranks[0].fwd_compute_s == pytest.approx(comp[0, 0])
    dims = [sum(t.dim // 2 for t in tables)] * 2
    fwd, _ = CostPredictor(model).comm(dims, comp[:, 0].tolist(), 64)
    assert got.ranks[1].fwd_comm_s == pytest.approx(fwd[1])
    single = _plan(tables, 1)
    one = pred.predict_plan(single, tables)
    assert one.ranks[0].fwd_comm_s == 0.0 and one.world_size == 1


def test_predict_plan_refuses_a_plan_for_other_tables(model: CostModel) -> None:
    tables = make_tables(4)
    with pytest.raises(UserError, match="not in the plan"):
        CostPredictor(model).predict_plan(_plan(tables[:3], 2), tables)
