"""The other kinds' collectives and host presets, by hand (docs/comm.md).

Links here are made up so the figures are easy to follow: within a host α 1 ms and
1 MB/s, between hosts α 2 ms and 0.1 MB/s. Outputs are fp32 (4 bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import shardwise

from shardwise.basics import UserError
from shardwise.planner.comm.choice import comm_choices, resolve_comm
from shardwise.planner.comm.collectives import (
    DATA_PARALLEL,
    HOST_ROW_WISE,
    ROW_WISE,
    HostLinks,
    KindTable,
    fused_dims,
    host_links,
    kind_comm,
    kind_parts,
    kind_tables,
    plan_kind_parts,
)
from shardwise.planner.comm.fit import fit_comm
from shardwise.planner.comm.hosts import HOST_PRESETS, HostPreset, comm_local_world
from shardwise.planner.comm.model import PRESETS, AlphaBetaComm, exchange_bytes
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.topology import Topology

INTRA = AlphaBetaComm(name="in", alpha_s=1e-3, bytes_per_s=1e6, source="made up")
INTER = AlphaBetaComm(name="out", alpha_s=2e-3, bytes_per_s=1e5, source="made up")
LINKS = HostLinks(INTRA, INTER, "test links")


def rw_table(dim: int = 32, ranks: tuple[int, ...] = (0, 1, 2, 3)) -> KindTable:
    return KindTable("row_wise", dim, 1000, "fp32", ranks, {})


def test_row_wise_is_a_reduce_scatter_and_an_all_gather_of_the_global_batch() -> None:
    # W=4 on one host, B=10, D=32: each rank reduces [40, 32] fp32 = 5,120 B; a ring
    # moves 3/4 of it, (W-1)·B·D·4 = 3,840 B: 1 ms + 3.84 ms, forward and backward.
    fwd, bwd = kind_comm([rw_table()], 4, 4, 10, LINKS)
    assert fwd.tolist() == pytest.approx([4.84e-3] * 4)
    assert bwd.tolist() == pytest.approx([4.84e-3] * 4)
    # Two hosts of 2: within, 1/2 of 5,120 B (1 ms + 2.56 ms); between, 1/2 of the
    # host's 1/2 share, (H-1)·B·D·4 = 1,280 B at 0.1 MB/s (2 ms + 12.8 ms).
    fwd, _ = kind_comm([rw_table()], 4, 2, 10, LINKS)
    assert fwd.tolist() == pytest.approx([3.56e-3 + 14.8e-3] * 4)


def test_table_row_wise_reduces_within_each_host_then_crosses_between() -> None:
    """Host 0 holds a 16-wide table, host 1 a 32-wide one (W=4, L=2, B=10)."""
    tables = [
        KindTable("table_row_wise", 16, 100, "fp32", (0, 1), {0: 16}),
        KindTable("table_row_wise", 32, 100, "fp32", (2, 3), {1: 32}),
    ]
    (part,) = kind_parts(tables, 4, 2, 10, LINKS)
    assert part.name == HOST_ROW_WISE
    # Within host 0: 1/2 of 4·10·16·4 = 2,560 B -> 1 ms + 1.28 ms; host 1: 1 ms + 2.56 ms.
    # Between: each rank sends its 10 samples of its host's widest output to the other
    # host, 1·10·32·4 = 1,280 B at 0.1 MB/s -> 2 ms + 12.8 ms.
    want = [2.28e-3 + 14.8e-3] * 2 + [3.56e-3 + 14.8e-3] * 2
    assert part.fwd.tolist() == pytest.approx(want)
    assert part.bwd.tolist() == pytest.approx(want)
    # On one host it is the row-wise reduce-scatter of the host's widths.
    one = kind_parts(
        [KindTable("table_row_wise", 32, 100, "fp32", (0, 1, 2, 3), {0: 32})], 4, 4, 10, LINKS
    )
    assert one[0].fwd.tolist() == pytest.approx(kind_comm([rw_table()], 4, 4, 10, LINKS)[0])


def test_data_parallel_all_reduces_its_gradients_in_the_backward() -> None:
    dp = KindTable("data_parallel", 16, 1000, "fp32", (0, 1, 2, 3), {})
    # 1000·16·4 = 64,000 B; a ring all-reduce moves 2·3/4 of it: 1 ms + 96 ms.
    (part,) = kind_parts([dp], 4, 4, 10, LINKS)
    assert part.name == DATA_PARALLEL and part.fwd.tolist() == [0.0] * 4
    assert part.bwd.tolist() == pytest.approx([97e-3] * 4)
    # fp16 gradients are half the bytes.
    half = KindTable("data_parallel", 16, 1000, "fp16", (0, 1, 2, 3), {})
    assert kind_parts([half], 4, 4, 10, LINKS)[0].bwd[0] == pytest.approx(1e-3 + 48e-3)
    # Two hosts of 2: reduce-scatter within (1 ms + 32 ms), all-reduce of the 32,000-B
    # share between (2 ms + 320 ms), all-gather within (1 ms + 32 ms).
    (split,) = kind_parts([dp], 4, 2, 10, LINKS)
    assert split.bwd.tolist() == pytest.approx([0.388] * 4)


def test_the_pooled_all_to_all_runs_in_two_levels_on_hosts() -> None:
    hosts = HostPreset("test", "2 a host", INTRA, INTER, 2, "made up")
    # dims [16, 32, 0, 16], B=10 (40 B a column): within host 0 rank 0 receives
    # 32 columns (1,280 B) and rank 1 sends 32 (1,280 B); between, rank 1 sends its
    # 32 columns to 2 ranks (2,560 B). Links run at once: max(1 + 1.28, 2 + 25.6) ms.
    fwd, bwd = hosts.one([16, 32, 0, 16], [0.0, 0.0, 0.0, 3e-3], 10)
    assert bwd.tolist() == pytest.approx([27.6e-3] * 4)
    assert fwd.tolist() == pytest.approx([30.6e-3] * 3 + [27.6e-3])  # the straggler wait
    # The plan's hosts win over the preset's: one host of 4 is the link within alone.
    one_host = hosts.one([16, 32, 0, 16], [0.0] * 4, 10, local_world=4)[1][0]
    flat = exchange_bytes(np.array([[16.0, 32.0, 0.0, 16.0]]), 10)[0]
    assert one_host == pytest.approx(1e-3 + flat / 1e6)


def test_hosts_come_from_the_plan_then_the_preset() -> None:
    topo = Topology(gpus=16, gpu_memory_bytes=2**30)
    assert comm_local_world(HOST_PRESETS["hgx-h100"], topo) == 8
    assert comm_local_world(PRESETS["nvlink"], topo) == 16
    assert (
        comm_local_world(HOST_PRESETS["hgx-h100"], topo.model_copy(update={"gpus_per_host": 4}))
        == 4
    )
    small = Topology(gpus=2, gpu_memory_bytes=2**30)
    assert comm_local_world(HOST_PRESETS["hgx-h100"], small) == 2


def test_links_by_comm_model_and_their_labels() -> None:
    h100 = host_links(HOST_PRESETS["hgx-h100"], 2)
    assert (h100.intra, h100.inter) == (PRESETS["nvlink"], PRESETS["infiniband"])
    assert h100.describe(2).startswith("modelled by the hgx-h100 host preset: nvlink (α 20 µs")
    assert "infiniband (α 30 µs, 48 GB/s per GPU) between hosts" in h100.describe(2)
    flat = host_links(PRESETS["pcie"], 1)
    assert flat.intra is flat.inter is PRESETS["pcie"]
    apart = host_links(PRESETS["ethernet"], 2)
    assert (apart.intra, apart.inter) == (PRESETS["nvlink"], PRESETS["ethernet"])
    from shardwise.planner.comm.model import MeasuredComm

    fallback = host_links(MeasuredComm(), 1, world=16)
    assert fallback.intra is PRESETS["nvlink"] and "for want of a measurement" in fallback.origin
    across = host_links(MeasuredComm(), 2, world=2)  # 2 hosts of 1: NICs between them
    assert (across.intra, across.inter) == (PRESETS["nvlink"], PRESETS["infiniband"])


def _every_kind_plan(topology: Topology) -> Plan:
    w = topology.gpus
    return Plan(
        world_size=w,
        planner="t",
        topology=topology,
        tables=[
            PlanTable(name="tw", rows=100, dim=16, shards=[Shard(rank=0, cols=16)]),
            PlanTable(
                name="cw",
                rows=100,
                dim=32,
                shards=[Shard(rank=1, cols=16), Shard(rank=2, col_offset=16, cols=16)],
            ),
            PlanTable(
                name="rw",
                rows=1000,
                dim=32,
                kind="row_wise",
                shards=[
                    Shard(rank=r, cols=32, row_offset=o, rows=n)
                    for r, (o, n) in enumerate(even_row_split(1000, w))
                ],
            ),
            PlanTable(
                name="dp",
                rows=50,
                dim=16,
                kind="data_parallel",
                shards=[Shard(rank=r, cols=16) for r in range(w)],
            ),
        ],
    ).with_hash()


def test_a_plan_is_priced_part_by_part_on_its_hosts() -> None:
    plan = _every_kind_plan(Topology(gpus=4, gpu_memory_bytes=2**30, gpus_per_host=2))
    assert fused_dims(plan) == [16, 16, 16, 0]  # row-wise and DP send no all-to-all
    parts = plan_kind_parts(plan, HOST_PRESETS["hgx-h100"], 64)
    assert [p.name for p in parts] == [ROW_WISE, DATA_PARALLEL]
    links = host_links(HOST_PRESETS["hgx-h100"], 2)
    want = kind_parts(kind_tables(plan.tables, 2), 4, 2, 64, links)
    assert [p.bwd.tolist() for p in parts] == [p.bwd.tolist() for p in want]
    assert all(p.priced_by.startswith("modelled by the hgx-h100 host preset") for p in parts)


def test_host_presets_are_named_with_sources_in_help_and_errors() -> None:
    assert {"hgx-h100", "hgx-a100", "p4d"} <= set(HOST_PRESETS)
    for name, p in HOST_PRESETS.items():
        assert p.name == name and len(p.source) > 80 and p.gpus_per_host == 8
        assert name in comm_choices()
        got = resolve_comm(name.upper(), world=16, device=None, predictor=None, measuring=False)
        assert got is p and got.describe().startswith(f"modelled: {name} host preset")
    with pytest.raises(UserError) as bad:
        resolve_comm("hgx-h200", world=16, device=None, predictor=None, measuring=False)
    assert "hgx-h100" in str(bad.value) and "p4d" in str(bad.value)
    ran = shardwise("evaluate", "--help")
    assert ran.code == 0 and "hgx-h100" in " ".join(ran.stdout.split())


def test_a_comm_dataset_fits_its_reduce_scatters_and_all_reduces_too() -> None:
    """Records carrying measured collectives (``extra.collectives``) give each its own
    α–β, on the bytes a rank moves in its ring."""
    records = []
    truth = AlphaBetaComm(name="t", alpha_s=1e-4, bytes_per_s=2e9, source="")
    for i, d in enumerate((64, 128, 256, 512)):
        t = truth.one([d, d], [0.0, 0.0], 128)[1].tolist()
        rs_in = 2 * 128 * d * 4  # [W·B, d] fp32
        rs_s = 3e-4 + (rs_in / 2) / 1e9
        ar_s = 5e-4 + (2 * rs_in / 2) / 0.5e9
        records.append(
            {
                "index": i,
                "batch_size": 128,
                "dims": [d, d],
                "delays_s": [0.0, 0.0],
                "fwd_s": t,
                "bwd_s": t,
                "extra": {
                    "collectives": [
                        {
                            "name": "reduce_scatter",
                            "bytes": rs_in,
                            "world_size": 2,
                            "fwd_s": [rs_s] * 2,
                            "bwd_s": [rs_s] * 2,
                        },
                        {
                            "name": "all_reduce",
                            "bytes": rs_in,
                            "world_size": 2,
                            "fwd_s": [],
                            "bwd_s": [ar_s] * 2,
                        },
                    ]
                },
            }
        )
    fitted = fit_comm(records, "synthetic")
    assert fitted.bytes_per_s == pytest.approx(2e9, rel=1e-6)
    fits = dict(fitted.collectives)
    assert fits["reduce_scatter"].alpha_s == pytest.approx(3e-4, rel=1e-6)
    assert fits["reduce_scatter"].bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert fits["all_reduce"].bytes_per_s == pytest.approx(0.5e9, rel=1e-6)
    links = host_links(fitted, 1)
    (rw,) = kind_parts([rw_table(dim=100, ranks=(0, 1))], 2, 2, 10, links)
    assert rw.fwd[0] == pytest.approx(3e-4 + (2 * 10 * 100 * 4 / 2) / 1e9)
    assert rw.priced_by.startswith("modelled: fitted reduce_scatter (to synthetic")
    # Without collectives in the records, the all-to-all's fit prices them, said so.
    plain = fit_comm([{k: v for k, v in r.items() if k != "extra"} for r in records], "old")
    assert plain.collectives == ()
    assert host_links(plain, 1).describe(1, "reduce_scatter").startswith("modelled by fitted:")
