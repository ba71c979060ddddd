"""plan.json <-> TorchRec ShardingPlan: the mapping, the round trip, and a real DMP run."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

from shardwise.basics import UserError
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import (
    DEFAULT_MODULE_PATH,
    embedding_bag_configs,
    from_sharding_plan,
    to_sharding_plan,
    torchrec_problems,
)

GiB = 2**30


def _plan(tables: list[PlanTable], gpus: int = 2, device: Literal["cuda", "cpu"] = "cuda") -> Plan:
    topo = Topology(gpus=gpus, gpu_memory_bytes=GiB, device=device)
    return Plan(world_size=gpus, planner="test", topology=topo, tables=tables).with_hash()


def _specs(plan: Plan) -> list[TableSpec]:
    return [
        TableSpec(name=t.name, rows=t.rows, dim=t.dim, pooling_factor=1.0, dtype=t.dtype)
        for t in plan.tables
    ]


def _table(name: str, rows: int, *shards: tuple[int, int]) -> PlanTable:
    """A table from (rank, cols) pairs laid out left to right."""
    out, offset = [], 0
    for rank, cols in shards:
        out.append(Shard(rank=rank, col_offset=offset, cols=cols))
        offset += cols
    return PlanTable(name=name, rows=rows, dim=offset, shards=out)


MIXED = _plan(
    [
        _table("tw", 20, (1, 8)),
        _table("even", 30, (1, 12), (0, 12)),
        _table("uneven", 15, (0, 16), (1, 8)),
        _table("three", 25, (1, 8), (0, 12), (1, 8)),  # rank 1 twice, equal widths
    ]
)


def _round_trip(plan: Plan, **kwargs: object) -> Plan:
    sharding_plan = to_sharding_plan(plan, **kwargs)  # type: ignore[arg-type]
    return from_sharding_plan(sharding_plan, _specs(plan), plan.topology, plan.planner)


def test_mapping_follows_the_shards() -> None:
    sp = to_sharding_plan(MIXED)
    assert list(sp.plan) == [DEFAULT_MODULE_PATH]
    module = sp.plan[DEFAULT_MODULE_PATH]
    assert module["tw"].sharding_type == "table_wise"
    assert {module[n].sharding_type for n in ("even", "uneven", "three")} == {"column_wise"}
    assert {p.compute_kernel for p in module.values()} == {"fused"}
    uneven = module["uneven"]
    assert uneven.ranks == [0, 1]
    assert isinstance(uneven.sharding_spec, EnumerableShardingSpec)
    metas = uneven.sharding_spec.shards
    assert [m.shard_offsets for m in metas] == [[0, 0], [0, 16]]
    assert [m.shard_sizes for m in metas] == [[15, 16], [15, 8]]
    assert [str(m.placement) for m in metas] == ["rank:0/cuda:0", "rank:1/cuda:1"]


def test_round_trip_examples() -> None:
    assert _round_trip(MIXED) == MIXED
    assert _round_trip(MIXED, device="cpu") == MIXED


def test_device_rewrite_to_cpu() -> None:
    sp = to_sharding_plan(MIXED, device="cpu", module_path="")
    placements = {str(m.placement) for p in sp.plan[""].values() for m in p.sharding_spec.shards}
    assert placements == {"rank:0/cpu", "rank:1/cpu"}
    cpu_plan = _plan(MIXED.tables, device="cpu")
    assert {
        str(m.placement)
        for p in to_sharding_plan(cpu_plan).plan[DEFAULT_MODULE_PATH].values()
        for m in p.sharding_spec.shards
    } == placements


def test_cuda_index_is_the_local_rank() -> None:
    plan = _plan([_table("t", 10, (3, 4), (1, 4), (2, 4))], gpus=4)
    sp = to_sharding_plan(plan, local_world_size=2)
    metas = sp.plan[DEFAULT_MODULE_PATH]["t"].sharding_spec.shards
    assert [str(m.placement) for m in metas] == ["rank:3/cuda:1", "rank:1/cuda:1", "rank:2/cuda:0"]


def test_unequal_widths_on_one_rank_are_refused() -> None:
    plan = _plan([_table("t", 10, (1, 16), (1, 8))])
    assert torchrec_problems(plan)
    with pytest.raises(UserError, match="equally wide"):
        to_sharding_plan(plan)


def test_invalid_plan_is_refused() -> None:
    bad = _plan([PlanTable(name="t", rows=10, dim=8, shards=[Shard(rank=0, col_offset=0, cols=4)])])
    with pytest.raises(UserError, match="not placed|cover"):
        to_sharding_plan(bad)


def _single(
    sharding_type: str, metas: list[ShardMetadata] | None, ranks: list[int]
) -> ShardingPlan:
    module = EmbeddingModuleShardingPlan()
    module["t"] = ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel="fused",
        ranks=ranks,
        sharding_spec=EnumerableShardingSpec(metas) if metas is not None else None,
    )
    return ShardingPlan({"m": module})


SPEC_T = [TableSpec(name="t", rows=10, dim=8, pooling_factor=1.0)]
TOPO2 = Topology(gpus=2, gpu_memory_bytes=GiB)


def test_row_wise_and_data_parallel_come_back_as_their_kinds() -> None:
    row_wise = _single(
        "row_wise",
        [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 8], placement="rank:0/cuda:0"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 8], placement="rank:1/cuda:1"),
        ],
        [0, 1],
    )
    plan = from_sharding_plan(row_wise, SPEC_T, TOPO2, "torchrec")
    assert plan.tables[0].kind == "row_wise"
    assert [(s.rank, s.row_offset, s.rows) for s in plan.tables[0].shards] == [(0, 0, 5), (1, 5, 5)]
    dp = from_sharding_plan(_single("data_parallel", None, [0, 1]), SPEC_T, TOPO2, "torchrec")
    assert dp.tables[0].kind == "data_parallel"
    assert [(s.rank, s.cols, s.rows) for s in dp.tables[0].shards] == [(0, 8, None), (1, 8, None)]
    back = to_sharding_plan(dp).plan[DEFAULT_MODULE_PATH]["t"]
    assert (back.sharding_type, back.compute_kernel, back.ranks) == (
        "data_parallel",
        "dense",
        [0, 1],
    )
    assert back.sharding_spec is None


def test_a_grid_of_one_column_range_comes_back_table_row_wise() -> None:
    """TorchRec's planner labels one cut either way; a plan has one form (and hash)."""
    grid = _single(
        "grid_shard",
        [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 8], placement="rank:0/cuda:0"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 8], placement="rank:1/cuda:1"),
        ],
        [0, 1],
    )
    twrw = _single("table_row_wise", grid.plan["m"]["t"].sharding_spec.shards, [0, 1])
    a = from_sharding_plan(grid, SPEC_T, TOPO2, "torchrec", module_path="m")
    b = from_sharding_plan(twrw, SPEC_T, TOPO2, "torchrec", module_path="m")
    assert a.tables[0].kind == b.tables[0].kind == "table_row_wise" and a.hash == b.hash


