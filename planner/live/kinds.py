"""Live kind changes: a running job's hot table-wise table turned row-wise, or a row-wise
table turned back table-wise, priced from the live costs like every other candidate.

**Pricing a cut.** The probe measured the table whole (``m_t``, its marginal). Range
``r`` of TorchRec's even cut is priced ``a + f·m_t·ρ_r``: the live share and factor on
the marginal scaled by ``ρ_r = model(range r) / model(whole)``, the cost model's ratio
(its anchors where a calibration measured both, else its network). The ranges of a cut
are known to cost more than their share (each is a kernel of its own, with its empty
bags), which ``ρ`` carries; how far the model may be off on them is the spread of a
shard no probe measured (:data:`~.prices.ESTIMATED_SPREAD` of its price), or the
calibration's rank spread where both are anchored. Each rank's doubt grows by it.

**The reverse.** A row-wise table's ranges, probed or priced from their rank's
leftover, are summed and scaled by the model's whole/Σ-ranges ratio, with the same
spread, and the whole table goes to the rank where it raises the worst price least.

**Judging.** The changed plan is a :class:`~.search.Search` of its own: the table's old
shards leave (their doubt stays on their ranks), the new ones are fixed where the cut
puts them, and the movable shards may then balance around them. It is chosen only when
its worst plausible max (every parameter set the fit leaves open, plus the new shards'
doubt) beats the best placement without a kind change by more than the tie, so a gain
the ratio's spread could swallow is declined, with its figures. A kind change moves
the whole table's weights and optimizer state, counted in the moved bytes, which the
loop's payback rule weighs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from shardwise.planner.kinds import (
    FUSED,
    KindOption,
    host_of,
    kind_options,
    row_slice,
)
from shardwise.planner.live.prices import ESTIMATED_SPREAD
from shardwise.planner.live.search import Search, State
from shardwise.planner.memory import kind_memory
from shardwise.planner.oversized import kind_shards
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec, table_signature
from shardwise.planner.topology import Topology

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor
    from shardwise.planner.costmodel.rankhead import RankHead

F64 = npt.NDArray[np.float64]

#: Table-wise tables of the straggler tried row-wise (costliest first), and row-wise
#: tables tried table-wise: each is one search, so a re-plan stays well under a second.
KIND_SOURCES = 4
ROW_KINDS = ("row_wise", "table_row_wise")
#: Moves that balance the shards around a kind change at most (bounds its search).
KIND_STEPS = 24


@dataclass(frozen=True)
class SliceRatio:
    """What the cost model says a cut costs against the whole table: ``rho[k]`` for
    shard ``k`` of the cut (:func:`kind_shards`'s order; 0 for an empty range), how far
    each may be off (a share of the range's price), and where it comes from."""

    rho: tuple[float, ...]
    spread: float
    source: str

    @property
    def total(self) -> float:
        return float(sum(self.rho))


#: A table and a row-wise option → the model's ratio, or None where it has none.
RatioFn = Callable[[TableSpec, KindOption], "SliceRatio | None"]


def model_ratios(
    topology: Topology,
    batch: int,
    *,
    head: RankHead | None = None,
    predictor: CostPredictor | None = None,
) -> RatioFn | None:
    """The slice/whole ratios of a calibrated rank head's anchors (where it measured the
    whole table and every range at the job's global ``batch``) or else of ``predictor``
    (its prices, anchored where it can); None when there is neither."""
    if head is None and predictor is None:
        return None

    def ratio(spec: TableSpec, option: KindOption) -> SliceRatio | None:
        cuts = [(s.row_offset, s.row_count(spec.rows)) for s in kind_shards(option, spec, topology)]
        slices = [row_slice(spec, o, n) if n > 0 else None for o, n in cuts]
        if head is not None and head.batch == batch:
            whole = _anchor(head, spec)
            parts = [0.0 if t is None else _anchor(head, t) for t in slices]
            known = [p for p in parts if p is not None]
            if whole and len(known) == len(parts):
                rho = tuple(p / whole for p in known)
                return SliceRatio(rho, head.rank_sigma, "the calibration's measured ranges")
        if predictor is None:
            return None
        sets = [[(spec, spec.dim)]] + [[(t, spec.dim)] for t in slices if t is not None]
        price = predictor.compute(sets, batch).sum(axis=1)
        if price[0] <= 0:
            return None
        it = iter(price[1:] / price[0])
        rho = tuple(0.0 if t is None else float(next(it)) for t in slices)
        return SliceRatio(rho, ESTIMATED_SPREAD, "the cost model")

    return ratio


def _anchor(head: RankHead, spec: TableSpec) -> float | None:
    """``spec`` whole measured alone by the calibration (fwd + bwd s), if it was."""
    got = (head.anchors.get(table_signature(spec)) or {}).get(spec.dim)
    return None if got is None else got[0] + got[1]


@dataclass
class KindChange:
    """One table's kind changed: the search over the changed plan's shards (the running
    plan's, the table's old ones taken out, its new ones added, in ``slots``' order),
    the placement chosen in it, and what it says."""

    table: int
    option: KindOption
    #: The rank a table turned table-wise goes to (-1 for a cut).
    rank: int
    search: Search
    slots: list[tuple[int, Shard]]
    #: The slots of the table's old shards (in the search, but holding nothing).
    removed: npt.NDArray[np.bool_]
    state: State
    ratio: SliceRatio
    #: Weights and optimizer state of the whole table: what the change moves.
    table_bytes: int
    says: str

    @property
    def risk_max(self) -> float:
        return float(self.search.loads(self.state).max())

    def moved(self) -> int:
        keep = ~self.removed & (self.search.start >= 0)
        return int(np.count_nonzero((self.state.rank != self.search.start) & keep))


def _said(name: str, old: str, option: KindOption, topology: Topology) -> str:
    before = old.replace("_", "-")
    if option.kind == "table_wise":
        return f"{name}: {before} → table-wise"
    return f"{name}: {before} → {option.describe(topology)}"


def _changed(
    base: Search,
    slots: Sequence[tuple[int, Shard]],
    out_slots: Sequence[int],
    new: Sequence[tuple[Shard, float, int, bool]],
    marg_new: Sequence[float],
    delta_new: F64,
) -> tuple[Search, list[tuple[int, Shard]], npt.NDArray[np.bool_]]:
    """``base`` with the slots ``out_slots`` emptied (their doubt of leaving stays on
    their ranks) and ``new`` shards added where they lie, fixed: (shard, squared doubt,
    memory, holds rows), their marginals ``marg_new`` and residual parts ``delta_new``."""
    n = len(base.marg)
    gone = np.zeros(n + len(new), dtype=bool)
    gone[list(out_slots)] = True
    var_base = np.zeros(base.world) if base.var_base is None else base.var_base.copy()
    marg, var, var_out = base.marg.copy(), base.var.copy(), base.var_out.copy()
    mem, unit, delta = base.mem.copy(), base.unit.copy(), base.delta.copy()
    movable = base.movable.copy()
    for i in out_slots:
        var_base[base.start[i]] += var_out[i]
        marg[i] = var[i] = var_out[i] = 0.0
        mem[i] = unit[i] = 0
        delta[:, i] = 0.0
        movable[i] = False
    ti = slots[out_slots[0]][0]
    for shard, doubt, _, _ in new:
        var_base[shard.rank] += doubt
    search = replace(
        base,
        marg=np.concatenate([marg, np.asarray(marg_new, dtype=np.float64)]),
        var=np.concatenate([var, np.zeros(len(new))]),
        var_out=np.concatenate([var_out, np.zeros(len(new))]),
        mem=np.concatenate([mem, np.array([m for *_, m, _ in new], dtype=np.int64)]),
        table=np.concatenate([base.table, np.full(len(new), ti, dtype=np.int64)]),
        start=np.concatenate([base.start, np.array([s.rank for s, *_ in new], dtype=np.int64)]),
        movable=np.concatenate([movable, np.zeros(len(new), dtype=bool)]),
        unit=np.concatenate([unit, np.array([int(u) for *_, u in new], dtype=np.int64)]),
        delta=np.concatenate([delta, delta_new], axis=1),
        var_base=var_base,
    )
    return search, [*slots, *((ti, s) for s, *_ in new)], gone


def _best(
    search: Search, placed: npt.NDArray[np.int64], gone: npt.NDArray[np.bool_], bar: float
) -> State:
    """The change alone, or the change on the best placement without it (``placed``:
    each old shard's rank there) with at most :data:`KIND_STEPS` moves that then
    balance around it: the lower worst max, the change alone within the tie (no move
    it does not need). No search when even a perfect balance of the change's priced
    work (by the best fit: its sum over ranks is what no move changes) cannot come
    below ``bar``, the max it must beat."""
    alone = search.state(search.start)
    c0, a, f = search.params[0]
    work = c0 * (alone.cnt > 0) + a * alone.cnt + f * alone.probe + alone.extra[0]
    if float(work.sum()) / search.world >= bar:
        return alone
    rank = search.start.copy()
    n = len(placed)
    rank[:n] = np.where(gone[:n], search.start[:n], placed)
    moved, _ = search.improve(search.state(rank), steps=KIND_STEPS)
    a, b = float(search.loads(alone).max()), float(search.loads(moved).max())
    return moved if b < a * (1 - 0.01) else alone


def kind_changes(
    base: Search,
    slots: Sequence[tuple[int, Shard]],
    plan: Plan,
    tables: Sequence[TableSpec],
    topology: Topology,
    batch: int,
    ratios: RatioFn,
    placed: npt.NDArray[np.int64],
    bar: float,
) -> tuple[list[KindChange], list[str]]:
    """Every kind change tried (the module docstring says which and how), each at its
    best placement (``placed``: the best placement without a kind change, each shard's
    rank; ``bar``: the worst max a change must beat), and what could not be tried and
    why."""
    specs = {t.name: t for t in tables}
    world, local = plan.world_size, topology.local_world
    now = base.state(base.start)
    loads = base.loads(now)
    s = int(np.argmax(loads))
    out: list[KindChange] = []
    notes: list[str] = []
    # Table-wise tables of the straggler, costliest first → their cuts.
    hot = [
        int(i)
        for i in np.flatnonzero(base.start == s)
        if plan.tables[slots[int(i)][0]].kind == "table_wise" and base.unit[i]
    ]
    hot.sort(key=lambda i: -float(base.marg[i]))
    for i in hot[:KIND_SOURCES]:
        ti = slots[i][0]
        t, spec = plan.tables[ti], specs[plan.tables[ti].name]
        for opt in kind_options(spec, topology):
            if opt.kind not in ROW_KINDS or (
                opt.kind == "table_row_wise" and opt.host != host_of(s, local)
            ):
                continue
            ratio = ratios(spec, opt)
            if ratio is None:
                notes.append(f"{t.name}: no model prices its {opt.describe(topology)}")
                continue
            cut = kind_shards(opt, spec, topology)
            if len(ratio.rho) != len(cut):
                raise ValueError(
                    f"{t.name}: {ratio.source} priced {len(ratio.rho)} ranges of a cut "
                    f"into {len(cut)}"
                )
            m = float(base.marg[i])
            marg_new = [m * r for r in ratio.rho]
            new = [
                (
                    sh,
                    (ratio.spread * mk) ** 2 + r**2 * float(base.var[i]),
                    kind_memory(
                        opt.kind,
                        sh.row_count(spec.rows),
                        spec.dim,
                        spec.dtype,
                        spec.pooling_factor,
                        batch,
                        world,
                        local,
                    ).total,
                    sh.row_count(spec.rows) > 0,
                )
                for sh, mk, r in zip(cut, marg_new, ratio.rho, strict=True)
            ]
            delta_new = base.delta[:, [i]] * np.asarray(ratio.rho)[None, :]
            search, ext, gone = _changed(base, slots, [int(i)], new, marg_new, delta_new)
            state = _best(search, placed, gone, bar)
            whole = kind_memory("table_wise", spec.rows, spec.dim, spec.dtype, None, batch, world)
            out.append(
                KindChange(
                    ti,
                    opt,
                    -1,
                    search,
                    ext,
                    gone,
                    state,
                    ratio,
                    whole.weights + whole.optimizer,
                    _said(t.name, t.kind, opt, topology),
                )
            )
    # Row-wise tables → table-wise, on the rank where the whole raises the worst least.
    cut_tables = [ti for ti, t in enumerate(plan.tables) if t.kind in ROW_KINDS]
    price = {ti: float(base.marg[base.table == ti].sum()) for ti in cut_tables}
    for ti in sorted(cut_tables, key=lambda k: -price[k])[:KIND_SOURCES]:
        t, spec = plan.tables[ti], specs[plan.tables[ti].name]
        if FUSED not in kind_options(spec, topology):
            continue
        hosts = sorted({host_of(sh.rank, local) for sh in t.shards})
        opt = KindOption(t.kind, hosts[0] if t.kind == "table_row_wise" else -1)
        if opt.kind == "table_row_wise" and len(hosts) != 1:
            continue
        if [(x.rank, x.row_offset, x.rows) for x in kind_shards(opt, spec, topology)] != [
            (x.rank, x.row_offset, x.row_count(spec.rows)) for x in t.shards
        ]:
            notes.append(f"{t.name}: its cut is not the even one, so its ranges are not priced")
            continue
        ratio = ratios(spec, opt)
        if ratio is None or ratio.total <= 0:
            notes.append(f"{t.name}: no model prices it whole against its ranges")
            continue
        parts = [int(k) for k in np.flatnonzero(base.table == ti)]
        m = price[ti] / ratio.total
        doubt = (ratio.spread * m) ** 2 + float(base.var[parts].sum()) / ratio.total**2
        whole = kind_memory(
            "table_wise", spec.rows, spec.dim, spec.dtype, spec.pooling_factor, batch, world
        )
        delta_new = base.delta[:, parts].sum(axis=1, keepdims=True) / ratio.total
        best: KindChange | None = None
        for d in range(world):
            sh = Shard(rank=d, cols=spec.dim)
            search, ext, gone = _changed(
                base, slots, parts, [(sh, doubt, whole.total, True)], [m], delta_new
            )
            first = search.state(search.start)
            if first.mem[d] > topology.usable_bytes:
                continue
            if best is not None and float(search.loads(first).max()) >= best.risk_max:
                continue
            best = KindChange(
                ti, FUSED, d, search, ext, gone, first, ratio,
                whole.weights + whole.optimizer, _said(t.name, t.kind, FUSED, topology)
                + f" on rank {d}",
            )  # fmt: skip
        if best is None:
            notes.append(f"{t.name}: no rank has room for it whole")
            continue
        best.state = _best(best.search, placed, best.removed, bar)
        out.append(best)
    return out, notes


def kind_plan(change: KindChange, plan: Plan) -> list[list[Shard]]:
    """Each table's shards in the changed plan, placed as ``change.state`` says."""
    placed: list[list[Shard]] = [[] for _ in plan.tables]
    for k, (ti, sh) in enumerate(change.slots):
        if not change.removed[k]:
            placed[ti].append(sh.model_copy(update={"rank": int(change.state.rank[k])}))
    return placed


def declined(change: KindChange, without_ms: float, ranks_ms: Sequence[float]) -> str:
    """Why ``change`` was not chosen, with its figures: its predicted and worst
    plausible max against the worst max without it, and the ratio it rests on."""
    rho = ", ".join(f"{r:.2f}" for r in change.ratio.rho if r > 0)
    return (
        f"{change.says} declined: it predicts a max-rank compute of {max(ranks_ms):.1f} ms, "
        f"{change.risk_max:.1f} ms at its worst plausible price, against {without_ms:.1f} ms "
        f"without it (ranges at {rho} of the whole by {change.ratio.source}, "
        f"± {100 * change.ratio.spread:.0f} %; sum {change.ratio.total:.2f})"
    )
