"""Checkpoints that reshard: save at one world size and plan, resume at another.

Format (one directory per checkpoint, ``ROOT/step-000000120/``)::

    ROOT/latest                   "step-000000120": written last, atomically (the commit)
    ROOT/step-000000120/.metadata + __<rank>_0.distcp    torch.distributed.checkpoint
    ROOT/step-000000120/shardwise.json                   CheckpointMeta (below)

The DCP state dict has three parts:

- ``model``: the DMP's ``state_dict()``: every table as a ``ShardedTensor`` (each rank
  writes only its shards), the dense layers as replicated tensors (written once);
- ``dense_optimizer``: the dense Adagrad's state, keyed by parameter name;
- ``embedding_optimizer.…``: the fused optimizer's state (``dmp.fused_optimizer``), one
  entry per table and state (below).

DCP stores each shard with its global offsets, and a load reads, for every shard the
*new* plan gives this rank, the overlapping pieces of the saved shards: the weights
come back exactly, whatever the old and the new world size and placement. Element-wise
optimizer state (a tensor shaped like the table) reshards the same way.

Optimizer state follows the plan (:mod:`.optstate` says how each mapping works and how
exact it is): a sharded table's fused row-wise Adagrad state is one vector of blocks,
one per shard (rows × columns), and :func:`load_checkpoint` gives each new shard the
column-weighted mean of the saved blocks over its rows, whatever the old and new row
and column cuts; a data-parallel table's state is the dense optimizer's element-wise
sum, mapped to and from row-wise blocks. ``shardwise.json`` records each table's kind,
its shards (row and column ranges on ranks) and each state's blocks. A rank reads only
the saved state of the rows it will hold (:class:`.optstate.RowRead`), except for a
table that becomes data-parallel, whose every rank reads the whole saved vector
(``rows × column ranges`` values, smaller than the table each rank then holds).

The directory must be shared by every rank (a ReadWriteMany PVC across pods).

A rank holds optimizer state only for the tables it has shards of, so the
``embedding_optimizer`` entries differ from rank to rank, and a rank with no table (a
plan may leave ranks empty) has none. They are therefore top-level entries,
``embedding_optimizer.<weight key>.<state key>``, not one nested dict: nested, an
empty rank's part is ``{}``, and DCP's load, which on every rank that lacks some saved
key (every sharded load) retries with its pre-2.4 key scheme, takes an empty dict for
one opaque value and fails with "Missing key in checkpoint state_dict:
embedding_optimizer.". The flat names are exactly the ones DCP gave the nested form, so
the files are the same either way and checkpoints of both load. DCP's docs ask for the
same keys everywhere; its default planner and file storage plan each rank's reads and
writes locally and merge them on the coordinator, with no per-key collective, so this
works (tested 1 → 4 ranks with two empty, back to 1, and 2 → 3), but a custom DCP
planner or storage may not. The loader asks for the dense optimizer's state as flat
entries too (a table that becomes data-parallel is filled by the loader, not read).

DCP reads a replicated tensor into a ``ShardedTensor`` and a ``ShardedTensor`` into a
replicated tensor (tested), so a data-parallel table's weights need nothing of their
own: they are the same ``model`` entry whichever kind saved or loads them.

Format 2 adds each table's kind and shards and each state's blocks; format 1
checkpoints (table-wise and column-wise tables only) still load: their blocks are
their column shards, ``rows`` entries each.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.basics import UserError, write_atomic
from shardwise.planner.plan import Plan, PlanTable
from shardwise.planner.torchrec_plan import DEFAULT_MODULE_PATH
from shardwise.runtime.checkpoint_map import StateLoader, mapping_notes
from shardwise.runtime.checkpoint_meta import (
    CHECKPOINT_FORMAT,
    DENSE_PART,
    LATEST_FILE,
    META_FILE,
    OPTIMIZER_PART,
    STEP_DIR,
    TORCH_DTYPES,
    CheckpointMeta,
    Columns,
    StateKind,
    StateLayout,
    TableLayout,
    checkpoint_dir,
    checkpoint_problems,
    classify_state,
    describe,
    latest_checkpoint,
    read_meta,
    weight_key,
)
from shardwise.runtime.optstate import remap_rowwise

__all__ = [  # the checkpoint API, with the description's names from .checkpoint_meta
    "CHECKPOINT_FORMAT",
    "META_FILE",
    "OPTIMIZER_PART",
    "CheckpointMeta",
    "StateLayout",
    "TableLayout",
    "checkpoint_dir",
    "checkpoint_problems",
    "describe",
    "latest_checkpoint",
    "load_checkpoint",
    "mapping_notes",
    "read_meta",
    "read_tables",
    "remap_rowwise",
    "save_checkpoint",
    "weight_key",
]


# --------------------------------------------------------------------------- layouts


def _fused_state(model: Any) -> dict[str, dict[str, Any]]:
    """``{weight key: {state key: tensor}}`` for the tables this rank holds shards of."""
    state: dict[str, dict[str, Any]] = model.fused_optimizer.state_dict()["state"]
    return state


def _optimizer_entries(fused: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The fused optimizer's state as flat DCP entries (see the module docstring: a
    rank without tables must contribute no key rather than an empty dict)."""
    return {
        f"{OPTIMIZER_PART}.{key}.{state_key}": value
        for key, states in fused.items()
        for state_key, value in states.items()
    }