def test_an_uneven_row_cut_is_refused_with_the_cut_torchrec_runs() -> None:
    plan = _plan(
        [
            PlanTable(
                name="r",
                rows=10,
                dim=8,
                kind="row_wise",
                shards=[
                    Shard(rank=0, cols=8, row_offset=0, rows=6),
                    Shard(rank=1, cols=8, row_offset=6, rows=4),
                ],
            )
        ]
    )
    assert plan.problems() == []  # a valid plan ...
    (problem,) = torchrec_problems(plan)  # ... that TorchRec cannot train
    assert "rank 0: rows 0..5, rank 1: rows 6..9" in problem
    assert "rank 0: rows 0..4, rank 1: rows 5..9" in problem
    with pytest.raises(UserError, match="even cut"):
        to_sharding_plan(plan)


def test_table_column_wise_is_accepted() -> None:
    twcw = _single(
        "table_column_wise",
        [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 4], placement="rank:1/cuda:1"),
            ShardMetadata(shard_offsets=[0, 4], shard_sizes=[10, 4], placement="rank:0/cuda:0"),
        ],
        [1, 0],
    )
    plan = from_sharding_plan(twcw, SPEC_T, TOPO2, "torchrec", module_path="m")
    assert plan.tables[0].shards == [
        Shard(rank=1, col_offset=0, cols=4),
        Shard(rank=0, col_offset=4, cols=4),
    ]


