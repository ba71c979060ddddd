"""What a plan looks like per rank: the numbers behind the CLI's tables and plots.

Until a cost model exists for a planner, the load columns are *proxies* (bytes,
summed width, lookups = width x pooling factor), never presented as seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.planner.kinds import SHORT, V1_KINDS, describe_kind
from shardwise.planner.plan import Plan, imbalance
from shardwise.planner.tables import TableSpec


@dataclass(frozen=True)
class RankLoad:
    rank: int
    tables: int  # distinct tables with at least one shard here
    shards: int  # pieces of split tables among them (0 when all are whole tables)
    #: Tables here by kind's short label (TW, CW, RW, TWRW, GRID, DP), in that order.
    kinds: dict[str, int]
    #: Weights + optimizer state + I/O buffers at the plan's batch (docs/memory.md):
    #: what the validator weighs against the GPU's usable memory.
    memory_bytes: int
    #: The weights alone (rows x cols x bytes per element), the part every planner moves.
    weight_bytes: int
    #: Summed columns of its table- and column-wise shards: the pooled all-to-all's width.
    width: int
    #: Summed cols x pooling factor (a row range: its share of the lookups): embedding
    #: values read per sample.
    lookups: float
    predicted_seconds: float | None


def rank_loads(plan: Plan, tables: Sequence[TableSpec]) -> list[RankLoad]:
    pooling = {t.name: t.pooling_factor for t in tables}
    memory = plan.rank_memory(tables)
    predicted = plan.predicted.per_rank_seconds if plan.predicted else None
    out = []
    for rank, shards in enumerate(plan.shards_per_rank()):
        kinds: dict[str, int] = {}
        for t in {t.name: t for t, _ in shards}.values():
            kinds[t.short_kind] = kinds.get(t.short_kind, 0) + 1
        out.append(
            RankLoad(
                rank=rank,
                tables=len({t.name for t, _ in shards}),
                shards=sum(1 for t, _ in shards if not t.is_table_wise),
                kinds={k: kinds[k] for k in SHORT.values() if k in kinds},
                memory_bytes=memory[rank].total,
                weight_bytes=memory[rank].weights,
                width=sum(s.cols for t, s in shards if t.kind in V1_KINDS),
                lookups=sum(
                    s.cols * pooling.get(t.name, 0.0) * s.row_count(t.rows) / t.rows
                    for t, s in shards
                ),
                predicted_seconds=predicted[rank] if predicted else None,
            )
        )
    return out


@dataclass(frozen=True)
class PlanSummary:
    """One line of ``shardwise plan --compare``: the plan's worst rank by each measure."""

    planner: str
    max_memory_bytes: int
    max_weight_bytes: int
    max_width: int
    max_lookups: float
    lookup_imbalance: float
    column_wise_tables: int
    #: Tables of each kind but table-wise, by short label (``{"RW": 1, "CW": 3}``).
    split_kinds: dict[str, int]
    predicted_max_seconds: float | None
    predicted_imbalance: float | None  # 1 - mean/max of the predicted per-rank cost
    planning_seconds: float


def summarize(plan: Plan, tables: Sequence[TableSpec], planning_seconds: float) -> PlanSummary:
    loads = rank_loads(plan, tables)
    return PlanSummary(
        planner=plan.planner,
        max_memory_bytes=max(r.memory_bytes for r in loads),
        max_weight_bytes=max(r.weight_bytes for r in loads),
        max_width=max(r.width for r in loads),
        max_lookups=max(r.lookups for r in loads),
        lookup_imbalance=imbalance([r.lookups for r in loads]),
        column_wise_tables=sum(1 for t in plan.tables if t.kind == "column_wise"),
        split_kinds=split_kinds(plan),
        predicted_max_seconds=plan.predicted.max_seconds if plan.predicted else None,
        predicted_imbalance=plan.predicted.imbalance if plan.predicted else None,
        planning_seconds=planning_seconds,
    )


