"""NeuroShard's last step: a local search on the full predicted cost.

Move one shard off the predicted straggler (or off the rank with the slowest forward,
which every rank waits for) to another rank, or swap it with a shard on one of the
least-loaded ranks, whichever lowers the predicted max most; repeat while it falls.
A round prices every move's two changed kernels in one NumPy batch, keeps the
:data:`SCREEN` best by compute with today's all-to-all, and prices those with one
batched call of the comm model. Memory stays a hard limit, and no rank ever holds two
shards of one table.

The bounds keep a round linear in the tables: it moves at most the straggler's
:data:`MAX_SOURCES` costliest shards and swaps them with at most
:data:`MAX_PARTNERS` light-rank shards spread over their costs. Unbounded, a round
priced sources × partners pairs: 2,000 tables on 8 GPUs took 85 s and 1.5 GB here,
10,000 more than 20 GB.
"""

from __future__ import annotations

import numpy as np

from shardwise.planner.neuroshard.problem import F64, I64, Placement, Problem, Shards

#: Moves per round that the comm model prices (after a compute screen).
SCREEN = 32
#: A round's swaps pair the straggler's shards with those on this many least-loaded ranks.
SWAP_RANKS = 4
MAX_SOURCES = 64
MAX_PARTNERS = 256


def local_search(problem: Problem, sh: Shards, start: Placement, max_moves: int) -> Placement:
    """The best placement the moves and swaps reach from ``start`` (``start`` if none helps)."""
    w, head, cap = problem.world, problem.head, problem.cap
    enc, fp16, cols, nbytes, split = sh.enc, sh.fp16, sh.cols, sh.nbytes, sh.split
    dtypes = [d for d in (0, 1) if (fp16 == d).any()]
    best = start
    r = start.ranks.copy()
    solo = problem.solo(sh)  # which to move first, which partners to try
    for _ in range(max_moves):
        compute, comm = best.compute, best.comm
        mem = np.bincount(r, weights=nbytes, minlength=w) + sh.base.mem
        dims = np.bincount(r, weights=cols, minlength=w)
        holds = np.zeros((max(sh.n_split, 1), w), dtype=bool)
        on_split = split >= 0
        holds[split[on_split], r[on_split]] = True
        sources = np.array(sorted({int(np.argmax(best.per_rank)), int(np.argmax(compute[:, 0]))}))
        on_src = costliest(np.flatnonzero(np.isin(r, sources)), solo, MAX_SOURCES)
        # Moves: shard s to rank b (no other shard of its table there).
        free_of = ~holds[np.maximum(split[on_src], 0)] | (split[on_src] < 0)[:, None]
        ms, mb = np.nonzero(
            (np.arange(w)[None, :] != r[on_src, None])
            & (mem[None, :] + nbytes[on_src, None] <= cap)
            & free_of
        )
        # Swaps: s with shard o on one of the least-loaded ranks.
        partners = spread(
            np.flatnonzero(np.isin(r, np.argsort(best.per_rank, kind="stable")[:SWAP_RANKS])),
            solo,
            MAX_PARTNERS,
        )
        same_table = sh.table[partners][None, :] == sh.table[on_src, None]
        s_ok = (split[on_src] < 0)[:, None] | ~holds[np.maximum(split[on_src], 0)][:, r[partners]]
        o_ok = (split[partners] < 0)[None, :] | ~holds[np.maximum(split[partners], 0)][
            :, r[on_src]
        ].T
        ss, so = np.nonzero(
            (r[partners][None, :] != r[on_src, None])
            & ~(same_table & (cols[partners][None, :] == cols[on_src, None]))
            & ((s_ok & o_ok) | same_table)
            & (mem[r[partners]][None, :] + nbytes[on_src, None] - nbytes[partners][None, :] <= cap)
            & (mem[r[on_src], None] + nbytes[partners][None, :] - nbytes[on_src, None] <= cap)
        )
        out = np.concatenate([on_src[ms], on_src[ss]])
        back = np.concatenate([np.full(len(ms), -1), partners[so]])
        if not len(out):
            break
        src = r[out]
        dst = np.concatenate([mb, r[partners[so]]])
        swap = back >= 0
        m = len(out)
        enc_back = np.where(swap[:, None], enc[np.maximum(back, 0)], 0.0).astype(np.float32)
        new_src = np.zeros((m, 2))
        new_dst = np.zeros((m, 2))
        for d in dtypes:
            on = fp16 == d
            sums = np.zeros((w, enc.shape[1]), dtype=np.float32)
            np.add.at(sums, r[on], enc[on])
            counts = np.bincount(r[on], minlength=w).astype(np.int64)
            go = fp16[out] == d
            come = swap & (fp16[np.maximum(back, 0)] == d)
            moved = go[:, None] * enc[out] - come[:, None] * enc_back
            shift = go.astype(np.int64) - come.astype(np.int64)
            new_src += head.seconds(np.maximum(sums[src] - moved, 0.0), counts[src] - shift)
            new_dst += head.seconds(np.maximum(sums[dst] + moved, 0.0), counts[dst] + shift)
        new_src += sh.base.compute[src]  # the coded tables' kernels stay
        new_dst += sh.base.compute[dst]
        rows = np.arange(m)
        fwd = np.repeat(compute[None, :, 0], m, axis=0)
        bwd = np.repeat(compute[None, :, 1], m, axis=0)
        fwd[rows, src], bwd[rows, src] = new_src[:, 0], new_src[:, 1]
        fwd[rows, dst], bwd[rows, dst] = new_dst[:, 0], new_dst[:, 1]
        # Screen with today's all-to-all; only the most promising get the comm model.
        rough = (fwd.max(axis=1, keepdims=True) + bwd + comm[None, :, 1]).max(axis=1)
        keep = np.argsort(rough, kind="stable")[:SCREEN]
        width = cols[out] - np.where(swap, cols[np.maximum(back, 0)], 0)
        new_dims = np.repeat(dims[None, :], len(keep), axis=0).astype(np.float64)
        new_dims[np.arange(len(keep)), src[keep]] -= width[keep]
        new_dims[np.arange(len(keep)), dst[keep]] += width[keep]
        fwd_c, bwd_c = problem.comm(new_dims, fwd[keep], sh.base)
        score = (fwd[keep] + bwd[keep] + fwd_c + bwd_c).max(axis=1)
        k = int(np.argmin(score))
        if not score[k] < best.score * (1 - 1e-6):
            break
        k = int(keep[k])
        r = r.copy()
        if back[k] >= 0:
            r[back[k]] = src[k]
        r[out[k]] = dst[k]
        best = problem.place(sh, r, best.scale, best.scales)
    return best


def costliest(idx: I64, solo: F64, k: int) -> I64:
    """The ``k`` shards of ``idx`` that cost most alone, in index order (all if fewer)."""
    if len(idx) <= k:
        return idx
    return np.sort(idx[np.argsort(-solo[idx], kind="stable")[:k]])


def spread(idx: I64, solo: F64, k: int) -> I64:
    """``k`` shards of ``idx`` evenly spread over their costs alone (all if fewer), so
    that swaps can trade a heavy shard for a light one or a near-equal one."""
    if len(idx) <= k:
        return idx
    ordered = idx[np.argsort(solo[idx], kind="stable")]
    return np.sort(ordered[np.linspace(0, len(ordered) - 1, k).round().astype(np.int64)])
