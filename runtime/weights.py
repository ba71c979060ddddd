"""Whole tables in and out of a sharded model: gather to one rank, or load from a full copy.

Checkpoints (:mod:`.checkpoint`) never need this: they save each rank's shards. These
are for people and tests: export the trained tables, compare a model before and after
a resharding resume, or start a sharded model from an unsharded one's weights (the
trainer's ``--check-unsharded``). Gathering puts every table on one rank, so use it
only where that fits in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

from shardwise.basics import UserError


def gather_state_dict(model: Any, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Every entry of ``model.state_dict()`` as a full CPU tensor on rank ``dst``
    (``None`` on the others). A collective: call it on every rank.

    TorchRec gives the shards of an ``EmbeddingBagCollection`` as ``ShardedTensor``s
    (it gives ``DTensor``s only when a plan asks for them, which ours never do); the
    dense entries are replicated plain tensors."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            full = (
                torch.empty(value.size(), dtype=value.dtype, device=_gather_device(value))
                if rank == dst
                else None
            )
            value.gather(dst=dst, out=full)
            if full is not None:
                out[key] = full.cpu()
        elif rank == dst:
            out[key] = value.detach().cpu().clone()
    return out if rank == dst else None


def _gather_device(value: ShardedTensor) -> torch.device:
    shards = value.local_shards()
    return shards[0].tensor.device if shards else torch.device("cpu")


def load_full_state_dict(model: Any, full: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into ``model``: each rank keeps its own slices.

    The keys must be exactly the sharded model's (a DMP's keys are the unwrapped
    model's, so an unsharded copy of the same model fits)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(full))
    extra = sorted(set(full) - set(state))
    if missing or extra:
        raise UserError(
            "the full state dict does not fit the model: "
            f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'…' if len(extra) > 5 else ''}."
        )
    with torch.no_grad():
        for key, value in state.items():
            source = full[key]
            if tuple(source.shape) != tuple(value.shape):
                raise UserError(
                    f"{key}: the full tensor is {tuple(source.shape)}, "
                    f"the model's is {tuple(value.shape)}."
                )
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    index = tuple(
                        slice(o, o + n)
                        for o, n in zip(
                            shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True
                        )
                    )
                    shard.tensor.copy_(source[index])
            else:
                value.copy_(source)


def gather_fused_optimizer_state(
    model: Any, dst: int = 0
) -> dict[str, dict[str, torch.Tensor]] | None:
    """The fused embedding optimizer's state, ``{weight key: {state key: full tensor}}``,
    on rank ``dst`` (``None`` elsewhere). Only ranks holding a table have its state, so
    each rank sends its local pieces with their offsets (``gather_object``). A
    collective; row-wise state comes back in TorchRec's layout (``rows × shards``, one
    block per column shard, see :mod:`.checkpoint`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local: dict[str, dict[str, tuple[list[int], list[tuple[list[int], torch.Tensor]]]]] = {}
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for state_key, state in states.items():
            if isinstance(state, ShardedTensor):
                pieces = [
                    (list(map(int, s.metadata.shard_offsets)), s.tensor.detach().cpu())
                    for s in state.local_shards()
                ]
                size = [int(x) for x in state.size()]
            else:
                pieces = [([0] * state.dim(), state.detach().cpu())]
                size = [int(x) for x in state.shape]
            local.setdefault(key, {})[state_key] = (size, pieces)
    if not dist.is_initialized():
        parts: list[Any] = [local]
    else:
        parts = [None] * dist.get_world_size() if rank == dst else []
        dist.gather_object(local, parts if rank == dst else None, dst=dst)
    if rank != dst:
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        for key, states in (part or {}).items():
            for state_key, (size, pieces) in states.items():
                for offsets, tensor in pieces:
                    full = out.setdefault(key, {}).get(state_key)
                    if full is None:
                        full = torch.zeros(size, dtype=tensor.dtype)
                        out[key][state_key] = full
                    index = tuple(
                        slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True)
                    )
                    full[index] = tensor
    return out