def test_mismatches_are_user_errors() -> None:
    sp = to_sharding_plan(MIXED)
    specs = _specs(MIXED)
    with pytest.raises(UserError, match="not in TorchRec's plan"):
        from_sharding_plan(
            sp, [*specs, TableSpec(name="x", rows=1, dim=4, pooling_factor=1)], MIXED.topology, "t"
        )
    with pytest.raises(UserError, match="not among the tables"):
        from_sharding_plan(sp, specs[1:], MIXED.topology, "t")
    with pytest.raises(UserError, match="no module 'nope'"):
        from_sharding_plan(sp, specs, MIXED.topology, "t", module_path="nope")
    wrong_rows = [s.model_copy(update={"rows": s.rows + 1}) for s in specs]
    with pytest.raises(UserError, match="holds every row"):
        from_sharding_plan(sp, wrong_rows, MIXED.topology, "t")
    two = ShardingPlan({**sp.plan, "other": EmbeddingModuleShardingPlan()})
    with pytest.raises(UserError, match="module_path"):
        from_sharding_plan(two, specs, MIXED.topology, "t")


# --------------------------------------------------------------------------- property


def _rows(rows: int, ranks: list[int], cols: int, col_offset: int = 0) -> list[Shard]:
    return [
        Shard(rank=r, col_offset=col_offset, cols=cols, row_offset=o, rows=n)
        for r, (o, n) in zip(ranks, even_row_split(rows, len(ranks)), strict=True)
    ]