def split_kinds(plan: Plan) -> dict[str, int]:
    """Tables of every kind but table-wise, by short label, in :data:`SHORT`'s order."""
    counts = plan.kinds()
    return {SHORT[k]: counts[k] for k in SHORT if k in counts and k != "table_wise"}


def describe_kinds(plan: Plan, limit: int = 8) -> list[str]:
    """One line per table that is not table-wise, for the CLI and ``describe``:
    ``"huge: row-wise over 64 ranks"`` (at most ``limit``, then how many more)."""
    lines = []
    others = [t for t in plan.tables if not t.is_table_wise]
    local = plan.topology.local_world
    for t in others[:limit]:
        hosts = len({s.rank // local for s in t.shards})
        lines.append(f"{t.name}: {describe_kind(t.kind, len(t.shards), hosts)}")
    if len(others) > limit:
        lines.append(f"… and {len(others) - limit} more")
    return lines


def plot_plan(plan: Plan, tables: Sequence[TableSpec], path: str | Path) -> None:
    """A PNG with per-rank memory (against capacity) and load (cost or lookup proxy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = rank_loads(plan, tables)
    ranks = [r.rank for r in loads]
    gib = 2**30
    fig, (ax_mem, ax_load) = plt.subplots(1, 2, figsize=(max(8, 0.5 * len(ranks) + 6), 4))
    weights = [r.weight_bytes / gib for r in loads]
    by_kind = _weights_by_kind(plan)
    bottom = [0.0] * len(ranks)
    for label, color in zip(by_kind, _KIND_COLORS, strict=False):
        part = [by_kind[label][r] / gib for r in ranks]
        ax_mem.bar(ranks, part, bottom=bottom, color=color, label=f"weights, {label}")
        bottom = [a + b for a, b in zip(bottom, part, strict=True)]
    ax_mem.bar(
        ranks,
        [(r.memory_bytes - r.weight_bytes) / gib for r in loads],
        bottom=weights,
        color="#8172b2",
        label="optimizer state + I/O buffers",
    )
    ax_mem.axhline(
        plan.topology.usable_bytes / gib,
        color="#c44e52",
        linestyle="--",
        label=f"usable ({plan.topology.memory_reserve:.0%} reserve)",
    )
    ax_mem.set(
        title=f"Embedding memory per GPU (batch {plan.topology.batch_size_per_rank}/rank)",
        xlabel="rank",
        ylabel="GiB",
    )
    ax_mem.legend(loc="best", framealpha=0.9)
    if plan.predicted is not None:
        values = [1e3 * (r.predicted_seconds or 0.0) for r in loads]
        ax_load.set(title="Predicted embedding cost per GPU", ylabel="ms / iteration")
    else:
        values = [r.lookups for r in loads]
        ax_load.set(
            title="Lookup load per GPU (proxy: cols x pooling)",
            ylabel="embedding values read per sample",
        )
    ax_load.bar(ranks, values, color="#55a868")
    ax_load.set_xlabel("rank")
    for ax in (ax_mem, ax_load):
        ax.set_xticks(ranks)
    fig.suptitle(
        f"{plan.planner}: {len(plan.tables)} tables on {plan.world_size} GPUs "
        f"(plan {plan.hash[:8]})"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: Bar colours of the kinds' weights, in :data:`SHORT`'s order of appearance.
_KIND_COLORS = ("#4c72b0", "#64b5cd", "#dd8452", "#ccb974", "#937860", "#da8bc3")


def _weights_by_kind(plan: Plan) -> dict[str, list[int]]:
    """Each rank's weight bytes by the kind of the table they belong to (TW, CW, RW …),
    so the memory plot shows which ranks hold row-wise or data-parallel tables."""
    out: dict[str, list[int]] = {}
    for t in plan.tables:
        row = out.setdefault(t.short_kind, [0] * plan.world_size)
        for s in t.shards:
            if s.rank < plan.world_size:
                row[s.rank] += s.row_count(t.rows) * s.cols * t.bytes_per_element
    return {k: out[k] for k in SHORT.values() if k in out}
