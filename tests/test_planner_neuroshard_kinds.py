"""NeuroShard chooses every table's kind: the runnable choices, their shards, and the
search over them (row-wise, table-row-wise, data-parallel beside the fused kinds)."""

from __future__ import annotations

import pytest

from shardwise.planner.kinds import FUSED, KindOption, kind_options, kind_shards
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.runtime.plancheck import run_problems

GiB = 2**30
HOSTS = Topology(gpus=8, gpus_per_host=4, gpu_memory_bytes=GiB, batch_size_per_rank=64)
ONE_HOST = Topology(gpus=4, gpu_memory_bytes=GiB, batch_size_per_rank=64)
SMALL = TableSpec(name="s", rows=10, dim=16, pooling_factor=2.0)


def test_kind_options_are_the_runnable_choices() -> None:
    """Fused, row-wise over every rank, table-row-wise on each host only where there
    are hosts, data-parallel only in fp32; nothing but fused on one rank."""
    assert kind_options(SMALL, HOSTS) == [
        FUSED,
        KindOption("row_wise"),
        KindOption("table_row_wise", 0),
        KindOption("table_row_wise", 1),
        KindOption("data_parallel"),
    ]
    assert kind_options(SMALL, ONE_HOST) == [
        FUSED,
        KindOption("row_wise"),
        KindOption("data_parallel"),
    ]
    half = SMALL.model_copy(update={"dtype": "fp16"})
    assert KindOption("data_parallel") not in kind_options(half, ONE_HOST)
    assert kind_options(SMALL, ONE_HOST.model_copy(update={"gpus": 1})) == [FUSED]


def test_a_table_no_gpu_holds_whole_has_only_splitting_choices() -> None:
    """3e7 rows x 16 fp32 is 1.8 GiB of weights: no 1 GiB GPU holds it whole or as a
    data-parallel copy, a quarter of it fits, an eighth too."""
    big = TableSpec(name="big", rows=30_000_000, dim=16, pooling_factor=4.0)
    got = kind_options(big, HOSTS)
    assert FUSED not in got and KindOption("data_parallel") not in got
    assert got == [
        KindOption("row_wise"),
        KindOption("table_row_wise", 0),
        KindOption("table_row_wise", 1),
    ]


def test_kind_shards_cut_as_torchrec_runs_them() -> None:
    """Even row cuts (10 rows over 4 ranks: 3, 3, 3, 1; over 8: five of 2 and three
    empty), over every rank or one host's; a data-parallel copy on every rank; each
    passes the plan's rules and the runtime's checks."""
    rw = kind_shards(KindOption("row_wise"), SMALL, ONE_HOST)
    assert [(s.rank, s.row_offset, s.rows) for s in rw] == [
        (0, 0, 3),
        (1, 3, 3),
        (2, 6, 3),
        (3, 9, 1),
    ]
    assert [s.rows for s in kind_shards(KindOption("row_wise"), SMALL, HOSTS)] == [
        2,
        2,
        2,
        2,
        2,
        0,
        0,
        0,
    ]
    twrw = kind_shards(KindOption("table_row_wise", 1), SMALL, HOSTS)
    assert [s.rank for s in twrw] == [4, 5, 6, 7] and sum(s.rows or 0 for s in twrw) == 10
    dp = kind_shards(KindOption("data_parallel"), SMALL, HOSTS)
    assert [s.rank for s in dp] == list(range(8)) and all(s.whole_rows for s in dp)
    for opt, shards in (
        (KindOption("row_wise"), kind_shards(KindOption("row_wise"), SMALL, HOSTS)),
        (KindOption("table_row_wise", 1), twrw),
        (KindOption("data_parallel"), dp),
    ):
        plan = Plan.from_shards([SMALL], [shards], HOSTS, "t", kinds=[opt.kind])
        assert plan.problems([SMALL]) == [] and run_problems(plan, 4) == []


def test_kind_shards_refuse_what_a_planner_places() -> None:
    with pytest.raises(ValueError, match="placed by a planner"):
        kind_shards(FUSED, SMALL, HOSTS)
    with pytest.raises(ValueError, match="hosts 0..1"):
        kind_shards(KindOption("table_row_wise", 2), SMALL, HOSTS)