@st.composite
def kind_table(draw: st.DrawFn, name: str, gpus: int, local: int) -> PlanTable:
    """A table of a row kind or data-parallel, cut as TorchRec cuts it."""
    kind = draw(st.sampled_from(["row_wise", "table_row_wise", "grid", "data_parallel"]))
    rows = draw(st.integers(1, 10**6))
    dim = 4 * draw(st.integers(2, 8))
    host = draw(st.integers(0, gpus // local - 1))
    on_host = list(range(host * local, (host + 1) * local))
    if kind == "row_wise":
        shards = _rows(rows, list(range(gpus)), dim)
    elif kind == "table_row_wise":
        shards = _rows(rows, on_host, dim)
    elif kind == "grid":
        half = dim // 2 - (dim // 2) % 4
        shards = _rows(rows, on_host, half) + _rows(rows, on_host, dim - half, half)
    else:
        shards = [Shard(rank=r, cols=dim) for r in range(gpus)]
    return PlanTable(
        name=name,
        rows=rows,
        dim=dim,
        kind=kind,
        dtype=draw(st.sampled_from(["fp32", "fp16"])),
        shards=draw(st.permutations(shards)),
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    gpus = draw(st.integers(1, 6))
    local = draw(st.sampled_from([d for d in range(1, gpus + 1) if gpus % d == 0]))
    tables = [draw(kind_table(f"k{i}", gpus, local)) for i in range(draw(st.integers(0, 3)))]
    for i in range(draw(st.integers(1, 6))):
        widths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
        ranks = draw(st.lists(st.integers(0, gpus - 1), min_size=len(widths), max_size=len(widths)))
        offset, shards = 0, []
        for w, r in zip(widths, ranks, strict=True):
            shards.append(Shard(rank=r, col_offset=offset, cols=4 * w))
            offset += 4 * w
        order = draw(st.permutations(range(len(shards))))
        tables.append(
            PlanTable(
                name=f"t{i}",
                rows=draw(st.integers(1, 10**6)),
                dim=offset,
                dtype=draw(st.sampled_from(["fp32", "fp16"])),
                shards=[shards[k] for k in order],
            )
        )
    topo = Topology(
        gpus=gpus,
        gpu_memory_bytes=64 * GiB,
        device=draw(st.sampled_from(["cuda", "cpu"])),
        gpus_per_host=local,
    )
    return Plan(world_size=gpus, planner="prop", topology=topo, tables=tables).with_hash()


@settings(max_examples=60, deadline=None)
@given(plan=plans(), device=st.sampled_from([None, "cpu", "cuda"]))
def test_round_trip_property(plan: Plan, device: str | None) -> None:
    """from(to(plan)) == plan for every valid plan TorchRec can run; the rest are refused."""
    if torchrec_problems(plan):
        event("refused: unequal widths on one rank")
        with pytest.raises(UserError, match="equally wide"):
            to_sharding_plan(plan, device=device)
        return
    event("round trip")
    again = _round_trip(plan, device=device)
    # The same placement, shard for shard (TorchRec lists row ranges in rank order).
    assert again.hash == plan.hash == again.content_hash()
    assert [t.kind for t in again.tables] == [t.kind for t in plan.tables]


# --------------------------------------------------------------------------- real DMP


def _dmp_worker(rank: int, world_size: int, port: int, plan_json: str, out_dir: str) -> None:
    """Shard MIXED with DMP on CPU/gloo and compare with the unsharded EBC, same weights."""
    try:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        plan = Plan.model_validate_json(plan_json)
        configs = embedding_bag_configs(plan.tables, features=[f"f_{t.name}" for t in plan.tables])

        class Sparse(nn.Module):
            def __init__(self, device: torch.device) -> None:
                super().__init__()
                self.embedding_bag_collection = EmbeddingBagCollection(configs, device=device)

        class Model(nn.Module):  # the EBC sits at DEFAULT_MODULE_PATH, as in DLRM
            def __init__(self, device: torch.device) -> None:
                super().__init__()
                self.sparse_arch = Sparse(device)

            def forward(self, kjt: KeyedJaggedTensor) -> object:
                return self.sparse_arch.embedding_bag_collection(kjt)

        torch.manual_seed(0)
        reference = Model(torch.device("cpu"))
        dmp = DistributedModelParallel(
            Model(torch.device("meta")),
            device=torch.device("cpu"),
            plan=to_sharding_plan(plan, device="cpu"),
            sharders=[EmbeddingBagCollectionSharder()],
        )
        full = reference.state_dict()
        with torch.no_grad():
            for key, sharded in dmp.state_dict().items():
                for shard in sharded.local_shards():
                    (r0, c0) = shard.metadata.shard_offsets
                    (rows, cols) = shard.metadata.shard_sizes
                    shard.tensor.copy_(full[key][r0 : r0 + rows, c0 : c0 + cols])

        gen = torch.Generator().manual_seed(100 + rank)
        batch, keys = 4, [f"f_{t.name}" for t in plan.tables]
        lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
        counts = lengths.view(len(keys), batch).sum(dim=1).tolist()
        values = torch.cat(
            [
                torch.randint(0, t.rows, (int(n),), generator=gen)
                for t, n in zip(plan.tables, counts, strict=True)
            ]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        with torch.no_grad():
            got = dmp(kjt).to_dict()
            want = reference(kjt).to_dict()
        result = {
            "max_abs_err": max(float((got[k] - want[k]).abs().max()) for k in keys),
            "ref_norm": sum(float(want[k].norm()) for k in keys),
            "shapes_match": all(got[k].shape == want[k].shape for k in keys),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # plain interpreter exit sometimes aborts in gloo/fbgemm teardown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_dmp_on_cpu_matches_unsharded(tmp_path: Path) -> None:
    """TorchRec accepts the plan (table-wise, even/uneven column-wise, a rank holding two
    shards of one table) and the 2-rank sharded forward equals the unsharded one."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_dmp_worker, args=(rank, 2, port, MIXED.model_dump_json(), str(tmp_path))
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["shapes_match"]
        assert result["ref_norm"] > 0
        assert result["max_abs_err"] < 1e-6


def test_embedding_bag_configs_follow_the_specs() -> None:
    """One builder of TorchRec's configs: the runtime's model, the TorchRec planner's
    meta-device collection and the tests all name, size and type tables alike."""
    from torchrec.modules.embedding_configs import DataType

    specs = [
        TableSpec(name="a", rows=100, dim=16, pooling_factor=2.0),
        TableSpec(name="b", rows=50, dim=8, pooling_factor=1.0, dtype="fp16"),
    ]
    a, b = embedding_bag_configs(specs)
    assert (a.name, a.num_embeddings, a.embedding_dim, a.feature_names) == ("a", 100, 16, ["a"])
    assert (a.data_type, b.data_type) == (DataType.FP32, DataType.FP16)
    aliased = embedding_bag_configs(specs, names=["x0", "x1"])
    assert [(c.name, c.feature_names) for c in aliased] == [("x0", ["x0"]), ("x1", ["x1"])]
    featured = embedding_bag_configs(MIXED.tables, features=["f"] * len(MIXED.tables))
    assert [c.name for c in featured] == [t.name for t in MIXED.tables]
    assert all(c.feature_names == ["f"] for c in featured)