def _dense_entries(dense: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The dense optimizer's per-parameter state as flat DCP entries (the names DCP
    gives ``{"dense_optimizer": {"state": …}}``)."""
    return {
        f"{DENSE_PART}.{key}.{state_key}": value
        for key, states in dense.items()
        for state_key, value in states.items()
    }


def _local_state_layouts(
    model_state: Mapping[str, Any], fused: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for key, states in fused.items():
        weight = model_state.get(key)
        for state_key, state in states.items():
            kind, blocks = classify_state(weight, state)
            out.setdefault(key, []).append(
                {
                    "key": state_key,
                    "kind": kind,
                    "shape": [int(x) for x in state.size()],
                    "blocks": [b.model_dump() for b in blocks],
                }
            )
    return out


def _dense_layouts(table: PlanTable, states: Mapping[str, Any]) -> list[StateLayout]:
    """A data-parallel table's dense optimizer state (the same on every rank)."""
    out = []
    for state_key, value in sorted(states.items()):
        shape = [int(x) for x in getattr(value, "shape", ())]
        kind: StateKind = "dense" if shape == [table.rows, table.dim] else "other"
        out.append(StateLayout(key=state_key, kind=kind, shape=shape))
    return out


def _table_columns(value: Any, dim: int) -> Columns:
    if isinstance(value, ShardedTensor):
        return sorted(
            {
                (int(m.shard_offsets[1]), int(m.shard_sizes[1]))
                for m in value.metadata().shards_metadata
            }
        )
    return [(0, dim)]


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Any,
    dense_optimizer: Any,
    plan: Plan,
    *,
    reason: str,
    module_path: str = DEFAULT_MODULE_PATH,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Save ``model`` (a DMP) and both optimizers after ``step`` under ``root``.

    A collective: every rank calls it at the same step. Rank 0 writes
    ``shardwise.json`` and then ``latest``, the commit point, and removes all but the
    ``keep`` newest checkpoints; every rank returns once ``latest`` names this one.
    """
    rank = dist.get_rank()
    path = checkpoint_dir(root, step)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # a rerun of this step: no stale shards
        path.mkdir(parents=True)
    dist.barrier()
    model_state = model.state_dict()
    fused = _fused_state(model)
    dense_state = dense_optimizer.state_dict()
    dcp_save(
        {"model": model_state, "dense_optimizer": dense_state, **_optimizer_entries(fused)},
        checkpoint_id=path,
    )
    # Each rank sees only the optimizer state of its own tables: rank 0 merges them.
    local = _local_state_layouts(model_state, fused)
    everyone: list[dict[str, list[dict[str, Any]]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    if rank == 0:
        merged: dict[str, dict[str, dict[str, Any]]] = {}
        for part in everyone:
            for key, layouts in (part or {}).items():
                for layout in layouts:
                    merged.setdefault(key, {})[layout["key"]] = layout
        tables = []
        for t in plan.tables:
            key = weight_key(t.name, module_path)
            states = [StateLayout.model_validate(v) for _, v in sorted(merged.get(key, {}).items())]
            if t.kind == "data_parallel":
                states += _dense_layouts(t, dense_state.get("state", {}).get(key, {}))
            tables.append(
                TableLayout(
                    name=t.name,
                    rows=t.rows,
                    dim=t.dim,
                    dtype=t.dtype,
                    weight_key=key,
                    columns=_table_columns(model_state.get(key), t.dim),
                    kind=t.kind,
                    shards=list(t.shards),
                    optimizer=states,
                )
            )
        meta = CheckpointMeta(
            step=step,
            world_size=dist.get_world_size(),
            plan_hash=plan.hash,
            planner=plan.planner,
            reason=reason,
            saved_at=time.time(),
            module_path=module_path,
            tables=tables,
            extra=dict(extra or {}),
        )
        write_atomic(path / META_FILE, meta.model_dump_json(indent=1))
        write_atomic(Path(root) / LATEST_FILE, path.name + "\n")
        _prune(Path(root), max(keep, 1), path)
    dist.barrier()
    return path


def _prune(root: Path, keep: int, current: Path) -> None:
    """Keep ``current`` and the ``keep - 1`` newest other checkpoints (names sort by
    step). ``current`` is never removed, even after a resume from an older step."""
    others = sorted(
        (p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and p != current),
        key=lambda p: p.name,
    )
    for old in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | Path,
    model: Any,
    dense_optimizer: Any,
    plan: Plan,
    *,
    module_path: str = DEFAULT_MODULE_PATH,
) -> tuple[CheckpointMeta, list[str]]:
    """Load a checkpoint into ``model`` (a DMP sharded by ``plan``) and its optimizers.

    Any saved world size, placement and kinds work (see the module docstring). Returns
    the checkpoint's description and notes on optimizer state that was not carried over
    exactly (an approximation, or fresh state). A collective: every rank calls it.
    """
    meta = read_meta(path)
    problems = checkpoint_problems(meta, plan, module_path)
    if problems:
        raise UserError(f"{path} does not fit this model and plan:\n- " + "\n- ".join(problems))
    model_state = model.state_dict()
    loader = StateLoader(meta, module_path)
    for key, states in _fused_state(model).items():
        for state_key, state in states.items():
            loader.fused(key, state_key, state, model_state.get(key))
    dense_state = dense_optimizer.state_dict()
    dense_request = dict(dense_state.get("state", {}))
    for t in plan.tables:
        key = weight_key(t.name, module_path)
        if t.kind == "data_parallel" and loader.dense(key, dense_request.get(key, {})):
            dense_request.pop(key, None)
    dcp_load(
        {"model": model_state, **_dense_entries(dense_request), **loader.request},
        checkpoint_id=path,
    )
    model.load_state_dict(model_state)
    with torch.no_grad():
        for fill in loader.after:
            fill()
    dense_optimizer.load_state_dict(dense_state)
    notes = mapping_notes(meta, plan) + loader.notes
    return meta, notes


def read_tables(path: str | Path) -> dict[str, torch.Tensor]:
    """Every table of a checkpoint as one full tensor, in this process (no process
    group, no model): for inspection, serving, or checking a resume."""
    meta = read_meta(path)
    want = {
        t.weight_key: torch.empty((t.rows, t.dim), dtype=TORCH_DTYPES[t.dtype]) for t in meta.tables
    }
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("read_tables reads in one process; call it outside torchrun")
    with warnings.catch_warnings():  # DCP warns that it loads in one process: we ask it to
        warnings.simplefilter("ignore", UserWarning)
        dcp_load({"model": want}, checkpoint_id=path, no_dist=True)
    return {t.name: want[t.weight_key] for t in meta.tables}
