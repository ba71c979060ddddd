"""The checkpoint's description, ``shardwise.json``: what was saved and how it was sharded.

:class:`CheckpointMeta` names the step, the world size, the plan and, per table, its
kind, its shards (row and column ranges on ranks) and the layout of each optimizer
state (:class:`StateLayout`: a fused row-wise state's blocks, :mod:`.optstate`). The
loader (:mod:`.checkpoint_map`) reads it to map the saved state to a new plan; format 1
files (table-wise and column-wise tables, each state's column split) still load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

from shardwise.basics import UserError
from shardwise.planner.kinds import Kind
from shardwise.planner.plan import Plan, Shard, plan_shapes, shape_mismatches
from shardwise.planner.torchrec_plan import DEFAULT_MODULE_PATH
from shardwise.runtime.optstate import Block, column_blocks, rowwise_blocks

CHECKPOINT_FORMAT: Literal[2] = 2
META_FILE = "shardwise.json"
#: The DCP name prefix of the fused optimizer's entries.
OPTIMIZER_PART = "embedding_optimizer"
#: The DCP name prefix of the dense optimizer's per-parameter state.
DENSE_PART = "dense_optimizer.state"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"^step-(\d{9})$")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

Columns = list[tuple[int, int]]
StateKind = Literal["rowwise", "elementwise", "dense", "other"]


class StateLayout(BaseModel):
    """One optimizer state tensor of one table, as saved."""

    model_config = ConfigDict(extra="forbid")

    key: str
    #: rowwise: the fused row-wise state (blocks); elementwise: fused, shaped like the
    #: table; dense: the dense optimizer's, shaped like the table (a data-parallel table).
    kind: StateKind
    shape: list[int]
    #: Format 1, row-wise state: block i (entries ``i*rows … (i+1)*rows``) belongs to
    #: the shard with columns ``columns[i]`` = (col_offset, cols).
    columns: Columns = []
    #: Format 2, row-wise state: each shard's block (:class:`.optstate.Block`).
    blocks: list[Block] = []

    def block_list(self, rows: int) -> list[Block]:
        return list(self.blocks) or column_blocks(rows, self.columns)


class TableLayout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    rows: int
    dim: int
    dtype: Literal["fp32", "fp16"]
    weight_key: str
    #: The table's column ranges as saved, (col_offset, cols), by column.
    columns: Columns
    #: The table's kind and shards as saved (format 2; ``None``/empty in format 1).
    kind: Kind | None = None
    shards: list[Shard] = []
    optimizer: list[StateLayout] = []

    @property
    def saved_kind(self) -> Kind:
        if self.kind is not None:
            return self.kind
        return "table_wise" if len(self.columns) == 1 else "column_wise"

    def state(self, kind: StateKind, key: str | None = None) -> StateLayout | None:
        """The saved state of this kind (and key, when given), if any."""
        return next((s for s in self.optimizer if s.kind == kind and key in (None, s.key)), None)


class CheckpointMeta(BaseModel):
    """``shardwise.json``: what a checkpoint holds and how it was sharded."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1, 2] = CHECKPOINT_FORMAT
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


def classify_state(weight: Any, state: Any) -> tuple[StateKind, list[Block]]:
    """A fused optimizer state of the table ``weight``: element-wise (shaped like the
    table), row-wise (with its blocks) or other."""
    if not isinstance(state, ShardedTensor) or not isinstance(weight, ShardedTensor):
        return "other", []
    if state.size() == weight.size():
        return "elementwise", []
    blocks = rowwise_blocks(weight, state)
    return ("rowwise", blocks) if blocks is not None else ("other", [])


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``ROOT/latest`` names, or None when there is none yet."""
    pointer = Path(root) / LATEST_FILE
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    path = Path(root) / name
    if not STEP_DIR.match(name) or not (path / META_FILE).is_file():
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


def describe(meta: CheckpointMeta) -> str:
    return (
        f"step {meta.step} ({meta.reason}) from {meta.world_size} ranks, plan "
        f"{meta.plan_hash[:12]} by {meta.planner}"
    )
