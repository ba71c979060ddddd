"""Anchors: every job table timed alone at the job's batch, and the column halves of the
heaviest, so that a calibrated model prices the job's own tables from measurement.

A network that never saw a table misprices it alone by tens of percent (measured here:
49 % MAPE per table after calibration on 100 held-out tables), and a search piles work
onto the tables it underprices. One kernel per table fixes that at the source: the rank
head (:mod:`shardwise.planner.costmodel.rankhead`) sums anchors and learns only how a
fused kernel differs from its parts. The heaviest tables first, so a short budget
anchors the tables that set a plan's maximum, then the rest spread from heavy to light
(the factor for any table left unanchored is fitted on them); then the halves of the
tables a search is most likely to split (the heaviest :func:`halved_count`), whose
price a ratio of the network would otherwise have to guess; then, for the same heaviest
tables, the first row range of TorchRec's even cut over the job's GPUs (and over each
side's, which its plan ranks cut) in a row-wise kernel, and the smallest fp32 tables as
data-parallel copies at the job's batch per rank. A row range is keyed by its
:func:`~shardwise.planner.kinds.row_slice` twin's signature, which is what a plan's
kernels are priced by, so every full range of the cut (they are alike) is anchored and
the rank head's format is unchanged; the copies go to the head's local anchors.

Test tables are anchored too: an anchor is a measurement of a table's own kernel, as
every job table gets, not a fitted parameter, and held-out ranks are then judged as
the plans' ranks will be priced. No rank holding a test table is ever fitted on.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.planner.kinds import even_row_split, row_slice
from shardwise.planner.tables import TableSpec, table_signature
from shardwise.profiler.calibrate.tasks import Job, Task, work_proxy
from shardwise.profiler.compute import ShardLoad, footprint_bytes

#: Tables whose column halves are anchored: the heaviest of this share, at least one
#: per GPU of the job (each rank's heaviest table is the one a search splits first).
HALVED_SHARE = 0.15

Anchors = dict[str, dict[int, tuple[float, float]]]


def halved_count(job: Job) -> int:
    return min(len(job.tables), max(job.gpus, round(HALVED_SHARE * len(job.tables))))


def spread_order(n: int, first: int) -> list[int]:
    """Positions ``0..n-1`` of a list sorted heaviest first: the ``first`` heaviest, then
    the rest evenly over their range (van der Corput order), so that whatever prefix a
    budget measures covers heavy and light tables alike (the factor for tables left
    unanchored is fitted on it, and would be biased by the heaviest alone)."""
    head = list(range(min(first, n)))
    rest = list(range(len(head), n))
    keys = []
    for i in range(len(rest)):
        k, denom, bits = i + 1, 1.0, 0.0
        while k:
            denom *= 2
            bits += (k & 1) / denom
            k >>= 1
        keys.append(bits)
    return head + [rest[i] for i in sorted(range(len(rest)), key=lambda i: (keys[i], i))]


#: Tables of (almost) nothing: kernels of one and of four of them at the job's batch
#: tell the kernel's own overhead from a table's (:func:`overhead_of`).
TINY = tuple(TableSpec(name=f"overhead-{i}", rows=4, dim=4, pooling_factor=0.001) for i in range(4))


def overhead_tasks(job: Job) -> list[Task]:
    """A kernel of one tiny table and one of four, at the job's batch."""
    return [Task("anchor", TINY[:n], job.global_batch, {"overhead": n}) for n in (1, len(TINY))]


