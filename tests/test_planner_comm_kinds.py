"""The other kinds' collectives and host presets, by hand (docs/comm.md).

Links here are made up so the figures are easy to follow: within a host α 1 ms and
1 MB/s, between hosts α 2 ms and 0.1 MB/s. Outputs are fp32 (4 bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from shardwise.planner.comm.learned import (
    COLLECTIVES_KEY,
    FACTORS_KEY,
    collective_factors,
    collectives_metadata,
    fit_learned,
    honest_limit,
    learned_collectives,
    model_collectives,
)
from shardwise.planner.comm.model import PRESETS, AlphaBetaComm, LearnedComm, exchange_bytes
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.topology import Topology
from shardwise.profiler.pretrain.training import fit_collectives

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
    # Across hosts the fit prices the level within each host, the link the one between.
    (two,) = kind_parts([rw_table(dim=100)], 4, 2, 10, host_links(fitted, 2))
    within = 3e-4 + (4 * 10 * 100 * 4 / 2) / 1e9
    assert two.fwd[0] == pytest.approx(within + fitted.alpha_s + 4 * 10 * 100 / fitted.bytes_per_s)
    assert two.priced_by.startswith("modelled: within a host fitted reduce_scatter (to synthetic")
    # Without collectives in the records, the all-to-all's fit prices them, said so.
    plain = fit_comm([{k: v for k, v in r.items() if k != "extra"} for r in records], "old")
    assert plain.collectives == ()
    assert host_links(plain, 1).describe(1, "reduce_scatter").startswith("modelled by fitted:")


# ------------------------------------------------------------------ learned collectives
#
# A cost model's fits, made up: at W ranks, reduce-scatter α 300 µs × W/2 and 1 GB/s,
# all-reduce α 500 µs × W/2 and 0.5 GB/s, on the bytes a rank moves in its ring (α
# grows with W as gloo's does where ranks outnumber cores), measured by gloo at W 2, 4,
# 8 on 2 cores, so only W 2 was honest.

RS_ALPHA, RS_BPS, AR_ALPHA, AR_BPS = 3e-4, 1e9, 5e-4, 0.5e9


def _collective_records(
    worlds: tuple[int, ...] = (2, 4, 8), slower: float = 1.0, n: int = 12
) -> list[dict[str, object]]:
    """Comm records carrying a reduce-scatter and an all-reduce each, timed exactly on
    the made-up lines (× ``slower``)."""
    records: list[dict[str, object]] = []
    for i in range(n):
        w = worlds[i % len(worlds)]
        width = 8 * (i + 1)
        rs_in = w * 128 * width * 4  # [W·B, D] fp32
        rs_s = slower * (RS_ALPHA * w / 2 + rs_in * (w - 1) / w / RS_BPS)
        ar_s = slower * (AR_ALPHA * w / 2 + 2 * rs_in * (w - 1) / w / AR_BPS)
        records.append(
            {
                "index": i,
                "extra": {
                    "backend": "gloo",
                    "collectives": [
                        {
                            "name": "reduce_scatter",
                            "bytes": rs_in,
                            "world_size": w,
                            "fwd_s": [rs_s] * w,
                            "bwd_s": [rs_s] * w,
                        },
                        {
                            "name": "all_reduce",
                            "bytes": rs_in,
                            "world_size": w,
                            "fwd_s": [],
                            "bwd_s": [ar_s] * w,
                        },
                    ],
                },
            }
        )
    return records


class _Model:
    def __init__(self, metadata: dict[str, object]) -> None:
        self.metadata = metadata
        self.source = "test-model.pt"


class _Predictor:
    """What LearnedComm reads for its collectives: the model's metadata (its
    all-to-all network is not asked for here)."""

    def __init__(self, metadata: dict[str, object]) -> None:
        self.model = _Model(metadata)


def _learned(metadata: dict[str, object]) -> LearnedComm:
    return LearnedComm(_Predictor(metadata))  # type: ignore[arg-type]


def _fitted_metadata(**more: object) -> dict[str, object]:
    fits = fit_learned(_collective_records(), "synthetic", cores=2)
    return {COLLECTIVES_KEY: collectives_metadata(fits), **more}


def test_the_collectives_fit_recovers_known_alpha_and_beta_from_comm_records() -> None:
    fits = fit_learned(_collective_records(), "synthetic", cores=2)
    rs, ar = fits["reduce_scatter"], fits["all_reduce"]
    assert rs.world_sizes == ar.world_sizes == (2, 4, 8)
    for w in (2, 4, 8):
        assert (rs.line(w).alpha_s, rs.line(w).bytes_per_s) == pytest.approx(
            (RS_ALPHA * w / 2, RS_BPS), rel=1e-6
        )
        assert (ar.line(w).alpha_s, ar.line(w).bytes_per_s) == pytest.approx(
            (AR_ALPHA * w / 2, AR_BPS), rel=1e-6
        )
        assert rs.line(w).records == 4 and rs.line(w).median_error == pytest.approx(0, abs=1e-9)
    assert rs.honest_up_to == 2 and rs.measured_on == "gloo on 2 CPU core(s)"
    # Unmeasured sizes take the nearest measured line (the larger of two as near).
    assert (rs.line(3).world, rs.line(6).world, rs.line(16).world) == (4, 8, 8)
    # nccl gives each rank a GPU: every measured size is honest; 8 cores cover W 8.
    assert honest_limit(["nccl"], [2, 4, 8], 2) == 8
    assert honest_limit(["gloo"], [2, 4, 8], 8) == 8
    assert honest_limit(["gloo"], [4, 8], 2) == 0
    # The model file's entry reads back as it was written.
    back = learned_collectives({COLLECTIVES_KEY: collectives_metadata(fits)}, "m.pt")
    assert back == fits
    # Pre-training's step reports each line's error and what is labelled how.
    done = fit_collectives(_collective_records(), "synthetic", cores=2)
    assert done.fits == fits
    assert set(done.metrics["reduce_scatter"]["by_world"]) == {"2", "4", "8"}
    assert done.metrics["all_reduce"]["by_world"]["8"]["mape"] == pytest.approx(0, abs=1e-9)
    assert any("learned up to W 2, modelled above" in n for n in done.notes)
    # A dataset measured before the collectives were: no fits, said so.
    bare = fit_collectives([{"index": 0, "extra": {"backend": "gloo"}}], "old", cores=2)
    assert bare.fits == {} and "prices them on presets" in bare.notes[-1]


def test_learned_comm_prices_the_fitted_collectives_on_one_host_labelled() -> None:
    learned = _learned(_fitted_metadata())
    assert set(model_collectives(learned)) == {"reduce_scatter", "all_reduce"}
    links = host_links(learned, 1, world=2)
    dp_table = KindTable("data_parallel", 16, 1000, "fp32", (0, 1), {})
    rw, dp = kind_parts([rw_table(dim=100, ranks=(0, 1)), dp_table], 2, 2, 10, links)
    # Row-wise at W 2, B 10, D 100: the ring moves 1/2 of 2·10·100·4 B on W 2's line.
    assert rw.fwd[0] == pytest.approx(RS_ALPHA + 4000 / RS_BPS)
    assert rw.bwd[0] == pytest.approx(rw.fwd[0])
    assert rw.priced_by == (
        "learned: fitted to 4 reduce-scatters at W 2, median error 0 % (gloo on 2 CPU core(s))"
    )
    # DP: 1000·16·4 B of gradients, an all-reduce moves 2·1/2 of them.
    assert dp.bwd[0] == pytest.approx(AR_ALPHA + 64_000 / AR_BPS)
    assert dp.priced_by.startswith("learned: fitted to 4 all-reduces at W 2")
    # W 8 was measured by 8 gloo processes on 2 cores: its own line (what this host's
    # evaluator measures there), labelled modelled.
    (rw8,) = kind_parts([rw_table(dim=100, ranks=tuple(range(8)))], 8, 8, 10, links)
    assert rw8.fwd[0] == pytest.approx(4 * RS_ALPHA + (8 * 10 * 100 * 4 * 7 / 8) / RS_BPS)
    assert rw8.priced_by.startswith("modelled: the reduce-scatter fitted to 4 reduce-scatters")
    assert "timed the OS scheduler, not a network" in rw8.priced_by
    sixteen = links.describe(1, "all_reduce", 16)
    assert sixteen.startswith("modelled:") and "W 16 was not measured: the line of W 8" in sixteen


def test_a_plan_priced_by_a_model_with_fits_uses_them_through_the_predictor() -> None:
    from shardwise.planner.costmodel.artifact import CostModel, load_bundled
    from shardwise.planner.costmodel.predictor import CostPredictor

    shipped = load_bundled()  # its own fits (make pretrain) are left out of both
    meta = {k: v for k, v in shipped.metadata.items() if k != COLLECTIVES_KEY}
    base = CostModel(shipped.compute, shipped.comm, meta)
    fitted = CostModel(base.compute, base.comm, {**meta, **_fitted_metadata()})
    plan = _every_kind_plan(Topology(gpus=2, gpu_memory_bytes=2**30))
    with_fits = plan_kind_parts(plan, CostPredictor(fitted).comm_model, 64)
    without = plan_kind_parts(plan, CostPredictor(base).comm_model, 64)
    assert [p.name for p in with_fits] == [ROW_WISE, DATA_PARALLEL]
    assert all(p.priced_by.startswith("learned: fitted to 4") for p in with_fits)
    rs_in = 2 * 64 * 32 * 4
    assert with_fits[0].fwd[0] == pytest.approx(RS_ALPHA + rs_in / 2 / RS_BPS)
    assert all("for want of a measurement or fit" in p.priced_by for p in without)


def test_table_row_wise_across_hosts_is_fitted_within_and_the_preset_between() -> None:
    learned = _learned(_fitted_metadata())
    links = host_links(learned, 2, world=4)
    assert (links.intra, links.inter) == (PRESETS["nvlink"], PRESETS["infiniband"])
    tables = [KindTable("table_row_wise", 32, 100, "fp32", (0, 1), {0: 32})]
    (part,) = kind_parts(tables, 4, 2, 10, links)
    # Within host 0: W 2's reduce-scatter of 4·10·32·4 B (a ring moves 1/2 of it);
    # between: each rank sends the other host its 10 samples, 10·32·4 B on infiniband.
    ib = PRESETS["infiniband"]
    within = RS_ALPHA + 2560 / RS_BPS
    cross = ib.alpha_s + 1280 / ib.bytes_per_s
    assert part.fwd[:2].tolist() == pytest.approx([within + cross] * 2)
    assert part.fwd[2:].tolist() == pytest.approx([cross] * 2)  # host 1 holds none of it
    assert part.priced_by.startswith(
        "modelled: within a host the reduce-scatter fitted to 4 reduce-scatters at W 2"
    )
    assert "between hosts infiniband (α 30 µs" in part.priced_by
    assert "hgx-h100 host preset" in part.priced_by
    # Row-wise over both hosts: the same line within, the NIC between, modelled too.
    (rw,) = kind_parts([rw_table(dim=32)], 4, 2, 10, links)
    assert rw.fwd[0] == pytest.approx(within + ib.alpha_s + 1280 / ib.bytes_per_s)
    assert rw.priced_by.startswith("modelled: within a host")


def test_a_model_without_fits_falls_back_to_the_presets_as_before() -> None:
    learned = _learned({"fingerprint": {}})
    assert model_collectives(learned) == {}
    links = host_links(learned, 1, world=4)
    assert links.intra is PRESETS["nvlink"] and not links.fitted and not links.learned
    part = kind_parts([rw_table()], 4, 4, 10, links)[0]
    preset = kind_parts([rw_table()], 4, 4, 10, host_links(PRESETS["nvlink"], 1))[0]
    assert part.fwd.tolist() == preset.fwd.tolist()
    assert part.priced_by == (
        "modelled by the nvlink preset, for want of a measurement or fit of them: "
        "nvlink (α 20 µs, 370 GB/s per GPU) within the host"
    )
    across = host_links(learned, 2, world=16).describe(2, "reduce_scatter", 8)
    assert across.startswith("modelled by the hgx-h100 host preset")


def test_a_calibration_rescales_the_fits_like_the_comm_speed_factor() -> None:
    fits = fit_learned(_collective_records(), "synthetic", cores=2)
    # This machine's collectives at W 2 run 1.5× the fit (one of them 3×: a spike the
    # median ignores).
    here = _collective_records(worlds=(2,), slower=1.5, n=4)
    spike = here[0]["extra"]["collectives"][0]  # type: ignore[index]
    spike["fwd_s"] = [3 * t for t in spike["fwd_s"]]
    factors = collective_factors(fits, here)
    assert factors["reduce_scatter"]["factor"] == pytest.approx(1.5)
    assert factors["all_reduce"]["factor"] == pytest.approx(1.5)
    assert factors["reduce_scatter"]["samples"] == 4
    assert factors["reduce_scatter"]["world_sizes"] == [2]
    calibrated = _learned(_fitted_metadata(calibration={FACTORS_KEY: factors}))
    rs = model_collectives(calibrated)["reduce_scatter"]
    assert rs.seconds(8000, 2) == pytest.approx(1.5 * (RS_ALPHA + 4000 / RS_BPS))
    assert rs.seconds(8000, 8) == pytest.approx(1.5 * (4 * RS_ALPHA + 7000 / RS_BPS))
    label = host_links(calibrated, 1, world=2).describe(1, "reduce_scatter", 2)
    assert label.startswith("learned:") and "×1.5 by this machine's calibration" in label
    # Calibrating again from the calibrated model converges (no double counting).
    again = collective_factors(model_collectives(calibrated), here)
    assert again["reduce_scatter"]["factor"] == pytest.approx(1.5)
    # A calibration without its own factors scales by its all-to-all's.
    by_comm = _learned(_fitted_metadata(calibration={"speed_factors": {"comm": 2.0}}))
    assert model_collectives(by_comm)["all_reduce"].factor == 2.0
    assert "the calibration's all-to-all factor" in model_collectives(by_comm)["all_reduce"].phrase(
        2
    )


_RS = f"metadata.{COLLECTIVES_KEY}.reduce_scatter"


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        ({COLLECTIVES_KEY: [1]}, "metadata.comm_collectives is a list"),
        ({COLLECTIVES_KEY: {"broadcast": {}}}, "unknown keys ['broadcast']"),
        (("2", "alpha_s", -1), f"{_RS}.by_world.2.alpha_s is -1"),
        (("2", "bytes_per_s", 0), f"{_RS}.by_world.2.bytes_per_s is 0"),
        (("2", "records", 0.5), f"{_RS}.by_world.2.records is 0.5"),
        (("1", "alpha_s", 1.0), f"{_RS}.by_world.1 is not keyed by a world size"),
        (
            {"calibration": {FACTORS_KEY: {"all_reduce": {"factor": 0}}}},
            "metadata.calibration.collective_factors.all_reduce.factor is 0",
        ),
    ],
)
def test_a_damaged_fit_is_refused_naming_its_field(damage: object, field: str) -> None:
    metadata: dict[str, Any] = _fitted_metadata()
    if isinstance(damage, tuple):
        world, key, value = damage
        lines = metadata[COLLECTIVES_KEY]["reduce_scatter"]["by_world"]
        lines[world] = {**lines["2"], key: value}
    else:
        metadata.update(damage)  # type: ignore[call-overload]
    with pytest.raises(UserError) as bad:
        model_collectives(_learned(metadata))
    assert field in str(bad.value) and "test-model.pt" in str(bad.value)
    fix = "shardwise calibrate" if "calibration" in field else "shardwise pretrain"
    assert fix in str(bad.value)


def test_pretraining_keeps_the_fits_in_the_model_file(tmp_path: Path) -> None:
    """``shardwise pretrain`` on a comm dataset whose records carry collectives: the
    model file holds their lines, which load back weights-only and price as fitted."""
    from test_profiler_pretrain import FP, comm_cost, write_compute

    from shardwise.planner.costmodel.artifact import CostModel
    from shardwise.profiler.dataset.store import CostDataset
    from shardwise.profiler.pretrain import pretrain

    write_compute(tmp_path / "compute", 120, n_bases=20)
    with CostDataset.create_or_open(tmp_path / "comm", "comm", FP, {"seed": 0}) as ds:
        for i, rec in enumerate(_collective_records(n=24)):
            w = int(rec["extra"]["collectives"][0]["world_size"])  # type: ignore[index]
            dims, delays = [8 * (i + 1)] * w, [0.0] * w
            fwd, bwd = comm_cost(dims, delays)
            ds.append(
                i,
                {
                    "batch_size": 128,
                    "world_size": w,
                    "dims": dims,
                    "delays_s": delays,
                    "fwd_s": fwd,
                    "bwd_s": bwd,
                    "fwd_cv": [0.0] * w,
                    "bwd_cv": [0.0] * w,
                    "repeats": 10,
                    "extra": rec["extra"],
                },
            )
    model, report = pretrain(tmp_path, max_epochs=2, patience=2, tiny=True)
    model.save(tmp_path / "m.pt")
    loaded = CostModel.load(tmp_path / "m.pt")
    fits = learned_collectives(loaded.metadata, loaded.source)
    assert fits == fit_learned(_collective_records(n=24), "x", cores=FP.cores)
    assert fits["reduce_scatter"].line(4).alpha_s == pytest.approx(2 * RS_ALPHA, rel=1e-6)
    assert any("labelled learned up to W 2" in n for n in report.notes)
    assert set(report.metrics["comm_collectives"]) == {"reduce_scatter", "all_reduce"}
