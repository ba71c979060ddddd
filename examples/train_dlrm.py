#!/usr/bin/env python
"""Train a TorchRec DLRM on synthetic data, sharded by the plan Shardwise injected.

Run one process per GPU (or per CPU rank) with torchrun. Every rank reads the same
plan.json ($SHARDWISE_PLAN or --plan), checks it against the tables and the world
size (a mismatch stops every rank with the same message, exit 2), builds TorchRec's
ShardingPlan from it and trains DistributedModelParallel. No rank re-plans.

The data are synthetic but learnable: lookups follow each table's spec (rows, pooling
factor, access histogram, via shardwise's stream generator), and the label is a fixed
function of the dense features and of the rows looked up, so the loss falls.

Checkpoints (torch.distributed.checkpoint) go to --checkpoint-dir and resume from it
automatically, at any world size and with any plan for the same tables (ranks left
without a table included). SIGTERM (or Ctrl-C) finishes the current step, checkpoints
and exits 0. When a peer is gone (its node froze or lost power) no step can finish:
then a rank gives up $SHARDWISE_STOP_TIMEOUT seconds after the signal (default 10) and
exits 124 without a checkpoint, so the work since the last checkpoint is lost:
--checkpoint-every bounds it. Each rank exports its measured embedding cost on a
Prometheus endpoint ($SHARDWISE_METRICS_PORT + local rank, default 9400; 0 turns it
off).
"""

from __future__ import annotations

# ruff: noqa: E402  (imports follow the stop handler on purpose)
# The stop handler goes in before anything slow (torch takes seconds to import): from
# here on a SIGTERM ends the run at a step boundary. It also keeps this rank alive when
# torchrun terminates it because a peer failed, so it can print its own error first.
from shardwise.planner.runtime.stop import GracefulStop

STOP = GracefulStop().install()

import argparse
import datetime
import json
import math
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DenseArch, InteractionArch, OverArch
from torchrec.modules.embedding_configs import DataType

from shardwise.planner.errors import UserError
from shardwise.planner.plan import Plan
from shardwise.planner.runtime import checkpoint as ckpt
from shardwise.planner.runtime.env import Timeouts, WorkerEnv
from shardwise.planner.runtime.metrics import EmbeddingTimer, WorkerMetrics
from shardwise.planner.runtime.plancheck import load_worker_plan
from shardwise.planner.runtime.sharding import (
    EmbeddingOptimizer,
    backend_for,
    dense_optimizer,
    shard_model,
    sharded_collection,
    worker_device,
)
from shardwise.planner.runtime.stop import write_stop_marker
from shardwise.planner.runtime.weights import (
    gather_fused_optimizer_state,
    gather_state_dict,
    load_full_state_dict,
)
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec, load_tables

# TorchRec 1.8 hands out a sharded EmbeddingBagCollection's tables as ShardedTensors,
# which torch marks deprecated on every access; the warning is not ours to act on.
warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)

EXAMPLES = """\
examples:
  # small tables, a CPU plan for 2 ranks, then train on 2 CPU ranks (gloo)
  shardwise tables generate --count 8 --seed 0 --out tables.yaml   # or write your own
  shardwise plan tables.yaml --gpus 2 --device cpu --batch-size 512 --out plan.json
  SHARDWISE_PLAN=plan.json torchrun --nproc_per_node=2 examples/train_dlrm.py \\
      --tables tables.yaml --steps 200 --checkpoint-dir ckpt

  # resume the same run on 3 ranks with a plan made for 3
  shardwise plan tables.yaml --gpus 3 --device cpu --batch-size 512 --out plan3.json
  SHARDWISE_PLAN=plan3.json torchrun --nproc_per_node=3 examples/train_dlrm.py \\
      --tables tables.yaml --steps 400 --checkpoint-dir ckpt

  # in a pod (the worker image's command): SIGTERM -> checkpoint -> exit 0
  python -m shardwise.planner.runtime.launch --nproc_per_node=$GPUS examples/train_dlrm.py ...

Tables must be exactly the specs the plan was made from (names, rows, dims, dtype).
--generate COUNT --table-seed S gives the same specs as
`shardwise tables generate --count COUNT --seed S` (full-size tables: up to 10^7 rows).

environment (seconds; every wait on a peer is bounded, since a lost peer never answers):
  SHARDWISE_STOP_TIMEOUT        after SIGTERM, the wait for a step boundary agreed with
                                every peer before the rank exits 124 (10; 0: no bound)
  SHARDWISE_COLLECTIVE_TIMEOUT  a training collective waiting on a peer fails after (60)
  SHARDWISE_CHECKPOINT_TIMEOUT  setup and checkpoint collectives (300): file I/O
  SHARDWISE_RDZV_TIMEOUT        torchrun's rendezvous store reads, set by the launcher (60)
"""


