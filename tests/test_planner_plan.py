"""plan.json: validation rules of docs/design.md §5, the content hash, and file round trips."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.plan import (
    NO_HASH,
    InvalidPlanError,
    NonFiniteCostError,
    Plan,
    PlanTable,
    Predicted,
    Shard,
    imbalance,
    load_plan,
    save_plan,
)
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

TOPO = Topology(gpus=4, gpu_memory_bytes=2**30)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Random valid plans: each table's width cut into random 4-aligned pieces."""
    gpus = draw(st.integers(1, 8))
    tables = []
    for i in range(draw(st.integers(1, 10))):
        dim = 4 * draw(st.integers(1, 32))
        cuts = sorted(draw(st.sets(st.integers(1, dim // 4 - 1), max_size=3))) if dim > 4 else []
        edges = [0, *(4 * c for c in cuts), dim]
        shards = [
            Shard(rank=draw(st.integers(0, gpus - 1)), col_offset=a, cols=b - a)
            for a, b in itertools.pairwise(edges)
        ]
        tables.append(
            PlanTable(
                name=f"t{i}",
                rows=draw(st.integers(1, 1000)),
                dim=dim,
                shards=draw(st.permutations(shards)),
            )
        )
    return Plan(
        world_size=gpus,
        planner="test",
        tables=tables,
        topology=Topology(gpus=gpus, gpu_memory_bytes=2**30),
    ).with_hash()


@settings(max_examples=100, deadline=None)
@given(plan=plans())
def test_valid_plans_pass_and_round_trip(plan: Plan) -> None:
    assert plan.problems() == []
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan and again.content_hash() == plan.hash


@settings(max_examples=100, deadline=None)
@given(plan=plans(), data=st.data())
def test_any_broken_rule_is_caught(plan: Plan, data: st.DataObject) -> None:
    t = data.draw(st.sampled_from(plan.tables))
    s = data.draw(st.sampled_from(t.shards))
    breakage = data.draw(st.sampled_from(["drop", "overlap", "misalign", "rank", "memory"]))
    others = [x for x in t.shards if x is not s]
    if breakage == "drop":
        t.shards = others or [Shard(rank=s.rank, col_offset=0, cols=max(4, s.cols - 4))]
        if t.shards[0].cols == t.dim:  # a one-shard 4-wide table: make it too narrow
            t.dim += 4
    elif breakage == "overlap":
        t.shards = [*others, s, Shard(rank=s.rank, col_offset=s.col_offset, cols=4)]
    elif breakage == "misalign":
        t.shards = [*others, Shard(rank=s.rank, col_offset=s.col_offset, cols=s.cols + 2)]
        t.dim += 2
    elif breakage == "rank":
        t.shards = [*others, Shard(rank=plan.world_size, col_offset=s.col_offset, cols=s.cols)]
    else:
        t.rows = plan.topology.usable_bytes // (4 * s.cols) + 1
    assert plan.problems(), breakage


def test_messages_name_the_table_and_numbers() -> None:
    plan = Plan(
        world_size=4,
        planner="x",
        topology=TOPO,
        tables=[
            PlanTable(
                name="big", rows=2**30 // 256, dim=64, shards=[Shard(rank=1, col_offset=0, cols=64)]
            ),
            PlanTable(name="gap", rows=10, dim=16, shards=[Shard(rank=0, col_offset=8, cols=8)]),
        ],
    )
    problems = "\n".join(plan.problems())
    # Without the specs the pooling is unknown: weights + optimizer state, a lower bound.
    assert "rank 1 needs at least 1.0 GiB (weights 1.0 GiB + optimizer 16.0 MiB" in problems
    assert "870.4 MiB after a 15% reserve" in problems
    assert "GPUs of 1.2 GiB would fit it" in problems and "batch" not in problems
    assert "table 'gap': columns 0..7 are not placed" in problems
    with pytest.raises(UserError, match="not a valid plan"):
        plan.validate_plan()


def test_hash_is_about_placement_only() -> None:
    a = Plan(
        world_size=4,
        planner="a",
        topology=TOPO,
        tables=[
            PlanTable(
                name="x",
                rows=10,
                dim=8,
                shards=[Shard(rank=0, col_offset=0, cols=4), Shard(rank=1, col_offset=4, cols=4)],
            ),
            PlanTable(name="y", rows=10, dim=4, shards=[Shard(rank=2, col_offset=0, cols=4)]),
        ],
    )
    b = a.model_copy(deep=True, update={"planner": "b"})
    b.tables.reverse()
    b.tables[1].shards.reverse()
    assert a.content_hash() == b.content_hash()
    b.tables[0].shards = [Shard(rank=3, col_offset=0, cols=4)]
    assert a.content_hash() != b.content_hash()
    edited = a.with_hash()
    edited.tables[1].shards = [Shard(rank=3, col_offset=0, cols=4)]
    assert any("hash does not match" in p for p in edited.problems())


def test_against_table_specs(tables20: list) -> None:  # type: ignore[type-arg]
    from shardwise.planner.plan import table_wise_plan

    plan = table_wise_plan(tables20[:5], [0, 1, 2, 3, 0], TOPO, "manual")
    assert plan.problems(tables20[:5]) == []
    problems = plan.problems(tables20[1:6])
    assert "table 't5' is not in the plan" in problems
    assert "table 't0' is in the plan but not in the tables" in problems


def test_files_and_bad_json(tmp_path: Path) -> None:
    plan = Plan(
        world_size=1,
        planner="x",
        topology=Topology(gpus=1, gpu_memory_bytes=2**30),
        tables=[PlanTable(name="x", rows=1, dim=4, shards=[Shard(rank=0, col_offset=0, cols=4)])],
    ).with_hash()
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["version"] = 3
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="version: Input should be 1 or 2"):
        load_plan(tmp_path / "p.json")
    with pytest.raises(UserError, match="no such plan file"):
        load_plan(tmp_path / "nope.json")


def test_imbalance() -> None:
    assert imbalance([1.0, 1.0]) == 0.0
    assert imbalance([2.0, 0.0]) == pytest.approx(0.5)
    assert imbalance([0.0, 0.0]) == 0.0


def test_from_shards_builds_the_hashed_plan(tables20: list) -> None:  # type: ignore[type-arg]
    """Every planner's plan is built by Plan.from_shards: same fields, hashed, priced."""
    specs = tables20[:2]
    shards = [
        [Shard(rank=0, col_offset=0, cols=specs[0].dim)],
        [Shard(rank=1, col_offset=0, cols=4), Shard(rank=2, col_offset=4, cols=specs[1].dim - 4)],
    ]
    plan = Plan.from_shards(specs, shards, TOPO, "manual", predicted=[1.0, 2.0, 0.0, 0.0])
    by_hand = Plan(
        world_size=TOPO.gpus,
        planner="manual",
        topology=TOPO,
        tables=[
            PlanTable(name=t.name, rows=t.rows, dim=t.dim, dtype=t.dtype, shards=s)
            for t, s in zip(specs, shards, strict=True)
        ],
        predicted=Predicted.from_costs([1.0, 2.0, 0.0, 0.0]),
    ).with_hash()
    assert plan == by_hand
    assert plan.hash == plan.content_hash() and plan.problems(specs) == []
    assert Plan.from_shards(specs, shards, TOPO, "other").hash == plan.hash


def test_invalid_plans_raise_a_user_error_of_their_own() -> None:
    plan = Plan(
        world_size=2,
        planner="x",
        topology=Topology(gpus=1, gpu_memory_bytes=2**30),
        tables=[PlanTable(name="x", rows=1, dim=4, shards=[Shard(rank=0, col_offset=0, cols=4)])],
    )
    with pytest.raises(InvalidPlanError, match="world_size is 2") as caught:
        plan.validate_plan(source="this plan")
    assert isinstance(caught.value, UserError)


# --------------------------------------------------------------------------- the hash rule
def test_a_plan_read_from_a_file_must_carry_its_hash() -> None:
    """One rule for `shardwise evaluate` and the workers (docs/design.md §5): both ask
    Plan.problems(require_hash=True); a plan still being built may lack it."""
    from shardwise.runtime.plancheck import plan_problems

    plan = Plan(
        world_size=1,
        planner="x",
        topology=Topology(gpus=1, gpu_memory_bytes=2**30),
        tables=[PlanTable(name="x", rows=1, dim=4, shards=[Shard(rank=0, col_offset=0, cols=4)])],
    )
    assert plan.problems() == []
    assert plan.problems(require_hash=True) == [NO_HASH]
    with pytest.raises(
        InvalidPlanError, match="p.json is not a valid plan:\n- the plan has no hash"
    ):
        plan.validate_plan(source="p.json", require_hash=True)
    assert plan_problems(plan, [], 1).count(NO_HASH) == 1  # the runtime: the same sentence once
    assert plan.with_hash().problems(require_hash=True) == []


# --------------------------------------------------------------------------- costs and bounds
def test_predicted_costs_are_finite() -> None:
    with pytest.raises(NonFiniteCostError, match="not finite costs"):
        Predicted.from_costs([0.001, float("nan")])
    assert isinstance(NonFiniteCostError("x"), UserError)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        (("predicted", "per_rank_seconds", 0), float("nan"), "finite number"),
        (("predicted", "max_seconds"), float("inf"), "finite number"),
        (("world_size",), 10**9, "less than or equal to 65536"),
        (("topology", "gpu_memory_bytes"), 10**400, "less than or equal to"),
        (("tables", 0, "rows"), 2**41, "less than or equal to 1099511627776"),
    ],
)
def test_extreme_values_are_named_on_load(
    tmp_path: Path, field: tuple[str | int, ...], value: float, says: str
) -> None:
    doc = json.loads(_valid(tmp_path).read_text())
    node = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    path = tmp_path / "extreme.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError) as caught:
        load_plan(path)
    message = str(caught.value)
    assert str(path) in message and says in message
    assert ".".join(map(str, field)) in message


def _valid(tmp_path: Path) -> Path:
    plan = Plan.from_shards(
        [TableSpec(name="a", rows=100, dim=8, pooling_factor=1.0)],
        [[Shard(rank=0, col_offset=0, cols=4), Shard(rank=1, col_offset=4, cols=4)]],
        Topology(gpus=2, gpu_memory_bytes=2**30),
        "x",
        predicted=[0.001, 0.002],
    )
    save_plan(plan, tmp_path / "valid.json")
    return tmp_path / "valid.json"


def test_save_plan_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed write leaves the old plan whole (a worker may be reading it) and says so."""
    path = _valid(tmp_path)
    before = path.read_text()
    plan = load_plan(path).model_copy(update={"planner": "other"})

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shardwise.basics.os.replace", full_disk)
    with pytest.raises(UserError, match="valid.json: cannot write the plan there"):
        save_plan(plan, path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["valid.json"]  # no temporary left


# --------------------------------------------------------------------------- property: any text
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _places(node: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _places(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _places(v, (*prefix, i))
    return out


def _reads_or_names(path: Path) -> None:
    """A valid Plan (with its problems listed) or a UserError naming the file: nothing else."""
    try:
        plan = load_plan(path)
        plan.problems(require_hash=True)
        plan.validate_plan(source=str(path), require_hash=True)
    except UserError as err:
        assert str(path) in str(err)


@settings(max_examples=200, deadline=None)
@given(plan=plans(), data=st.data())
@pytest.mark.slow
def test_any_damaged_plan_file_reads_or_is_a_user_error_naming_it(
    plan: Plan, data: st.DataObject
) -> None:
    import tempfile

    doc = json.loads(plan.model_dump_json())
    for _ in range(data.draw(st.integers(1, 3), label="damages")):
        where = data.draw(st.sampled_from(_places(doc)), label="where")
        node: Any = doc
        for key in where[:-1]:
            node = node[key]
        if data.draw(st.booleans(), label="delete") and isinstance(node, dict):
            del node[where[-1]]
        else:
            node[where[-1]] = data.draw(_JSON, label="value")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(json.dumps(doc))
        _reads_or_names(path)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=200), _JSON.map(json.dumps), st.binary(max_size=100)))
def test_any_text_reads_or_is_a_user_error_naming_the_file(text: str | bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _reads_or_names(path)
