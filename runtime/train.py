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
off). When the operator names a live ConfigMap ($SHARDWISE_LIVE_CONFIGMAP), every rank's
measured cost and its shards' probed costs are gathered every --report-every steps and
rank 0 writes them there (the live summary the operator reshards by).

This is the worker image's default entry; to train a model of your own the same way,
call shardwise.runtime.trainer (see examples/train_dlrm.py).
"""

from __future__ import annotations

# ruff: noqa: E402  (imports follow the stop handler on purpose)
# The stop handler goes in before anything slow (torch takes seconds to import): from
# here on a SIGTERM ends the run at a step boundary. It also keeps this rank alive when
# torchrun terminates it because a peer failed, so it can print its own error first.
from shardwise.runtime.stop import GracefulStop

STOP = GracefulStop().install()

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.tables import TableSpec, load_tables
from shardwise.runtime.dlrm import SyntheticData, build_model, drifted_specs, parse_pooling
from shardwise.runtime.live_report import DEFAULT_MIN_INTERVAL, DEFAULT_REPORT_EVERY
from shardwise.runtime.options import (
    DEFAULT_CHECKPOINT_EVERY,
    MINIMUMS,
    Batches,
    TrainOptions,
    Worker,
)
from shardwise.runtime.sharding import EmbeddingOptimizer
from shardwise.runtime.trainer import run

PROG = "python -m shardwise.runtime.train"

EXAMPLES = """\
examples:
  # small tables, a CPU plan for 2 ranks, then train on 2 CPU ranks (gloo)
  shardwise tables generate --count 8 --seed 0 --out tables.yaml   # or write your own
  shardwise plan tables.yaml --gpus 2 --target-device cpu --batch-per-rank 512 --out plan.json
  SHARDWISE_PLAN=plan.json torchrun --nproc_per_node=2 -m shardwise.runtime.train \\
      --tables tables.yaml --steps 200 --checkpoint-dir ckpt

  # resume the same run on 3 ranks with a plan made for 3
  shardwise plan tables.yaml --gpus 3 --target-device cpu --batch-per-rank 512 --out plan3.json
  SHARDWISE_PLAN=plan3.json torchrun --nproc_per_node=3 -m shardwise.runtime.train \\
      --tables tables.yaml --steps 400 --checkpoint-dir ckpt

  # in a pod (the worker image's command): SIGTERM -> checkpoint -> exit 0
  python -m shardwise.runtime.launch --nproc_per_node=$GPUS -m shardwise.runtime.train ...

Tables must be exactly the specs the plan was made from (names, rows, dims, dtype).
--generate COUNT --table-seed S gives the same specs as
`shardwise tables generate --count COUNT --seed S` (full-size tables: up to 10^7 rows).

environment (seconds; every wait on a peer is bounded, since a lost peer never answers):
  SHARDWISE_STOP_TIMEOUT        after SIGTERM, the wait for a step boundary agreed with
                                every peer before the rank exits 124 (10; 0: no bound)
  SHARDWISE_COLLECTIVE_TIMEOUT  a training collective waiting on a peer fails after (60)
  SHARDWISE_CHECKPOINT_TIMEOUT  setup and checkpoint collectives (300): file I/O
  SHARDWISE_RDZV_TIMEOUT        torchrun's rendezvous store reads, set by the launcher (60)

the live summary (set by the operator; unset: nothing is gathered or written):
  SHARDWISE_LIVE_CONFIGMAP      the ConfigMap rank 0 writes live.json to, in
                                SHARDWISE_NAMESPACE, through the pod's service account
                                (get, patch on configmaps) or $KUBECONFIG
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
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

    drift = p.add_argument_group(
        "data drift: the lookups drawn from other specs than the declared ones, as real "
        "data drift from the pooling factors and histograms a job declared (the plan "
        "stays the declared specs')"
    )
    drift.add_argument(
        "--data-tables",
        type=Path,
        metavar="FILE",
        help="draw the synthetic lookups from these specs: the same tables, rows, widths "
        "and dtypes as the declared ones; only pooling_factor and access_hist may differ",
    )
    drift.add_argument(
        "--data-pooling",
        action="append",
        type=parse_pooling,
        metavar="NAME=FACTOR[,NAME=FACTOR...]",
        help="multiply the pooling factor of the named tables by FACTOR (after "
        "--data-tables), e.g. table_0003=8: a table read more than declared",
    )

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
        "--report-every",
        type=int,
        default=DEFAULT_REPORT_EVERY,
        metavar="N",
        help="with $SHARDWISE_LIVE_CONFIGMAP set: gather every rank's measured cost every "
        "N steps and have rank 0 write the live summary there (default %(default)s; 0: "
        "never). Unset, nothing is gathered or written",
    )
    obs.add_argument(
        "--probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while reporting, time each shard on the real batch in probe windows kept "
        "within 1%% of the training time (default: on). Its backward runs on a zero "
        "gradient (exact SGD or row-wise Adagrad: no weight moves); with another "
        "optimizer it is priced by the sampled bwd/fwd ratio, which needs --measure-every "
        "above 0",
    )
    obs.add_argument(
        "--report-min-interval",
        type=float,
        default=DEFAULT_MIN_INTERVAL,
        metavar="SECONDS",
        help="rank 0 writes the live summary at most this often (default %(default)s; the "
        "last write, before a stop's checkpoint and at the end, always goes out)",
    )
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
    for name, low in MINIMUMS:
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error("--batch-size must be at least 1")
    return args


def options(args: argparse.Namespace) -> TrainOptions:
    """The flags as the trainer's options."""
    return TrainOptions(
        plan=args.plan,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        embedding_optimizer=EmbeddingOptimizer(args.embedding_optimizer, lr=args.embedding_lr),
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=not args.no_resume,
        checkpoint_extra={"seed": args.seed, "dense_features": args.dense_features},
        measure_every=args.measure_every,
        log_every=args.log_every,
        report_every=args.report_every,
        probe=args.probe,
        report_min_interval=args.report_min_interval,
        check_unsharded=args.check_unsharded,
        export_start=args.export_start,
        export_end=args.export_end,
        summary=args.summary,
    )


def data_specs(args: argparse.Namespace, declared: list[TableSpec]) -> list[TableSpec]:
    """The specs the lookups are drawn from: the declared ones unless the data drift."""
    pooling = {k: v for item in args.data_pooling or [] for k, v in item.items()}
    if args.data_tables is None and not pooling:
        return declared
    drawn = load_tables(args.data_tables) if args.data_tables is not None else None
    return drifted_specs(declared, drawn, pooling, source=str(args.data_tables or "--data-tables"))


def read_tables(args: argparse.Namespace) -> list[TableSpec]:
    if args.tables is not None:
        return load_tables(args.tables)
    from shardwise.planner.synthetic import generate_tables

    if args.generate < 1:
        raise UserError("--generate needs at least 1 table.")
    return generate_tables(args.generate, args.table_seed)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = parse_args(argv)

    def model(worker: Worker, embedding_device: torch.device, dense: torch.device) -> nn.Module:
        return build_model(worker.tables, args.dense_features, embedding_device, dense)

    drawn: list[TableSpec] = []

    def tables() -> list[TableSpec]:
        declared = read_tables(args)
        drawn[:] = data_specs(args, declared)  # checked before any collective
        return declared

    def data(worker: Worker) -> Batches:
        synthetic = SyntheticData(drawn, worker.batch_size, args.dense_features, args.seed)
        return lambda step: synthetic.batch(step, worker.env.rank)

    run(tables, model, data, options(args), stop=STOP)


if __name__ == "__main__":
    main()
