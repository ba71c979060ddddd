"""Tables no GPU holds whole: placed row-wise by every planner, or refused with the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import shardwise
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.base import PlannerOptions, check_capacity, run_planner
from shardwise.planner.costmodel import CostPredictor, load_bundled
from shardwise.planner.memory import table_bytes
from shardwise.planner.neuroshard import NeuroShardPlanner, SearchConfig
from shardwise.planner.oversized import gpus_to_fit_row_wise, place_oversized
from shardwise.planner.registry import get_planner
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import torchrec_problems

GiB = 2**30
#: 1 GiB GPUs at 256 per rank: 3e7 rows x 16 fp32 (1.8 GiB of weights) fits no GPU whole.
BIG = TableSpec(name="big", rows=30_000_000, dim=16, pooling_factor=4.0)
TOPO = Topology(gpus=4, gpu_memory_bytes=GiB, batch_size_per_rank=256)


def test_one_host_places_it_row_wise_over_every_gpu() -> None:
    assert table_bytes(BIG, TOPO) > TOPO.usable_bytes
    fixed = place_oversized([*make_tables(3), BIG], TOPO)
    (placed,) = fixed.placed
    assert (placed.index, placed.kind) == (3, "row_wise")
    assert [s.rank for s in placed.shards] == [0, 1, 2, 3]
    assert [s.rows for s in placed.shards] == [7_500_000] * 4
    assert all(0 < used <= TOPO.usable_bytes for used in fixed.memory)


def test_hosts_keep_it_on_one_host_when_the_host_holds_it() -> None:
    topo = TOPO.model_copy(update={"gpus": 8, "gpus_per_host": 4})
    two = [BIG, BIG.model_copy(update={"name": "big2"})]
    fixed = place_oversized(two, topo)
    assert [p.kind for p in fixed.placed] == ["table_row_wise", "table_row_wise"]
    # Each on its own host: the second goes where the first left room.
    assert [sorted(s.rank for s in p.shards) for p in fixed.placed] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_host_too_small_falls_back_to_every_gpu() -> None:
    topo = TOPO.model_copy(update={"gpus": 8, "gpus_per_host": 2})
    (placed,) = place_oversized([BIG], topo).placed
    assert placed.kind == "row_wise" and len(placed.shards) == 8


@pytest.mark.parametrize(
    "name", ["random", "size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy"]
)
def test_every_greedy_planner_places_it(name: str) -> None:
    tables = [*make_tables(12), BIG]
    plan = get_planner(name).plan(tables, TOPO)
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    kinds = {t.name: t.kind for t in plan.tables}
    assert kinds.pop("big") == "row_wise"
    assert set(kinds.values()) == {"table_wise"}


@pytest.mark.parametrize(
    ("topo", "kind"),
    [
        (TOPO, "row_wise"),
        (TOPO.model_copy(update={"gpus": 8, "gpus_per_host": 4}), "table_row_wise"),
    ],
)
def test_neuroshard_searches_around_it_and_prices_it(topo: Topology, kind: str) -> None:
    tables = [*make_tables(12), BIG]
    predictor = CostPredictor(load_bundled())
    planner = NeuroShardPlanner(
        PlannerOptions(predictor=predictor),
        SearchConfig(beam_width=2, beam_steps=2, baselines=False),  # the search itself
    )
    run = run_planner(planner, tables, topo, predictor)
    plan = run.plan
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    big = next(t for t in plan.tables if t.name == "big")
    assert big.kind == kind
    assert plan.predicted is not None
    # Every rank pays for its row range: its own kernel at the global batch.
    prediction = predictor.predict_plan(plan, tables)
    # The search priced the plan as the predictor prices any plan.
    assert plan.predicted.per_rank_seconds == pytest.approx(
        [r.total_s for r in prediction.ranks], rel=1e-5
    )
    without = plan.model_copy(
        update={"tables": [t for t in plan.tables if t.name != "big"]}
    ).with_hash()
    bare = predictor.predict_plan(without, tables[:-1])
    holding = {s.rank for s in big.shards}
    for rank, (with_big, alone) in enumerate(zip(prediction.ranks, bare.ranks, strict=True)):
        if rank in holding:
            assert with_big.fwd_compute_s + with_big.bwd_compute_s > (
                alone.fwd_compute_s + alone.bwd_compute_s
            )
            # Its all-gather (the forward's comm also holds the straggler wait).
            assert with_big.bwd_comm_s > alone.bwd_comm_s


def test_too_big_even_row_wise_names_the_figures_and_what_would_fit() -> None:
    huge = TableSpec(name="huge", rows=400_000_000, dim=16, pooling_factor=4.0)
    with pytest.raises(UserError) as err:
        check_capacity([huge], TOPO)
    text = str(err.value)
    assert "table huge" in text and "even row-wise over all 4 GPUs" in text
    assert "What would fit: GPUs of" in text
    gpus = gpus_to_fit_row_wise(huge, TOPO)
    assert gpus is not None and f"or {gpus} GPUs (--gpus)" in text
    # The figure is right: that many GPUs hold it, one fewer does not.
    for planner in ("size-greedy", "neuroshard"):
        with pytest.raises(UserError, match="even row-wise"):
            get_planner(planner).plan([huge], TOPO)
    fits = TOPO.model_copy(update={"gpus": gpus})
    assert place_oversized([huge], fits).placed[0].kind == "row_wise"
    with pytest.raises(UserError):
        place_oversized([huge], TOPO.model_copy(update={"gpus": gpus - 1}))


def test_more_gpus_stop_helping_when_outputs_dominate() -> None:
    # Each GPU adds its samples to every row shard's outputs: at 4 MiB of outputs per GPU
    # on 1 GiB GPUs, no count of GPUs holds a table whose rows alone need 4 GiB spread.
    wide = TableSpec(name="wide", rows=1_000_000_000, dim=256, pooling_factor=1.0)
    assert gpus_to_fit_row_wise(wide, TOPO.model_copy(update={"batch_size_per_rank": 4096})) is None


def test_plan_cli_shows_the_kinds(tmp_path: Path) -> None:
    save_tables([*make_tables(6), BIG], tmp_path / "t.yaml")
    ran = shardwise(
        "plan",
        tmp_path / "t.yaml",
        "--gpus",
        "4",
        "--gpu-memory",
        "1GiB",
        "--batch-per-rank",
        "256",
        "--planner",
        "size-greedy",
        "--out",
        tmp_path / "plan.json",
        "--plot",
        tmp_path / "plan.png",
    )
    assert ran.code == 0, ran.stderr
    assert "big: row-wise over 4 ranks" in " ".join(ran.stdout.split())
    assert "RW 1" in ran.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["version"] == 2
    assert next(t for t in doc["tables"] if t["name"] == "big")["kind"] == "row_wise"
    assert (tmp_path / "plan.png").stat().st_size > 0
    bad = shardwise("plan", tmp_path / "t.yaml", "--gpus", "6", "--gpus-per-host", "4")
    assert bad.code == 2 and "whole number of hosts" in bad.stderr
