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

Row-wise state does not: FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` keeps one accumulator per
row *per column shard* (the sum over steps of the squared gradient's mean over that
shard's columns), which TorchRec exposes as one vector of ``rows × shards`` entries.
Its meaning follows the column split, so :func:`remap_rowwise` maps it: a new shard
gets the column-weighted mean of the saved shards it overlaps. That is exact when the
split of a table is unchanged (ranks may move) or when new shards are unions of old
ones (merging), and an approximation (squared gradients assumed even over a shard's
columns) when a shard is cut narrower. ``shardwise.json`` records each table's column
split for this.

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
planner or storage may not.
"""

from __future__ import annotations

import re
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, ValidationError
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.basics import UserError, write_atomic
from shardwise.planner.plan import Plan, plan_shapes, shape_mismatches
from shardwise.planner.torchrec_plan import DEFAULT_MODULE_PATH

CHECKPOINT_FORMAT: Literal[1] = 1
META_FILE = "shardwise.json"
#: The DCP name prefix of the fused optimizer's entries.
OPTIMIZER_PART = "embedding_optimizer"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

Columns = list[tuple[int, int]]


class StateLayout(BaseModel):
    """One fused-optimizer state tensor of one table, as saved."""

    model_config = ConfigDict(extra="forbid")

    key: str
    kind: Literal["rowwise", "elementwise", "other"]
    shape: list[int]
    #: For row-wise state: block i (entries ``i*rows … (i+1)*rows``) belongs to the
    #: shard with columns ``columns[i]`` = (col_offset, cols).
    columns: Columns = []


class TableLayout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    rows: int
    dim: int
    dtype: Literal["fp32", "fp16"]
    weight_key: str
    #: The table's column shards as saved, (col_offset, cols), by column.
    columns: Columns
    optimizer: list[StateLayout] = []


class CheckpointMeta(BaseModel):
    """``shardwise.json``: what a checkpoint holds and how it was sharded."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = CHECKPOINT_FORMAT
    step: int
    world_size: int
    plan_hash: str
    planner: str
    reason: str
    saved_at: float
    module_path: str
    tables: list[TableLayout]
    extra: dict[str, Any] = {}


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def weight_key(name: str, module_path: str = DEFAULT_MODULE_PATH) -> str:
    """The DMP state-dict key of a table's weights."""
    prefix = f"{module_path}." if module_path else ""
    return f"{prefix}embedding_bags.{name}.weight"


# --------------------------------------------------------------------------- row-wise state


def remap_rowwise(
    old_columns: Sequence[tuple[int, int]],
    old_values: torch.Tensor,
    new_columns: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Row-wise optimizer state for a new column split of the same table.

    ``old_values`` is ``[len(old_columns), rows]``; the result is
    ``[len(new_columns), rows]``: for each new shard, the mean of the old shards'
    values weighted by how many of its columns each covers. Exact for an unchanged
    split and for merges; for a narrower cut it assumes the accumulated squared
    gradients are even across the old shard's columns.
    """
    if old_values.shape[0] != len(old_columns):
        raise ValueError(f"{old_values.shape[0]} rows of state for {len(old_columns)} shards")
    out = torch.zeros(
        (len(new_columns), old_values.shape[1]), dtype=old_values.dtype, device=old_values.device
    )
    for k, (start, width) in enumerate(new_columns):
        covered = 0
        for j, (old_start, old_width) in enumerate(old_columns):
            overlap = min(start + width, old_start + old_width) - max(start, old_start)
            if overlap > 0:
                out[k] += old_values[j] * (overlap / width)
                covered += overlap
        if covered != width:
            raise ValueError(
                f"columns {start}..{start + width - 1} are covered {covered} times by the saved "
                "shards; the tables differ"
            )
    return out


def _rowwise_columns(weight: ShardedTensor, state: ShardedTensor) -> Columns | None:
    """Which column shard each block of a row-wise state vector belongs to.

    TorchRec lists a state's shards in the same order and on the same ranks as the
    weight's (checked here), each block ``rows`` long at offset ``index * rows``."""
    rows = int(weight.size(0))
    w_meta = weight.metadata().shards_metadata
    s_meta = state.metadata().shards_metadata
    if state.dim() != 1 or int(state.size(0)) != rows * len(w_meta) or len(s_meta) != len(w_meta):
        return None
    columns: list[tuple[int, int] | None] = [None] * len(w_meta)
    for w, s in zip(w_meta, s_meta, strict=True):
        if w.placement is None or s.placement is None or w.placement.rank() != s.placement.rank():
            return None
        if int(s.shard_sizes[0]) != rows or int(s.shard_offsets[0]) % rows:
            return None
        columns[int(s.shard_offsets[0]) // rows] = (int(w.shard_offsets[1]), int(w.shard_sizes[1]))
    if any(c is None for c in columns):
        return None
    return [c for c in columns if c is not None]


def _classify(
    weight: Any, state: Any
) -> tuple[Literal["rowwise", "elementwise", "other"], Columns]:
    if not isinstance(state, ShardedTensor) or not isinstance(weight, ShardedTensor):
        return "other", []
    if state.size() == weight.size():
        return "elementwise", []
    columns = _rowwise_columns(weight, state)
    return ("rowwise", columns) if columns is not None else ("other", [])


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


def _local_state_layouts(
    model_state: Mapping[str, Any], fused: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for key, states in fused.items():
        weight = model_state.get(key)
        for state_key, state in states.items():
            kind, columns = _classify(weight, state)
            out.setdefault(key, []).append(
                {
                    "key": state_key,
                    "kind": kind,
                    "shape": [int(x) for x in state.size()],
                    "columns": columns,
                }
            )
    return out


def _table_columns(value: Any, dim: int) -> Columns:
    if isinstance(value, ShardedTensor):
        return sorted(
            (int(m.shard_offsets[1]), int(m.shard_sizes[1]))
            for m in value.metadata().shards_metadata
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
    dcp_save(
        {
            "model": model_state,
            "dense_optimizer": dense_optimizer.state_dict(),
            **_optimizer_entries(fused),
        },
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
            tables.append(
                TableLayout(
                    name=t.name,
                    rows=t.rows,
                    dim=t.dim,
                    dtype=t.dtype,
                    weight_key=key,
                    columns=_table_columns(model_state.get(key), t.dim),
                    optimizer=[
                        StateLayout.model_validate(v)
                        for _, v in sorted(merged.get(key, {}).items())
                    ],
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
        (p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and p != current),
        key=lambda p: p.name,
    )
    for old in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- find and read


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``ROOT/latest`` names, or None when there is none yet."""
    pointer = Path(root) / LATEST_FILE
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    path = Path(root) / name
    if not _STEP_DIR.match(name) or not (path / META_FILE).is_file():
        raise UserError(
            f"{pointer} names {name!r}, which is not a complete checkpoint; remove {pointer} "
            "to start afresh or point it at a step-… directory that has a shardwise.json."
        )
    return path


def read_meta(path: str | Path) -> CheckpointMeta:
    where = Path(path) / META_FILE
    try:
        return CheckpointMeta.model_validate_json(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is not a shardwise checkpoint (no {META_FILE}).") from None
    except ValidationError as err:
        raise UserError(f"{where} is not a checkpoint description: {err}") from None


def checkpoint_problems(meta: CheckpointMeta, plan: Plan, module_path: str) -> list[str]:
    """Why a checkpoint cannot be loaded into a model sharded by ``plan``, by table."""
    out: list[str] = []
    if meta.module_path != module_path:
        out.append(
            f"the checkpoint's tables are at {meta.module_path!r}, the model's at {module_path!r}"
        )
    saved = {t.name: (t.rows, t.dim, t.dtype) for t in meta.tables}
    out.extend(shape_mismatches(saved, plan_shapes(plan), "checkpoint", "plan"))
    return out


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

    Any saved world size and placement works (see the module docstring). Returns the
    checkpoint's description and notes on optimizer state that could not be carried
    over (it then starts fresh). A collective: every rank calls it.
    """
    meta = read_meta(path)
    problems = checkpoint_problems(meta, plan, module_path)
    if problems:
        raise UserError(f"{path} does not fit this model and plan:\n- " + "\n- ".join(problems))
    model_state = model.state_dict()
    saved = {t.weight_key: t for t in meta.tables}
    request: dict[str, dict[str, Any]] = {}
    remaps: list[tuple[ShardedTensor, Columns, Columns, torch.Tensor]] = []
    notes: list[str] = []
    for key, states in _fused_state(model).items():
        table = saved[key]
        saved_states = {s.key: s for s in table.optimizer}
        for state_key, state in states.items():
            old = saved_states.get(state_key)
            kind, columns = _classify(model_state.get(key), state)
            if old is None:
                notes.append(f"{state_key}: not in the checkpoint; starts fresh")
            elif old.kind == "rowwise" and kind == "rowwise":
                buffer = torch.zeros(old.shape, dtype=state.dtype)
                request.setdefault(key, {})[state_key] = buffer
                remaps.append((state, old.columns, columns, buffer))
            elif old.shape == [int(x) for x in state.size()]:
                request.setdefault(key, {})[state_key] = state
            else:
                notes.append(
                    f"{state_key}: saved as {old.kind} {old.shape}, now {kind} "
                    f"{list(state.size())}; starts fresh"
                )
    dense_state = dense_optimizer.state_dict()
    dcp_load(
        {"model": model_state, "dense_optimizer": dense_state, **_optimizer_entries(request)},
        checkpoint_id=path,
    )
    model.load_state_dict(model_state)
    dense_optimizer.load_state_dict(dense_state)
    with torch.no_grad():
        for state, old_columns, new_columns, buffer in remaps:
            rows = int(buffer.numel()) // len(old_columns)
            values = remap_rowwise(old_columns, buffer.view(len(old_columns), rows), new_columns)
            for shard in state.local_shards():
                block = int(shard.metadata.shard_offsets[0]) // rows
                shard.tensor.copy_(values[block].to(shard.tensor.device))
    return meta, notes


def read_tables(path: str | Path) -> dict[str, torch.Tensor]:
    """Every table of a checkpoint as one full tensor, in this process (no process
    group, no model): for inspection, serving, or checking a resume."""
    meta = read_meta(path)
    want = {
        t.weight_key: torch.empty((t.rows, t.dim), dtype=_TORCH_DTYPES[t.dtype])
        for t in meta.tables
    }
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("read_tables reads in one process; call it outside torchrun")
    with warnings.catch_warnings():  # DCP warns that it loads in one process: we ask it to
        warnings.simplefilter("ignore", UserWarning)
        dcp_load({"model": want}, checkpoint_id=path, no_dist=True)
    return {t.name: want[t.weight_key] for t in meta.tables}


def describe(meta: CheckpointMeta) -> str:
    return (
        f"step {meta.step} ({meta.reason}) from {meta.world_size} ranks, plan "
        f"{meta.plan_hash[:12]} by {meta.planner}"
    )
