"""Plan-like ranks: the ranks of candidate plans for the job's tables, which is what a
search asks a cost model about (docs/design.md §14).

Random groups of a few small tables teach a model little about a whole rank (10-20
shards, hot and cold tables together, up to a GPU's memory). So a calibration times
the ranks of the plans every planner would make: the greedy heuristics, TorchRec's
planner, NeuroShard's search (priced with the anchors measured so far), random
placements, and random placements with the heaviest tables cut in column halves.

The by-table split stays honest: the training tables are planned on their share of the
job's GPUs (``round(W × share)``, at least one), and so are the test tables apart, so
each side's ranks hold about as many tables, as much memory and the same global batch
as the job's ranks, and no fitted rank ever holds a test table. Round ``k`` measures
one plan of each side (training first), so a short budget has both.

A rank of a plan holding row-wise, table-row-wise or data-parallel tables runs several
kernels (``Plan.kernel_shards``); a task is *all of them*, as the rank runs them
(:mod:`.shards`): the plans of TorchRec's and NeuroShard's every-kind searches, and
:func:`rowwise_plan`'s random placements with some of the heaviest tables row-wise and
some of the smallest data-parallel, so a calibration fits and judges mixed-kind ranks
whatever the searches chose. A data-parallel copy reads the job's batch per rank.

Planning depends on measured anchors, so the task list is made once and written to the
work directory (``ranks.json``): a resumed calibration measures the same kernels.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shardwise.basics import UserError, write_atomic
from shardwise.planner.kinds import ROW_KINDS, KindOption, kind_options
from shardwise.planner.memory import shard_bytes
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import DEFAULT_MEMORY_RESERVE, Topology
from shardwise.profiler.calibrate.shards import RankShard, rank_shards
from shardwise.profiler.calibrate.tasks import Job, TableSplit, Task, work_proxy

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

#: The planners of round k (cycled; random, halves and rowwise draw anew each time
#: round). ``neuroshard`` and ``torchrec`` choose every table's kind; ``rowwise`` makes
#: sure the row-wise and data-parallel kernels are measured whatever they choose.
GENERATORS: tuple[str, ...] = (
    "size-greedy",
    "rowwise",
    "torchrec-tw-cw",
    "random",
    "neuroshard",
    "rowwise",
    "lookup-greedy",
    "halves",
    "torchrec",
    "rowwise",
    "dim-greedy",
    "size-lookup-greedy",
    "random",
    "rowwise",
    "halves",
)
#: Without the job's GPU memory, a side's GPUs are sized so its plans fill this much.
FILL = 0.75
#: TorchRec's planner enumerates for minutes beyond this many tables (its every-kind
#: form beyond the smaller number).
TORCHREC_MAX_TABLES = 400
TORCHREC_FULL_MAX_TABLES = 200
#: Data-parallel copies a :func:`rowwise_plan` draws (0 to this many, the smallest).
DP_DRAW = 2
RANKS_FILE = "ranks.json"
_RANDOM_KEY = 25


def side_world(job: Job, tables: int) -> int:
    """GPUs a side of ``tables`` tables is planned on: its share of the job's, at most
    one per two tables (a rank of the job holds several), and two where the job has
    two and the side two tables (one GPU would give one rank, however planned)."""
    share = round(job.gpus * tables / len(job.tables))
    floor = 2 if job.gpus >= 2 and tables >= 2 else 1
    return max(floor, min(share, tables // 2))


def side_topology(job: Job, tables: Sequence[TableSpec], world: int) -> Topology:
    """The side's GPUs: the job's memory when known, else sized to :data:`FILL`; a
    batch per rank that keeps the job's global batch (every rank reads all of it)."""
    per_rank = max(1, round(job.global_batch / world))
    memory = job.gpu_memory
    if memory is None:
        total = sum(shard_bytes(t, t.dim, per_rank, world) for t in tables)
        biggest = max(shard_bytes(t, t.dim, per_rank, world) for t in tables)
        usable = max(total / world / FILL, biggest * 1.05)
        memory = int(usable / (1.0 - DEFAULT_MEMORY_RESERVE)) + 1
    return Topology(gpus=world, gpu_memory_bytes=memory, batch_size_per_rank=per_rank)