#: A hard node loss costs at most this many steps (a save every few minutes at most on
#: GPUs, every 10-30 s on CPU); a save takes well under a second for small tables.
DEFAULT_CHECKPOINT_EVERY = 500


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train_dlrm.py",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("tables: the same specs the plan was made from")
    which = src.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--tables", type=Path, metavar="FILE", help="table specs (.yaml, .json or .csv)"
    )
    which.add_argument(
        "--generate",
        type=int,
        metavar="COUNT",
        help="generate COUNT synthetic tables, as `shardwise tables generate` does",
    )
    src.add_argument(
        "--table-seed", type=int, default=0, help="generator seed for --generate (default 0)"
    )
    p.add_argument("--plan", type=Path, metavar="FILE", help="plan.json (default: $SHARDWISE_PLAN)")

    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="train until this step (default 100)")
    train.add_argument(
        "--batch-size",
        type=int,
        help="samples per rank and step (default: the plan's batch_size_per_rank, so the "
        "measured cost is comparable with the plan's prediction)",
    )
    train.add_argument(
        "--lr", type=float, default=0.05, help="dense layers' Adagrad learning rate (0.05)"
    )
    train.add_argument(
        "--embedding-lr",
        type=float,
        default=0.05,
        help="learning rate of the optimizer fused into the embedding kernels (0.05)",
    )
    train.add_argument(
        "--embedding-optimizer",
        choices=("rowwise_adagrad", "sgd"),
        default="rowwise_adagrad",
        help="fused embedding optimizer: EXACT_ROWWISE_ADAGRAD (as the profiler times it) "
        "or EXACT_SGD (no optimizer state)",
    )
    train.add_argument("--dense-features", type=int, default=13, help="dense inputs (13)")
    train.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )

    ck = p.add_argument_group("checkpoints")
    ck.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="save here (shared by all ranks, e.g. a PVC) and resume from its latest "
        "checkpoint, whatever world size and plan wrote it",
    )
    ck.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_CHECKPOINT_EVERY,
        metavar="N",
        help="also save every N steps (default %(default)s; 0: only at the end and on "
        "SIGTERM). This is the bound on lost work: a stop signal checkpoints the step it "
        "ends, but when a node fails hard (no signal, or a peer gone so no step can finish) "
        "training resumes from the last checkpoint, up to N steps back. Each save pauses "
        "every rank for its duration (printed).",
    )
    ck.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default 2)")
    ck.add_argument("--no-resume", action="store_true", help="start afresh even if DIR has one")

    obs = p.add_argument_group("measurement and checks")
    obs.add_argument(
        "--measure-every",
        type=int,
        default=10,
        metavar="N",
        help="time the embedding phases every N steps (default 10; 0: off)",
    )
    obs.add_argument("--log-every", type=int, default=10, metavar="N", help="print every N steps")
    obs.add_argument(
        "--check-unsharded",
        action="store_true",
        help="before training, copy an unsharded model's weights into the sharded one and "
        "check both give the same output; training then starts from those weights (every "
        "rank holds every table: small tables only; not with a resume)",
    )
    obs.add_argument(
        "--export-start",
        type=Path,
        metavar="FILE",
        help="rank 0 writes every table in full, the dense weights and the embedding "
        "optimizer state here before the first step (after a resume: what was loaded)",
    )
    obs.add_argument("--export-end", type=Path, metavar="FILE", help="the same after the last step")
    obs.add_argument(
        "--summary", type=Path, metavar="FILE", help="rank 0 writes a JSON run summary here"
    )
    args = p.parse_args(argv)
    for name, low in (("steps", 0), ("checkpoint_every", 0), ("keep", 1), ("measure_every", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error("--batch-size must be at least 1")
    return args


def read_tables(args: argparse.Namespace) -> list[TableSpec]:
    if args.tables is not None:
        return load_tables(args.tables)
    from shardwise.planner.synthetic import generate_tables

    if args.generate < 1:
        raise UserError("--generate needs at least 1 table.")
    return generate_tables(args.generate, args.table_seed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(env: WorkerEnv, message: str, *, err: bool = False) -> None:
    print(f"{env.tag} {message}", file=sys.stderr if err else sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env = WorkerEnv.from_environ()
        timeouts = Timeouts.from_environ()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        tables = read_tables(args)
        # Before any collective: every rank reads the same plan and fails alike.
        plan = load_worker_plan(tables, env, args.plan)
    except UserError as e:
        say(env, f"error: {e}", err=True)
        return 2
    device = worker_device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "MASTER_ADDR" not in os.environ:  # run without torchrun: one rank, a local store
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    # Two groups of every rank: the default one for setup and checkpoints (waits on the
    # slowest rank's file I/O), and one for training collectives, whose timeout is many
    # steps, not torch's 30 minutes: a rank never sits for long on a peer that is gone.
    dist.init_process_group(
        backend_for(device),
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeouts.checkpoint),
    )
    try:
        training = dist.new_group(timeout=datetime.timedelta(seconds=timeouts.collective))
        code = train(args, env, tables, plan, device, training)
    except UserError as e:  # e.g. the model does not match the plan: every rank alike
        say(env, f"error: {e}", err=True)
        code = 2
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        dist.destroy_process_group()
    # A plain interpreter exit sometimes aborts in gloo/fbgemm teardown. After an error
    # the peers may be gone, so no collective (not even destroy) is attempted.
    os._exit(code)


# --------------------------------------------------------------------------- the model


def embedding_configs(tables: Sequence[TableSpec]) -> list[EmbeddingBagConfig]:
    """One table per feature, named like the spec: the plan's names are the EBC's."""
    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[t.name],
            data_type=DataType.FP16 if t.dtype == "fp16" else DataType.FP32,
        )
        for t in tables
    ]


class ProjectedSparseArch(nn.Module):
    """DLRM's sparse arch for tables of mixed widths: each table's pooled embedding is
    projected to one width (a bias-free linear map, trained with the dense layers)."""

    def __init__(self, ebc: EmbeddingBagCollection, dim: int, device: torch.device) -> None:
        super().__init__()
        self.embedding_bag_collection = ebc
        configs = ebc.embedding_bag_configs()
        self.names = [c.name for c in configs]
        self.projections = nn.ModuleDict(
            {c.name: nn.Linear(c.embedding_dim, dim, bias=False, device=device) for c in configs}
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.stack([self.projections[n](pooled[n]) for n in self.names], dim=1)


class ProjectedDLRM(nn.Module):
    """``torchrec.models.dlrm.DLRM`` with :class:`ProjectedSparseArch`; its other parts
    (``DenseArch``, ``InteractionArch``, ``OverArch``) are TorchRec's."""

    def __init__(
        self, ebc: EmbeddingBagCollection, dense_in: int, dim: int, device: torch.device
    ) -> None:
        super().__init__()
        num_sparse = len(ebc.embedding_bag_configs())
        self.dense_arch = DenseArch(dense_in, [64, dim], device=device)
        self.sparse_arch = ProjectedSparseArch(ebc, dim, device)
        self.inter_arch = InteractionArch(num_sparse_features=num_sparse)
        over_in = dim + num_sparse * (num_sparse - 1) // 2 + num_sparse
        self.over_arch = OverArch(over_in, [64, 32, 1], device=device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> Any:
        dense = self.dense_arch(dense_features)
        sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=dense, sparse_features=sparse))


def build_model(
    tables: Sequence[TableSpec], dense_features: int, device: torch.device, *, sharded: bool
) -> nn.Module:
    """TorchRec's DLRM with its EmbeddingBagCollection at
    ``sparse_arch.embedding_bag_collection``, the module path plans are keyed by.

    ``sharded``: the collection goes on the meta device (DMP allocates only this rank's
    shards); otherwise real tables on ``device`` (the unsharded reference). DLRM needs
    one width for all tables; with mixed widths, :class:`ProjectedDLRM`."""
    ebc = EmbeddingBagCollection(
        embedding_configs(tables), device=torch.device("meta") if sharded else device
    )
    widths = sorted({t.dim for t in tables})
    if len(widths) == 1:
        model: nn.Module = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dense_features,
            dense_arch_layer_sizes=[64, widths[0]],
            over_arch_layer_sizes=[64, 32, 1],
            dense_device=device,
        )
        return model
    return ProjectedDLRM(ebc, dense_features, widths[-1], device)


