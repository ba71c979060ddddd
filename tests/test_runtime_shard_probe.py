"""The per-shard probe (``shardwise.runtime.shard_probe``) on real FBGEMM kernels.

The offsets rewrite is checked against the kernel itself: the pooled output of a call
with one table's bags kept equals the full call's columns of that table, and zeros
elsewhere. The shard mapping and the "probing changes nothing" guarantee are checked on
TorchRec's sharded collection (one rank, gloo, in this process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.planner.kinds import Kind
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.runtime.dlrm import SyntheticData, build_model
from shardwise.runtime.shard_probe import ShardProbe, kernel_shards, only_features
from shardwise.runtime.sharding import dense_optimizer, shard_model, sharded_collection

BATCH = 64


def _tbe(dims: list[int], feature_table_map: list[int]) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [
        (50 + 10 * i, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for i, d in enumerate(dims)
    ]
    return SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=feature_table_map)


def _batch(features: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (features * batch,), generator=g)
    offsets = torch.zeros(features * batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    indices = torch.randint(0, 50, (int(offsets[-1]),), generator=g)
    return indices, offsets


def test_only_features_keeps_one_tables_bags_and_empties_the_rest() -> None:
    """Table 1 is read by two features (1 and 2): keeping them gives the full call's
    columns of those features, every other column zero, the same output shape."""
    dims, ftm = [4, 8, 12], [0, 1, 1, 2]
    kernel = _tbe(dims, ftm)
    indices, offsets = _batch(len(ftm), 7)
    weights = torch.rand(indices.numel())
    with torch.no_grad():
        full = kernel(indices=indices, offsets=offsets)
    columns = [0, 4, 12, 20, 32]  # each feature's columns in the pooled output
    for kept in ([0], [1, 2], [3]):
        i, o, w = only_features(indices, offsets, weights, kept, len(ftm))
        assert o.shape == offsets.shape and int(o[0]) == 0 and int(o[-1]) == i.numel()
        assert w is not None and w.numel() == i.numel()
        with torch.no_grad():
            got = kernel(indices=i, offsets=o)
        assert got.shape == full.shape
        for f in range(len(ftm)):
            part = slice(columns[f], columns[f + 1])
            expected = full[:, part] if f in kept else torch.zeros_like(full[:, part])
            assert torch.equal(got[:, part], expected), (kept, f)
    # The kept indices are the features' own, in order, with their weights.
    b = 7
    i, _, w = only_features(indices, offsets, weights, [1, 2], len(ftm))
    lo, hi = int(offsets[1 * b]), int(offsets[3 * b])
    assert torch.equal(i, indices[lo:hi]) and w is not None and torch.equal(w, weights[lo:hi])
    with pytest.raises(ValueError, match="do not split"):
        only_features(indices, offsets[:-1], None, [0], len(ftm))


# --------------------------------------------------------------------------- on TorchRec


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process (DMP needs one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    # An in-process store: no port, and nothing left in os.environ for the tests after
    # this module (a MASTER_ADDR left there sent a later subprocess to a taken port).
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


TABLES = [
    TableSpec(name=f"t{i}", rows=300 + 50 * i, dim=d, pooling_factor=p)
    for i, (d, p) in enumerate([(16, 2.0), (32, 3.0), (16, 12.0), (8, 1.0)])
]


def _plan(kinds: list[Kind | None] | None = None) -> Plan:
    """Every table on rank 0; t1 cut column-wise into two shards (0:16, 16:32) unless
    ``kinds`` names another kind for it."""
    kinds = kinds or [None] * len(TABLES)
    shards = [[Shard(rank=0, col_offset=0, cols=t.dim)] for t in TABLES]
    if kinds[1] is None:
        shards[1] = [Shard(rank=0, col_offset=0, cols=16), Shard(rank=0, col_offset=16, cols=16)]
    topology = Topology(gpus=1, gpu_memory_bytes=1 << 30, device="cpu", batch_size_per_rank=BATCH)
    return Plan.from_shards(TABLES, shards, topology, "test", kinds=kinds)


def _dmp(plan: Plan | None = None) -> Any:
    torch.manual_seed(0)
    model = build_model(TABLES, 13, torch.device("meta"), torch.device("cpu"))
    return shard_model(model, plan or _plan(), torch.device("cpu"))


@pytest.mark.slow
def test_each_kernel_table_maps_to_its_plan_shard(one_rank: None) -> None:
    dmp = _dmp()
    found = [
        (s.table, s.col_offset, s.cols)
        for k in kernel_shards(sharded_collection(dmp))
        for s in k.shards
    ]
    plan = _plan()
    expected = [(t.name, s.col_offset, s.cols) for t in plan.tables for s in t.shards]
    assert sorted(found) == sorted(expected)
    for k in kernel_shards(sharded_collection(dmp)):
        # Each shard's features are the kernel's features of that table, and all of them.
        ftm = list(k.kernel.feature_table_map)
        assert sorted(f for s in k.shards for f in s.features) == list(range(len(ftm)))
        assert k.num_features == len(ftm)


def _train(
    steps: int, probe_on: bool, plan: Plan | None = None
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    dmp = _dmp(plan)
    optimizer = dense_optimizer(dmp, 0.05)
    probe = ShardProbe(sharded_collection(dmp), rank=0, budget=1.0) if probe_on else None
    data = SyntheticData(TABLES, BATCH, 13, seed=0)
    losses = []
    for step in range(1, steps + 1):
        dense, kjt, labels = data.batch(step, 0)
        if probe is not None:
            probe.train_seconds = 1e9  # every step is probed, every call fits
            probe.start_step(True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dmp(dense, kjt).squeeze(-1), labels
        )
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        if probe is not None:
            assert probe.finish_step()
        losses.append(float(loss.detach()))
    return losses, _kernel_state(dmp), probe


def _kernel_state(dmp: Any) -> dict[str, torch.Tensor]:
    """Every kernel's tables, optimizer state and counters (the dense kernel of a
    data-parallel table: its weights; its optimizer is the dense one's)."""
    state = {}
    for n, k in enumerate(kernel_shards(sharded_collection(dmp))):
        kernel = k.kernel
        if not hasattr(kernel, "split_optimizer_states"):
            state[f"{n}.weights"] = kernel.weights.detach().clone()
            continue
        for t, weights in enumerate(kernel.split_embedding_weights()):
            state[f"{n}.{t}.weights"] = weights.detach().clone()
        for t, states in enumerate(kernel.split_optimizer_states()):
            for j, value in enumerate(states):
                state[f"{n}.{t}.optimizer{j}"] = value.detach().clone()
        state[f"{n}.iter"] = kernel.iter.detach().clone()
        state[f"{n}.step"] = torch.tensor(kernel.step)
    return state


