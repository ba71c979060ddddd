#!/usr/bin/env python
"""Train a model of your own, sharded by the plan Shardwise injected.

The runtime (shardwise.runtime.trainer) reads the plan ($SHARDWISE_PLAN), checks it
against the tables and the world size, builds TorchRec's DistributedModelParallel from
it, checkpoints and resumes (any world size, any plan for the same tables), stops
cleanly on SIGTERM and exports the measured embedding cost. This script brings the
rest: a small model whose EmbeddingBagCollection sits at `embeddings`, and its data.

  shardwise tables generate --count 4 --seed 0 --out tables.yaml
  shardwise plan tables.yaml --gpus 2 --target-device cpu --batch-per-rank 256 --out plan.json
  SHARDWISE_PLAN=plan.json torchrun --nproc_per_node=2 examples/train_dlrm.py \\
      --tables tables.yaml --steps 50 --checkpoint-dir ckpt

The worker image's default entry trains TorchRec's DLRM the same way, with every
option as a flag: python -m shardwise.runtime.train --help.
"""

from __future__ import annotations

# ruff: noqa: E402  (the stop handler goes in before torch is imported: a SIGTERM from
# here on ends the run at a step boundary, after a checkpoint)
from shardwise.runtime.stop import GracefulStop

STOP = GracefulStop().install()

import argparse
from pathlib import Path

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

from shardwise.planner.tables import TableSpec
from shardwise.planner.torchrec_plan import embedding_bag_configs
from shardwise.runtime.trainer import Batch, Batches, TrainOptions, Worker, run

DENSE = 4


class TinyRec(nn.Module):
    """Every table's pooled embedding and the dense features, through a small MLP."""

    def __init__(
        self, tables: list[TableSpec], embedding_device: torch.device, dense_device: torch.device
    ) -> None:
        super().__init__()
        # one table per spec, named like it (what the plan is checked against)
        self.embeddings = EmbeddingBagCollection(
            embedding_bag_configs(tables), device=embedding_device
        )
        width = DENSE + sum(t.dim for t in tables)
        self.mlp = nn.Sequential(
            nn.Linear(width, 32, device=dense_device),
            nn.ReLU(),
            nn.Linear(32, 1, device=dense_device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embeddings(sparse).values()
        return self.mlp(torch.cat([dense, pooled.float()], dim=1))


def batches(worker: Worker) -> Batches:
    """Two lookups per sample and table; the label depends on the first table's rows."""
    tables, size = worker.tables, worker.batch_size

    def batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step * 1_000 + worker.env.rank)
        dense = torch.randn(size, DENSE, generator=gen)
        ids = [torch.randint(0, t.rows, (size * 2,), generator=gen) for t in tables]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[t.name for t in tables],
            values=torch.cat(ids),
            lengths=torch.full((size * len(tables),), 2, dtype=torch.int32),
        )
        labels = ((ids[0][::2] % 2 == 0) ^ (dense[:, 0] > 1)).float()
        return dense, sparse, labels

    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=Path, required=True, help="the specs the plan was made from")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, help="per rank (default: the plan's)")
    p.add_argument("--checkpoint-dir", type=Path, help="save and resume here (shared)")
    p.add_argument("--summary", type=Path, help="rank 0 writes a JSON run summary here")
    args = p.parse_args()
    options = TrainOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        module_path="embeddings",  # where TinyRec keeps its EmbeddingBagCollection
        checkpoint_dir=args.checkpoint_dir,
        summary=args.summary,
    )
    run(
        args.tables,
        lambda worker, emb, dense: TinyRec(worker.tables, emb, dense),
        batches,
        options,
        stop=STOP,
    )


if __name__ == "__main__":
    main()