# --------------------------------------------------------------------------- the data


class SyntheticData:
    """Learnable batches: lookups drawn from each table's spec, labels a fixed function.

    Every row of every table has a hidden score in [-1, 1] (a hash of the row); a
    sample's label is 1 when ``dense · w + 2 · (sum over tables of the mean score of its
    rows) / sqrt(tables)`` is positive. Deterministic in (seed, step, rank), so a
    resumed run sees the batches an uninterrupted one would have seen.
    """

    def __init__(
        self, tables: Sequence[TableSpec], batch_size: int, dense_features: int, seed: int
    ) -> None:
        self.tables = list(tables)
        self.batch_size = batch_size
        self.seed = seed
        rng = np.random.default_rng([seed, 0x5EED])
        w = rng.standard_normal(dense_features)
        self.dense_weights = w / np.linalg.norm(w)
        self.dense_features = dense_features
        self.salts = [int(x) for x in rng.integers(0, 2**31, len(self.tables))]

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        seed = (self.seed * 1_000_003 + step) * 65_537 + rank
        rng = np.random.default_rng([seed, 1])
        b = self.batch_size
        dense = rng.standard_normal((b, self.dense_features)).astype(np.float32)
        score = np.zeros(b)
        lengths, values = [], []
        for spec, salt in zip(self.tables, self.salts, strict=True):
            lens, idx = stream_from_spec(spec, b, seed)
            lengths.append(lens)
            values.append(idx)
            hashed = (idx.astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt)) % (2**32)
            row_score = hashed.astype(np.float64) / 2**31 - 1.0
            sums = np.bincount(np.repeat(np.arange(b), lens), weights=row_score, minlength=b)
            score += sums / np.maximum(lens, 1)
        logit = dense @ self.dense_weights + 2.0 * score / math.sqrt(len(self.tables))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[t.name for t in self.tables],
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        labels = torch.from_numpy((logit > 0).astype(np.float32))
        return torch.from_numpy(dense), kjt, labels