@pytest.mark.slow
def test_probing_every_step_changes_no_loss_and_no_weight(one_rank: None) -> None:
    plain, plain_state, _ = _train(6, probe_on=False)
    probed, probed_state, probe = _train(6, probe_on=True)
    assert probed == plain
    assert plain_state.keys() == probed_state.keys() and plain_state
    for key, value in plain_state.items():
        assert torch.equal(value, probed_state[key]), key
    # It did probe: every shard has a figure per window, and t2 (pooling 12) costs most.
    assert probe.windows == 6
    costs = {(c.table, c.col_offset): c for c in probe.shard_costs(2.0)}
    assert set(costs) == {("t0", 0), ("t1", 0), ("t1", 16), ("t2", 0), ("t3", 0)}
    assert all(c.samples == 6 and c.ms >= 0 for c in costs.values())
    # Row-wise Adagrad: each call ran the zero-gradient backward too (and, above, it
    # changed no weight and no optimizer state), so the figure is the timed one.
    assert all(k.backward for k in probe.kernels)
    timed = probe.forward_seconds()
    assert costs[("t2", 0)].ms == pytest.approx(1e3 * timed[("t2", 0, 0)])
    # The empty call (every bag empty) is each window's reference: the kernels' own
    # fixed work, reported for the live fit. It is timed, and forward + backward ran.
    assert probe.empty_ms(2.0) > 0 and probe.empty_ms(2.0) == probe.empty_ms(5.0)


@pytest.mark.slow
def test_row_wise_and_data_parallel_shards_are_probed_in_their_own_kernels(
    one_rank: None,
) -> None:
    """t1 row-wise (one rank: one range, every row) and t3 data-parallel: each runs in a
    kernel of its own kind, keyed with its rows; the data-parallel table's dense kernel
    is timed forward only (its backward would leave DDP a gradient), and probing every
    step still changes no loss and no weight."""
    plan = _plan([None, "row_wise", None, "data_parallel"])
    plain, plain_state, _ = _train(4, probe_on=False, plan=plan)
    probed, probed_state, probe = _train(4, probe_on=True, plan=plan)
    assert probed == plain
    for key, value in plain_state.items():
        assert torch.equal(value, probed_state[key]), key
    kernels = {k.shards[0].table: k for k in probe.kernels if len(k.shards) == 1}
    assert type(kernels["t3"].kernel).__name__ == "DenseTableBatchedEmbeddingBagsCodegen"
    assert not kernels["t3"].backward and kernels["t1"].backward
    costs = {(c.table, c.row_offset, c.col_offset): c for c in probe.shard_costs(2.0)}
    assert set(costs) == {("t0", 0, 0), ("t1", 0, 0), ("t2", 0, 0), ("t3", 0, 0)}
    assert (costs["t1", 0, 0].rows, costs["t3", 0, 0].rows) == (TABLES[1].rows, TABLES[3].rows)
    # forward only, its backward priced at the rank's ratio (2.0 here)
    timed = probe.forward_seconds()
    assert costs["t3", 0, 0].ms == pytest.approx(3e3 * timed[("t3", 0, 0)])
    # The dense kernel's empty call is timed forward only too: priced at the ratio.
    assert probe.empty_ms(5.0) > probe.empty_ms(2.0) > 0


@pytest.mark.slow
def test_the_budget_decides_the_windows(one_rank: None) -> None:
    """No window before a figure to estimate it by, none beyond 1 % of the training
    time, and a window cut short by the budget still counts its seconds."""
    dmp = _dmp()
    probe = ShardProbe(sharded_collection(dmp), rank=0)
    assert not probe.allowed(None)  # nothing measured yet
    probe.train_seconds = 1.0
    assert probe.allowed(0.003)  # 2 × 3 ms ≤ 3/4 of 10 ms
    assert not probe.allowed(0.004)  # 8 ms > 7.5 ms
    data = SyntheticData(TABLES, BATCH, 13, seed=0)
    dense, kjt, _ = data.batch(1, 0)
    probe.train_seconds = 1e-5  # a budget of 0.1 µs: the first call is made, no other
    probe.start_step(True)
    with torch.no_grad():
        dmp(dense, kjt)
    assert probe.finish_step()
    assert probe.windows == 1 and probe.seconds > 0
    assert probe.stats().overhead > 0.01  # the one call's misestimate, then no more:
    assert not probe.allowed(0.004)
    probe.start_step(False)
    with torch.no_grad():
        dmp(dense, kjt)
    assert not probe.finish_step()
