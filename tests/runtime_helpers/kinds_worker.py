"""A torchrun worker that trains a bare EmbeddingBagCollection sharded by a plan through
the runtime's own ``shard_model`` and ``dense_optimizer``, then writes the full tables.

argv: plan.json, out.pt, steps, optimizer (``rowwise_adagrad`` or ``sgd``), lr, and
optionally the ranks per host to present to TorchRec (``LOCAL_WORLD_SIZE`` and
``LOCAL_RANK`` rewritten, so one machine plays several hosts). Rank 0 writes
``{"start": full tables, "end": full tables}``. The batches and the loss are
:func:`batch` and :func:`loss_of`, which the test replays on an unsharded copy.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

BATCH = 6


def batch(tables: Any, rank: int, step: int) -> Any:
    """Rank ``rank``'s sparse batch of ``step``: 0-3 ids per bag, any row."""
    import torch
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    keys = [t.name for t in tables]
    lengths = torch.randint(0, 4, (len(keys) * BATCH,), generator=gen)
    counts = lengths.view(len(keys), BATCH).sum(dim=1).tolist()
    values = torch.cat(
        [
            torch.randint(0, t.rows, (int(n),), generator=gen)
            for t, n in zip(tables, counts, strict=True)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def loss_of(pooled: Any, tables: Any) -> Any:
    """A loss that weighs every column differently (a wrong column slice shows)."""
    import torch

    out = pooled.to_dict()
    total = torch.zeros(())
    for i, t in enumerate(tables):
        w = torch.arange(t.dim, dtype=torch.float32).add(1 + i).div(t.dim)
        total = total + (out[t.name].float() * w).pow(2).sum()
    return total


def main() -> int:
    plan_path, out, steps, opt, lr = sys.argv[1:6]
    if len(sys.argv) > 6:  # play hosts of this many ranks (TorchRec reads these)
        local = int(sys.argv[6])
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % local)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchrec import EmbeddingBagCollection

    from shardwise.planner.plan import load_plan
    from shardwise.planner.torchrec_plan import embedding_bag_configs
    from shardwise.runtime.sharding import EmbeddingOptimizer, dense_optimizer, shard_model
    from shardwise.runtime.weights import gather_state_dict, load_full_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = load_plan(plan_path)
    configs = embedding_bag_configs(plan.tables)

    class Model(nn.Module):
        def __init__(self, device: torch.device) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(configs, device=device)

        def forward(self, kjt: Any) -> Any:
            return self.ebc(kjt)

    torch.manual_seed(0)
    full = Model(torch.device("cpu")).state_dict()
    dmp = shard_model(
        Model(torch.device("meta")),
        plan,
        torch.device("cpu"),
        optimizer=EmbeddingOptimizer(name=opt, lr=float(lr)),  # type: ignore[arg-type]
        module_path="ebc",
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
    )
    load_full_state_dict(dmp, full)
    dense = dense_optimizer(dmp, float(lr))
    for step in range(1, int(steps) + 1):
        loss_of(dmp(batch(plan.tables, rank, step)), plan.tables).backward()
        dense.step()
        dense.zero_grad()
    end = gather_state_dict(dmp)
    if rank == 0:
        torch.save({"start": full, "end": end}, Path(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