def overhead_of(records: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(fwd, bwd) seconds a kernel costs besides its tables: one tiny table's kernel less
    the per-table cost the four-table kernel shows (0 where either is missing)."""
    got: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        n = r.get("extra", {}).get("overhead")
        if n:
            got.setdefault(int(n), []).append((float(r["fwd_s"]), float(r["bwd_s"])))
    four = len(TINY)
    if 1 not in got or four not in got:
        return (0.0, 0.0)
    out = []
    for part in (0, 1):
        one = statistics.median(x[part] for x in got[1])
        many = statistics.median(x[part] for x in got[four])
        per_table = max(0.0, (many - one) / (four - 1))
        out.append(min(max(one - per_table, 0.0), one))
    return (out[0], out[1])


def anchor_tasks(job: Job, limit: int, worlds: Sequence[int] = ()) -> list[Task]:
    """The overhead's two kernels (:func:`overhead_tasks`), every table whole (the
    heaviest two per GPU first, then the rest spread over their range:
    :func:`spread_order`), then the halves of the heaviest
    :func:`halved_count` whose width halves into multiples of 4, then their row ranges
    and the data-parallel copies (:func:`kind_anchor_tasks`). A kernel that would not
    fit ``limit`` bytes is left out (the job's batch check names such a table)."""
    batch = job.global_batch
    by_work = sorted(job.tables, key=lambda t: (-work_proxy(t, batch), t.name))
    order = [by_work[i] for i in spread_order(len(by_work), 2 * job.gpus)]
    pairs = [(t, t.dim) for t in order]
    pairs += [(t, t.dim // 2) for t in by_work[: halved_count(job)] if t.dim % 8 == 0]
    tasks = overhead_tasks(job)
    for spec, cols in pairs:
        shard = spec.model_copy(update={"dim": cols})
        if footprint_bytes([ShardLoad.whole(shard)], batch) > limit:
            continue
        tasks.append(Task("anchor", (shard,), batch, {"table": spec.name, "cols": cols}))
    for task in kind_anchor_tasks(job, worlds):
        if footprint_bytes(task.loads, batch, local_batch_size=task.local_batch) <= limit:
            tasks.append(task)
    return tasks


def dp_anchor_count(job: Job) -> int:
    """How many of the smallest fp32 tables get a data-parallel anchor: a few per job,
    one per two GPUs (every plan's data-parallel tables are its smallest)."""
    return max(2, job.gpus // 2)


def kind_anchor_tasks(job: Job, worlds: Sequence[int] = ()) -> list[Task]:
    """For the heaviest :func:`halved_count` tables, range 0 of the even cut over the
    job's GPUs and over each of ``worlds`` (the sides' GPUs), and the last range where
    it is shorter (each shape once); then the :func:`dp_anchor_count` smallest fp32
    tables whole at the job's batch per rank, in a data-parallel kernel."""
    from shardwise.profiler.calibrate.plans import dp_candidates

    batch = job.global_batch
    by_work = sorted(job.tables, key=lambda t: (-work_proxy(t, batch), t.name))
    parts = sorted({w for w in (job.gpus, *worlds) if w >= 2})
    tasks: list[Task] = []
    seen: set[str] = set()
    for spec in by_work[: halved_count(job)]:
        for w in parts:
            cuts = [c for c in even_row_split(spec.rows, w) if 0 < c[1] < spec.rows]
            for offset, rows in cuts[:1] + cuts[-1:]:
                sig = table_signature(row_slice(spec, offset, rows))
                if sig in seen:
                    continue
                seen.add(sig)
                load = ShardLoad(spec, spec.dim, offset, rows, group="row_wise")
                extra = {"table": spec.name, "cols": spec.dim, "row_offset": offset, "rows": rows}
                tasks.append(Task("anchor", (), batch, extra, loads=(load,)))
    for i in dp_candidates(job.tables, dp_anchor_count(job)):
        spec = job.tables[i]
        load = ShardLoad(spec, spec.dim, group="data_parallel", local_batch=True)
        extra = {"table": spec.name, "cols": spec.dim, "local_batch": job.batch_per_rank}
        tasks.append(
            Task("anchor", (), batch, extra, loads=(load,), local_batch=job.batch_per_rank)
        )
    return tasks


def plain_anchor(record: Mapping[str, Any]) -> bool:
    """A whole table or column shard at the global batch (what the speed factors and
    the unanchored factor are fitted on): not a row range, not a data-parallel copy."""
    extra = record.get("extra", {})
    return "rows" not in extra and "local_batch" not in extra


def anchors_of(
    records: Sequence[Mapping[str, Any]], tables: Sequence[TableSpec], local: bool = False
) -> Anchors:
    """Signature → {columns: (fwd, bwd) seconds}, the median where a shard was timed
    more than once (a resumed run may time one again): whole tables and their column
    shards, and row ranges under their :func:`row_slice` twin's signature; with
    ``local``, the data-parallel copies at the batch per rank instead."""
    by_name = {t.name: t for t in tables}
    timed: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in records:
        extra = r.get("extra", {})
        spec = by_name.get(str(extra.get("table")))
        if spec is None or extra.get("kind") != "anchor":
            continue
        if ("local_batch" in extra) != local:
            continue
        if "rows" in extra:
            spec = row_slice(spec, int(extra.get("row_offset", 0)), int(extra["rows"]))
        key = (table_signature(spec), int(extra["cols"]))
        timed.setdefault(key, []).append((float(r["fwd_s"]), float(r["bwd_s"])))
    out: Anchors = {}
    for (sig, cols), got in timed.items():
        fwd = statistics.median(f for f, _ in got)
        bwd = statistics.median(b for _, b in got)
        if fwd > 0 and bwd > 0:
            out.setdefault(sig, {})[cols] = (fwd, bwd)
    return out
