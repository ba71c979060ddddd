"""The cost-model artifact and its batched, cached inference (no training here)."""

from __future__ import annotations

import copy
import dataclasses
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_tables
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_cache_helpers import FINGERPRINT

from shardwise.basics import UserError
from shardwise.planner.costmodel import (
    CommNet,
    ComputeNet,
    CostModel,
    CostPredictor,
    artifact,
    load_bundled,
)
from shardwise.planner.plan import Plan, RankCost, Shard, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.evaluate import Evaluation


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


# --------------------------------------------------------------------------- checked whole
def _saved(payload: dict[str, Any], path: Path) -> Path:
    torch.save(payload, path)
    return path


@pytest.mark.parametrize(
    ("net", "key"),
    [("compute", "encoder.0.weight"), ("comm", "skip.bias"), ("compute", "skip.weight")],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_naming_file_and_tensor(
    model: CostModel, tmp_path: Path, net: str, key: str, bad: float
) -> None:
    payload = model.to_payload()
    payload[net]["state_dict"][key].view(-1)[0] = bad
    path = _saved(payload, tmp_path / "nan.pt")
    with pytest.raises(UserError) as caught:
        CostModel.load(path)
    message = str(caught.value)
    assert str(path) in message and f"{net}.state_dict[{key!r}]" in message
    assert "NaN or infinite" in message and "shardwise pretrain" in message


@pytest.mark.parametrize(
    ("net", "norm", "length"),
    [("compute", "table", 26), ("compute", "table", 1), ("compute", "set", 3), ("comm", "rank", 9)],
)
def test_normalizer_of_the_wrong_length_is_refused(
    model: CostModel, tmp_path: Path, net: str, norm: str, length: int
) -> None:
    """A normalizer of one value broadcasts over every feature and silently mis-scales
    every prediction; the loader counts them."""
    payload = model.to_payload()
    payload[net]["norm"][norm] = {"mean": [0.5] * length, "std": [2.0] * length}
    path = _saved(payload, tmp_path / "norm.pt")
    with pytest.raises(UserError, match=rf"{net}\.norm\.{norm}\.mean has {length} values"):
        CostModel.load(path)


@pytest.mark.parametrize(
    ("where", "value", "says"),
    [
        (("compute", "norm", "table", "std"), [0.0] * 27, "<= 0"),
        (("compute", "norm", "set", "mean"), [float("nan"), 0.0], "not a finite number"),
        (("compute", "config", "hidden"), 10**9, "not a whole number in 1..4096"),
        (("compute", "config", "hidden"), 8, "shape"),
        (("comm", "state_dict", "skip.weight"), torch.zeros(2, 10, dtype=torch.int64), "floats"),
        (("metadata",), ["not", "a", "mapping"], "metadata is a list"),
    ],
)
def test_damaged_fields_are_named(
    model: CostModel, tmp_path: Path, where: tuple[str, ...], value: Any, says: str
) -> None:
    payload = model.to_payload()
    node: Any = payload
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = _saved(payload, tmp_path / "m.pt")
    with pytest.raises(UserError, match="damaged cost model") as caught:
        CostModel.load(path)
    assert str(path) in str(caught.value) and says in str(caught.value)


def test_model_file_messages_say_what_and_how(model: CostModel, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    model.save(folder / "model.pt")
    with pytest.raises(UserError, match="is a directory.*give the model file inside it, e.g."):
        CostModel.load(folder)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"empty\.pt: the file is empty or truncated\. Re-create"):
        CostModel.load(tmp_path / "empty.pt")
    torch.save({"x": Fraction(1, 3)}, tmp_path / "objects.pt")  # a Python object
    with pytest.raises(UserError) as caught:
        CostModel.load(tmp_path / "objects.pt")
    message = str(caught.value)
    assert "not a Shardwise cost model" in message and "weights-only load refuses" in message
    assert "weights_only" not in message and "trust" not in message  # torch's advice


def test_every_prediction_must_be_finite(model: CostModel, tmp_path: Path) -> None:
    """Finite weights can still overflow (a normalizer std of 1e-38 makes a feature
    infinite): the predictor refuses NaN costs, naming the file, rather than let a
    search compare them (NaN compares false with everything)."""
    from shardwise.planner.base import PlannerOptions, run_planner
    from shardwise.planner.costmodel.features import Normalizer
    from shardwise.planner.neuroshard import NeuroShardPlanner

    model.compute.set_norm = Normalizer([0.0, 0.0], [1e-38, 1e-38])
    model.save(tmp_path / "overflow.pt")
    loaded = CostModel.load(tmp_path / "overflow.pt")  # nothing wrong to see in the file
    tables = make_tables(8)
    with pytest.raises(UserError, match=r"overflow\.pt predicted a NaN or infinite compute"):
        CostPredictor(loaded).compute([[(tables[0], tables[0].dim)]], 128)
    topology = Topology(gpus=2, gpu_memory_bytes=2**34)
    planner = NeuroShardPlanner(PlannerOptions(predictor=CostPredictor(loaded)))
    with np.errstate(all="ignore"), pytest.raises(UserError, match=r"overflow\.pt"):
        run_planner(planner, tables, topology)
    comm = dataclasses.replace(model, compute=ComputeNet(hidden=16))
    assert comm.comm is not None
    comm.comm.rank_norm = Normalizer([0.0] * 10, [1e-38] * 10)
    with pytest.raises(UserError, match="NaN or infinite all-to-all"):
        CostPredictor(comm).comm([16, 32], [0.0, 0.001])
    with pytest.raises(UserError, match="NaN or infinite all-to-all"):
        CostPredictor(comm).comm_many(np.array([[16.0, 32.0]]), np.array([[0.0, 0.001]]))


def test_save_to_an_unwritable_place_is_a_user_error(model: CostModel, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write the cost model there"):
        model.save(tmp_path / "file" / "m.pt")


# --------------------------------------------------------------------------- property: any file
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=30),
    st.builds(
        lambda shape, dtype, fill: torch.full(shape, fill).to(dtype),
        st.lists(st.integers(0, 20), min_size=0, max_size=3),
        st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]),
        st.floats(allow_nan=True, allow_infinity=True, width=16),
    ),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a payload's dicts (the places a fuzzer may damage)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    return out


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.slow
def test_any_damaged_payload_loads_whole_or_is_a_user_error_naming_the_file(
    model: CostModel, tmp_path: Path, data: st.DataObject
) -> None:
    """docs/design.md §7: loaded weights-only and validated. Whatever a file holds, the
    loader gives a model whose predictions are finite, or a UserError naming the file."""
    payload = copy.deepcopy(model.to_payload())  # the metadata is the fixture's own dict
    for _ in range(data.draw(st.integers(1, 3), label="damages")):
        where = data.draw(st.sampled_from(_paths(payload)), label="where")
        node: Any = payload
        for key in where[:-1]:
            node = node[key]
        if data.draw(st.booleans(), label="delete"):
            del node[where[-1]]
        else:
            node[where[-1]] = data.draw(_LEAVES, label="value")
    path = tmp_path / "fuzzed.pt"
    torch.save(payload, path)
    _loads_or_names(path)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.floats(0.0, 1.0), junk=st.binary(max_size=64), flip=st.integers(0, 10**6))
def test_any_damaged_file_loads_or_is_a_user_error_naming_it(
    model: CostModel, tmp_path: Path, cut: float, junk: bytes, flip: int
) -> None:
    path = tmp_path / "bytes.pt"
    model.save(path)
    data = bytearray(path.read_bytes())
    data = data[: int(len(data) * cut)] + junk
    if data:
        data[flip % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))
    _loads_or_names(path)


def _loads_or_names(path: Path) -> None:
    try:
        loaded = CostModel.load(path)
    except UserError as err:
        assert str(path) in str(err)
        return
    tables = make_tables(4)
    try:
        secs = CostPredictor(loaded).compute([[(t, t.dim)] for t in tables], 256)
        assert np.isfinite(secs).all()
        if loaded.comm is not None:
            fwd, bwd = CostPredictor(loaded).comm([16, 32, 0], [0.0, 0.001, 0.0])
            assert np.isfinite(fwd).all() and np.isfinite(bwd).all()
    except UserError as err:
        assert str(path) in str(err)