def halves_plan(
    tables: Sequence[TableSpec], topology: Topology, rng: np.random.Generator
) -> Plan | None:
    """A random placement with one to W/2 of the heaviest 2W tables cut in column halves
    (on different ranks): column shards fused beside whole tables. None when the draw
    does not fit."""
    world, batch = topology.gpus, topology.batch_size_per_rank
    if world < 2:
        return None
    heavy = sorted(
        (i for i, t in enumerate(tables) if t.dim % 8 == 0),
        key=lambda i: -work_proxy(tables[i], batch),
    )[: 2 * world]
    if not heavy:
        return None
    k = int(rng.integers(1, max(1, world // 2) + 1))
    cut = {int(i) for i in rng.choice(heavy, size=min(k, len(heavy)), replace=False)}
    pieces = [
        (i, c) for i, t in enumerate(tables) for c in ([t.dim // 2] * 2 if i in cut else [t.dim])
    ]
    free = [topology.usable_bytes] * world
    placed: dict[int, list[Shard]] = {}
    for n in rng.permutation(len(pieces)):
        i, cols = pieces[int(n)]
        need = shard_bytes(tables[i], cols, batch, world)
        taken = {s.rank for s in placed.get(i, [])}
        room = [r for r in range(world) if free[r] >= need and r not in taken]
        if not room:
            return None
        r = room[int(rng.integers(len(room)))]
        free[r] -= need
        offset = sum(s.cols for s in placed.get(i, []))
        placed.setdefault(i, []).append(Shard(rank=r, col_offset=offset, cols=cols))
    return Plan.from_shards(tables, [placed[i] for i in range(len(tables))], topology, "halves")


def dp_candidates(tables: Sequence[TableSpec], n: int) -> list[int]:
    """Indices of the ``n`` smallest fp32 tables (by weight bytes): the tables a
    data-parallel copy suits (the runtime refuses fp16 ones), smallest first."""
    fp32 = [i for i, t in enumerate(tables) if t.dtype == "fp32"]
    return sorted(fp32, key=lambda i: (tables[i].rows * tables[i].dim, tables[i].name))[:n]


def rowwise_plan(
    tables: Sequence[TableSpec], topology: Topology, rng: np.random.Generator
) -> Plan | None:
    """A random placement with one to W/2 of the heaviest 2W tables row-wise (or
    table-row-wise on a random host, where the topology has several) and zero to
    :data:`DP_DRAW` of the smallest fp32 tables data-parallel (left out when the copies
    leave no room), the rest whole on random ranks with room, largest first. None when
    the draw does not fit."""
    world, batch = topology.gpus, topology.batch_size_per_rank
    if world < 2:
        return None
    heavy = sorted(range(len(tables)), key=lambda i: -work_proxy(tables[i], batch))[: 2 * world]
    k = int(rng.integers(1, max(1, world // 2) + 1))
    chosen: dict[int, KindOption] = {}
    for i in (int(x) for x in rng.choice(heavy, size=min(k, len(heavy)), replace=False)):
        rows = [o for o in kind_options(tables[i], topology) if o.kind != "table_wise"]
        rows = [o for o in rows if o.kind != "data_parallel"]
        if rows:
            chosen[i] = rows[int(rng.integers(len(rows)))]
    if not chosen:
        return None
    n_dp = int(rng.integers(0, DP_DRAW + 1))
    for i in dp_candidates([t for t in tables], len(tables)):
        if n_dp <= 0:
            break
        if i in chosen:
            continue
        dp = KindOption("data_parallel")
        if dp in kind_options(tables[i], topology):
            chosen[i] = dp
            n_dp -= 1
    plan = _place_around(tables, topology, chosen, rng)
    if plan is None and any(o.kind == "data_parallel" for o in chosen.values()):
        # the copies did not leave room: the row-wise draw alone
        rows_only = {i: o for i, o in chosen.items() if o.kind != "data_parallel"}
        plan = _place_around(tables, topology, rows_only, rng)
    return plan


def _place_around(
    tables: Sequence[TableSpec],
    topology: Topology,
    chosen: Mapping[int, KindOption],
    rng: np.random.Generator,
) -> Plan | None:
    """The tables of ``chosen`` in their kinds, the others whole, largest first, each on
    a random rank with room (None when one finds none)."""
    from shardwise.planner.memory import kind_memory
    from shardwise.planner.oversized import kind_shards

    world, batch, local = topology.gpus, topology.batch_size_per_rank, topology.local_world
    free = [float(topology.usable_bytes)] * world
    shards: dict[int, list[Shard]] = {}
    for i, option in chosen.items():
        t = tables[i]
        shards[i] = kind_shards(option, t, topology)
        for sh in shards[i]:
            need = kind_memory(
                option.kind, sh.row_count(t.rows), t.dim, t.dtype, t.pooling_factor, batch,
                world, local,
            ).total  # fmt: skip
            free[sh.rank] -= need
    if min(free) < 0:
        return None
    rest = [i for i in range(len(tables)) if i not in chosen]
    size = {i: shard_bytes(tables[i], tables[i].dim, batch, world) for i in rest}
    for i in sorted(rest, key=lambda i: (-size[i], i)):
        room = [r for r in range(world) if free[r] >= size[i]]
        if not room:
            return None
        r = room[int(rng.integers(len(room)))]
        free[r] -= size[i]
        shards[i] = [Shard(rank=r, cols=tables[i].dim)]
    kinds = [chosen[i].kind if i in chosen else None for i in range(len(tables))]
    return Plan.from_shards(
        tables, [shards[i] for i in range(len(tables))], topology, "rowwise", kinds=kinds
    )


def candidate_plan(
    name: str,
    draw: int,
    tables: Sequence[TableSpec],
    topology: Topology,
    seed: int,
    predictor: CostPredictor | None,
) -> Plan | None:
    """Planner ``name``'s plan for the side (None when it cannot plan it or is not at
    hand: a planner's failure only means one plan fewer). ``draw`` seeds random ones."""
    from shardwise.planner.base import PlannerOptions
    from shardwise.planner.registry import get_planner

    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_RANDOM_KEY, draw)))
    try:
        if name == "halves":
            return halves_plan(tables, topology, rng)
        if name == "rowwise":
            return rowwise_plan(tables, topology, rng)
        if name.startswith("torchrec") and len(tables) > TORCHREC_MAX_TABLES:
            return None
        if name == "torchrec" and len(tables) > TORCHREC_FULL_MAX_TABLES:
            return None
        if name == "neuroshard":
            if predictor is None:
                return None
            from shardwise.planner.comm.choice import planning_comm

            predictor.comm_model = planning_comm(predictor, topology)
        options = PlannerOptions(seed=int(rng.integers(2**31)), predictor=predictor)
        return get_planner(name, options).plan(tables, topology)
    except UserError:
        return None


def plan_rank_tasks(
    job: Job,
    split: TableSplit,
    rounds: int,
    predictor: CostPredictor | None,
    on_plan: Callable[[str], None] | None = None,
) -> list[Task]:
    """The ranks of ``rounds`` candidate plans per side, training side first in each
    round, each rank with every kernel it runs (:mod:`.shards`); a rank whose shards an
    earlier task of its side holds is left out."""
    by_name = {t.name: t for t in job.tables}
    sides = []
    for kind, names in (("rank", split.train), ("heldout", split.test)):
        tables = [by_name[n] for n in names]
        if tables:
            world = side_world(job, len(tables))
            sides.append((kind, tables, side_topology(job, tables, world)))
    tasks: list[Task] = []
    seen: set[tuple[str, frozenset[tuple[Any, ...]]]] = set()
    for k in range(rounds):
        name = GENERATORS[k % len(GENERATORS)]
        for kind, tables, topology in sides:
            if topology.gpus < 2 and k > 0:
                continue  # one GPU: every plan is the same rank
            if on_plan is not None:
                on_plan(f"planning {kind} side: {name} ({topology.gpus} GPUs)")
            plan = candidate_plan(name, k, tables, topology, job.seed, predictor)
            if plan is None:
                continue
            kinds = {t.name: t.kind for t in plan.tables}
            for r, kernel_shards in enumerate(plan.kernel_shards(by_name)):
                shards = [
                    RankShard(
                        ks.table,
                        ks.cols,
                        ks.row_offset,
                        ks.spec.rows if kinds[ks.table] in ROW_KINDS else None,
                        kinds[ks.table],
                    )
                    for ks in kernel_shards
                ]
                entries = [s.to_json(by_name[s.table]) for s in shards]
                key = (kind, frozenset(tuple(e) for e in entries))
                if not shards or key in seen:
                    continue
                seen.add(key)
                extra = {"plan": f"{k}:{name}", "rank": r, "shards": entries}
                tasks.append(rank_task(kind, shards, job, extra))
    return tasks


def rank_task(kind: str, shards: Sequence[RankShard], job: Job, extra: dict[str, Any]) -> Task:
    """The task timing ``shards`` as one rank of the job runs them: at the job's global
    batch, data-parallel copies at its batch per rank."""
    by_name = {t.name: t for t in job.tables}
    loads = tuple(s.load(by_name[s.table]) for s in shards)
    return Task(
        kind,  # type: ignore[arg-type]
        (),
        job.global_batch,
        extra,
        loads=loads,
        local_batch=job.batch_per_rank,
    )


def save_rank_tasks(path: Path, job: Job, tasks: Sequence[Task]) -> None:
    doc = {
        "job": job.key(),
        "tasks": [{"kind": t.kind, **dict(t.extra)} for t in tasks],
    }
    write_atomic(path, json.dumps(doc))


def load_rank_tasks(path: Path, job: Job) -> list[Task] | None:
    """The task list an earlier run of this calibration wrote, or None (none, or
    another job's: the work directory is per job, so that means a damaged file)."""
    try:
        doc: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("job") != job.key():
        return None
    by_name = {t.name: t for t in job.tables}
    tasks = []
    try:
        for entry in doc["tasks"]:
            shards = rank_shards(entry, by_name)
            extra = {k: v for k, v in entry.items() if k != "kind"}
            tasks.append(rank_task(str(entry["kind"]), shards, job, extra))
    except (KeyError, TypeError, ValueError, UserError):
        return None
    return tasks