# --------------------------------------------------------------------------- training


def train(
    args: argparse.Namespace,
    env: WorkerEnv,
    tables: list[TableSpec],
    plan: Plan,
    device: torch.device,
    group: Any,
) -> int:
    batch_size = args.batch_size or plan.topology.batch_size_per_rank
    torch.manual_seed(args.seed)
    model = build_model(tables, args.dense_features, device, sharded=True)
    # The runtime checks the model against the plan, builds TorchRec's ShardingPlan for
    # this device and wraps the model in DistributedModelParallel.
    dmp = shard_model(
        model,
        plan,
        device,
        optimizer=EmbeddingOptimizer(args.embedding_optimizer, lr=args.embedding_lr),
        local_world_size=env.local_world_size,
        group=group,
    )
    optimizer = dense_optimizer(dmp, args.lr)
    data = SyntheticData(tables, batch_size, args.dense_features, args.seed)
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "plan_hash": plan.hash,
        "batch_size": batch_size,
        "device": str(device),
    }

    start = 0
    root: Path | None = args.checkpoint_dir
    latest = ckpt.latest_checkpoint(root) if root and not args.no_resume else None
    if latest is not None and args.check_unsharded:
        raise UserError(
            f"--check-unsharded would overwrite the weights resumed from {latest}; "
            "use it on a fresh start (or with --no-resume)."
        )
    if latest is not None:
        t0 = time.perf_counter()
        meta, notes = ckpt.load_checkpoint(latest, dmp, optimizer, plan)
        start = meta.step
        STOP.last_checkpoint = str(latest)
        summary |= {
            "resumed_from": str(latest),
            "resumed_world_size": meta.world_size,
            "load_seconds": time.perf_counter() - t0,
            "optimizer_notes": notes,
        }
        if env.rank == 0:
            say(env, f"resumed {ckpt.describe(meta)} in {summary['load_seconds']:.2f} s")
            for note in notes:
                say(env, f"note: {note}")
    if args.check_unsharded:
        summary["unsharded_max_abs_err"] = check_unsharded(dmp, tables, args, data, env, device)
    if args.export_start:
        export(dmp, optimizer, args.export_start, env, start, plan)

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, namespace=env.namespace, job=env.job, rank=env.rank)
    metrics.set_info(
        plan_hash=plan.hash,
        planner=plan.planner,
        world_size=env.world_size,
        device=device.type,
        batch_size=batch_size,
    )
    metrics.serve(env.rank_metrics_port)
    timer = EmbeddingTimer(
        sharded_collection(dmp), every=args.measure_every, cuda=device.type == "cuda"
    )
    if not timer.kernels:
        say(env, "note: this rank holds no embedding kernel; it samples no embedding cost")
    loss_fn = nn.BCEWithLogitsLoss()
    losses: list[tuple[int, float]] = []
    saved: list[str] = []
    last_saved = start
    stopped: str | None = None
    step = start
    train_seconds = 0.0
    for step in range(start + 1, args.steps + 1):
        dense, kjt, labels = data.batch(step, env.rank)
        dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
        t0 = time.perf_counter()
        timer.start_step(step)
        logits = dmp(dense, kjt).squeeze(-1)
        loss = loss_fn(logits, labels)
        loss.backward()  # the embeddings' optimizer runs inside backward (fused)
        optimizer.step()
        optimizer.zero_grad()
        sample = timer.finish_step()
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        value = float(loss.item())
        losses.append((step, value))
        metrics.observe_step(seconds, value)
        if sample is not None:
            metrics.observe_cost(sample)
        if env.rank == 0 and args.log_every and step % args.log_every == 0:
            say(env, f"step {step} loss {value:.4f} {1e3 * seconds:.1f} ms/step")
        stop_now = STOP.should_stop(group)  # a collective: every rank stops at the same step
        due = args.checkpoint_every > 0 and step % args.checkpoint_every == 0
        if root is not None and (stop_now or due):
            reason = "stop" if stop_now else "interval"
            saved.append(str(save(dmp, optimizer, plan, root, step, args, env, reason)))
            last_saved = step
        if stop_now:
            stopped = STOP.signal_name
            break
    if root is not None and step > last_saved:
        saved.append(str(save(dmp, optimizer, plan, root, step, args, env, "final")))
    if stopped is not None or STOP.requested:  # a signal, even one during the last step
        reason = stopped or STOP.signal_name or "signal"
        write_stop_marker(
            env.rank, env.local_world_size, step, saved[-1] if saved else None, reason
        )
        if env.rank == 0:
            say(env, f"stopped by {reason} after step {step}; checkpoint {saved[-1:]}")
    if args.export_end:
        export(dmp, optimizer, args.export_end, env, step, plan)
    timer.close()
    summary |= {
        "start_step": start,
        "end_step": step,
        "losses": losses,
        "checkpoints": saved,
        "stopped": stopped,
        "steps_per_second": (step - start) / train_seconds if train_seconds > 0 else None,
        "cost_medians": metrics.medians(),
    }
    dist.barrier()
    if args.summary and env.rank == 0:
        args.summary.write_text(json.dumps(summary, indent=1))
    return 0


