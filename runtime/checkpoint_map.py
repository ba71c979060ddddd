"""Saved optimizer state into a new plan: what the load asks DCP for, and what it does after.

:func:`load_checkpoint <.checkpoint.load_checkpoint>` hands every fused state of the new
model and every data-parallel table's dense state to a :class:`StateLoader`, which
picks the mapping (:mod:`.optstate`): row-wise from row-wise blocks (only the saved
rows this rank's shards cover are read), row-wise from a data-parallel table's sums,
the dense sums from row-wise blocks, or the same tensor under its saved name; state it
cannot map starts fresh, with a note. :func:`mapping_notes` names, from the plans
alone (so every rank says the same), where a mapping is an approximation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardwise.planner.plan import Plan
from shardwise.runtime.checkpoint_meta import (
    DENSE_PART,
    OPTIMIZER_PART,
    CheckpointMeta,
    StateLayout,
    TableLayout,
    classify_state,
)
from shardwise.runtime.optstate import (
    Block,
    RowRead,
    dense_from_rowwise,
    remap_block,
    rowwise_from_dense,
)


def mapping_notes(meta: CheckpointMeta, plan: Plan) -> list[str]:
    """Where the optimizer state of ``plan``'s tables is not carried over exactly from
    ``meta``'s, table by table (the same on every rank: it reads the plan, not a rank's
    shards)."""
    saved = {t.name: t for t in meta.tables}
    out: list[str] = []
    for t in plan.tables:
        old = saved[t.name]
        rowwise = next((s for s in old.optimizer if s.kind == "rowwise"), None)
        if t.kind == "data_parallel":
            if old.saved_kind != "data_parallel" and rowwise is not None:
                out.append(
                    f"{t.name}: now data-parallel; its Adagrad sums are the saved row-wise "
                    "state spread over each row's columns (an approximation: each row's "
                    "mean is kept, not how it spread over the columns)"
                )
            continue
        if old.saved_kind == "data_parallel" or rowwise is None:
            continue
        saved_cols = sorted({(b.col_offset, b.cols) for b in rowwise.block_list(old.rows)})
        for c, w in sorted({(s.col_offset, s.cols) for s in t.shards}):
            cut = [
                (a, n)
                for a, n in saved_cols
                if a < c + w and c < a + n and (a < c or a + n > c + w)
            ]
            if cut:
                a, n = cut[0]
                out.append(
                    f"{t.name}: columns {c}..{c + w - 1} cut the saved column range "
                    f"{a}..{a + n - 1}; its row-wise state is assumed even over that range's "
                    "columns (an approximation)"
                )
    return out


class StateLoader:
    """One load's requests to DCP and the work after it, table by table."""

    def __init__(self, meta: CheckpointMeta, module_path: str) -> None:
        self.meta = meta
        self.saved = {t.weight_key: t for t in meta.tables}
        self.module_path = module_path
        #: Flat DCP entries to read, besides the model.
        self.request: dict[str, Any] = {}
        self.after: list[Callable[[], None]] = []
        self.notes: list[str] = []

    def fused(self, key: str, state_key: str, state: Any, weight: Any) -> None:
        """Ask for what the new fused state ``state`` of table ``key`` needs."""
        old = self.saved[key]
        kind, blocks = classify_state(weight, state)
        same = next((s for s in old.optimizer if s.key == state_key), None)
        dense = old.state("dense")
        size = [int(x) for x in state.size()]
        if kind == "rowwise" and same is not None and same.kind == "rowwise":
            self._rowwise_from_rowwise(key, state_key, same, old, state, blocks)
            return
        if kind == "rowwise" and dense is not None:
            self._rowwise_from_dense(key, dense, old, state, blocks)
            return
        if kind == "elementwise" and same is None and dense is not None and dense.shape == size:
            self.request[f"{DENSE_PART}.{key}.{dense.key}"] = state  # the same sums, sharded
            return
        if same is not None and same.kind == kind and same.shape == size:
            self.request[f"{OPTIMIZER_PART}.{key}.{state_key}"] = state
            return
        saved = f"saved as {same.kind} {same.shape}" if same is not None else "not saved"
        self.notes.append(f"{state_key}: {saved}, now {kind} {size}; starts fresh")

    def _local_blocks(self, state: Any, blocks: list[Block]) -> list[tuple[Any, Block]]:
        """This rank's non-empty shards of ``state`` with their blocks (an empty row
        range's block may share its offset with the next one)."""
        at = {b.offset: b for b in blocks if b.rows}
        return [
            (shard, at[int(shard.metadata.shard_offsets[0])])
            for shard in state.local_shards()
            if int(shard.tensor.numel()) > 0
        ]

    def _rowwise_from_rowwise(
        self,
        key: str,
        state_key: str,
        saved: StateLayout,
        old: TableLayout,
        state: Any,
        blocks: list[Block],
    ) -> None:
        old_blocks = saved.block_list(old.rows)
        local = self._local_blocks(state, blocks)
        wanted: list[tuple[Block, Block, tuple[int, int]]] = []  # new, old, rows
        for _, new in local:
            for ob in old_blocks:
                rows = ob.row_overlap(new)
                if ob.col_overlap(new) and rows is not None:
                    wanted.append((new, ob, rows))
        read = RowRead(
            saved.shape,
            state.dtype,
            [
                (ob.offset + a - ob.row_offset, ob.offset + b - ob.row_offset)
                for _, ob, (a, b) in wanted
            ],
        )
        self.request[f"{OPTIMIZER_PART}.{key}.{state_key}"] = read.request

        def fill() -> None:
            for shard, new in local:
                pieces = [
                    (
                        Block(
                            offset=0,
                            row_offset=a,
                            rows=b - a,
                            col_offset=ob.col_offset,
                            cols=ob.cols,
                        ),
                        read.rows(ob.offset + a - ob.row_offset, ob.offset + b - ob.row_offset),
                    )
                    for n, ob, (a, b) in wanted
                    if n == new
                ]
                shard.tensor.copy_(remap_block(pieces, new).to(shard.tensor.device))

        self.after.append(fill)

    def _rowwise_from_dense(
        self, key: str, dense: StateLayout, old: TableLayout, state: Any, blocks: list[Block]
    ) -> None:
        local = self._local_blocks(state, blocks)
        read = RowRead(dense.shape, state.dtype, [(b.row_offset, b.row_end) for _, b in local])
        self.request[f"{DENSE_PART}.{key}.{dense.key}"] = read.request

        def fill() -> None:
            for shard, new in local:
                sums = read.rows(new.row_offset, new.row_end)
                values = rowwise_from_dense(sums, new, new.row_offset)
                shard.tensor.copy_(values.to(shard.tensor.device))

        self.after.append(fill)

    def dense(self, key: str, states: Mapping[str, Any]) -> bool:
        """Ask for a data-parallel table's dense state; False when the checkpoint has it
        under the same name (it is then read with the dense optimizer's)."""
        old = self.saved[key]
        if old.state("dense") is not None:
            return False
        rowwise = old.state("rowwise")
        if rowwise is None:
            self.notes.append(f"{key}: no saved optimizer state; its Adagrad state starts fresh")
            return True
        blocks = rowwise.block_list(old.rows)
        total = int(rowwise.shape[0]) if rowwise.shape else 0
        read = RowRead([total], torch.float32, [(0, total)])
        self.request[f"{OPTIMIZER_PART}.{key}.{rowwise.key}"] = read.request
        step = float(self.meta.step)

        def fill() -> None:
            pieces = [(b, read.rows(b.offset, b.offset + b.rows)) for b in blocks]
            for value in states.values():
                if not isinstance(value, torch.Tensor):
                    continue
                if list(value.shape) == [old.rows, old.dim]:
                    value.copy_(dense_from_rowwise(pieces, old.rows, old.dim, value.dtype))
                elif value.dim() == 0:  # Adagrad's step count
                    value.fill_(step)

        self.after.append(fill)
        return True