def save(
    dmp: Any,
    optimizer: Any,
    plan: Plan,
    root: Path,
    step: int,
    args: argparse.Namespace,
    env: WorkerEnv,
    reason: str,
) -> Path:
    t0 = time.perf_counter()
    with STOP.checkpointing():  # a signal meanwhile waits for this save, then stops
        path = ckpt.save_checkpoint(
            root,
            step,
            dmp,
            optimizer,
            plan,
            reason=reason,
            keep=args.keep,
            extra={"seed": args.seed, "dense_features": args.dense_features},
        )
    STOP.last_checkpoint = str(path)
    if env.rank == 0:
        say(env, f"checkpoint {path} ({reason}) in {time.perf_counter() - t0:.2f} s")
    return path


def check_unsharded(
    dmp: Any,
    tables: Sequence[TableSpec],
    args: argparse.Namespace,
    data: SyntheticData,
    env: WorkerEnv,
    device: torch.device,
) -> float:
    """Give the sharded model an unsharded one's weights and compare their outputs on
    each rank's batch: the largest difference over all ranks."""
    torch.manual_seed(args.seed + 1)  # the same full weights on every rank
    reference = build_model(tables, args.dense_features, torch.device("cpu"), sharded=False)
    load_full_state_dict(dmp, reference.state_dict())
    dense, kjt, _ = data.batch(0, env.rank)
    with torch.no_grad():
        got = dmp(dense.to(device), kjt.to(device)).cpu()
        want = reference(dense, kjt)
    err = torch.tensor([float((got - want).abs().max())], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if env.rank == 0:
        say(env, f"sharded vs unsharded forward: max |difference| {float(err):.3g}")
    return float(err)


def export(dmp: Any, optimizer: Any, path: Path, env: WorkerEnv, step: int, plan: Plan) -> None:
    """Rank 0 writes the full model and both optimizers' state (a collective)."""
    state = gather_state_dict(dmp)
    embedding_state = gather_fused_optimizer_state(dmp)
    if env.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "step": step,
                "plan_hash": plan.hash,
                "model": state,
                "embedding_optimizer": embedding_state,
                "dense_optimizer": optimizer.state_dict()["state"],  # replicated
            },
            path,
        )


if __name__ == "__main__":
    sys.exit(main())
