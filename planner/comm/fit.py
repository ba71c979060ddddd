"""An α–β interconnect model fitted to all-to-alls measured on the target (``--comm
fitted:DIR``, docs/comm.md), and to its reduce-scatters and all-reduces where the comm
dataset holds them (a record's ``extra["collectives"]``).

The records are read here, not through the profiler's dataset class, because the
planner may not import the profiler (the layers point one way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.comm.model import (
    AlphaBetaComm,
    exchange_bytes,
    ring_bytes,
    straggler_wait,
)

#: The collectives a comm record may carry besides its all-to-all, and what each
#: prices (:mod:`shardwise.planner.comm.collectives`).
COLLECTIVES = {
    "reduce_scatter": "reduce-scatters/all-gathers",
    "all_reduce": "all-reduces",
}


def load_comm_records(directory: Path) -> list[dict[str, Any]]:
    """The records of a comm dataset (``shardwise profile comm --out DIR``).

    Read here, not through the profiler's dataset class, because the planner may not
    import the profiler; the fields :func:`fit_alpha_beta` uses are checked there. An
    unterminated last line (an interrupted append) is skipped, as the dataset does.
    """
    manifest, records = directory / "dataset.json", directory / "records.jsonl"
    try:
        kind = json.loads(manifest.read_text(encoding="utf-8")).get("kind")
        text = records.read_text(encoding="utf-8")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(
            f"--comm fitted:{directory}: not a readable comm dataset ({e}). Measure one "
            f"with `shardwise profile comm --out {directory}`."
        ) from None
    if kind != "comm":
        raise UserError(
            f"--comm fitted:{directory}: {manifest} is a {kind!r} dataset; give the "
            "directory `shardwise profile comm --out DIR` wrote."
        )
    lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            raise UserError(f"{records} line {n}: not a JSON record ({e}).") from None
    return out


def _record_points(rec: Mapping[str, Any], where: str) -> tuple[float, float, float]:
    """(bytes, median transfer seconds forward, backward) of one record."""
    try:
        batch = int(rec["batch_size"])
        dims = np.asarray([rec["dims"]], dtype=np.float64)
        delays = np.asarray([rec["delays_s"]], dtype=np.float64)
        fwd = np.asarray(rec["fwd_s"], dtype=np.float64)
        bwd = np.asarray(rec["bwd_s"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"{where}: a comm record needs batch_size, dims, delays_s, fwd_s and bwd_s "
            f"({type(e).__name__}: {e})."
        ) from None
    w = dims.shape[1]
    if w < 2 or batch < 1 or not (delays.shape[1] == fwd.size == bwd.size == w):
        raise UserError(f"{where}: needs ≥ 2 ranks, a batch ≥ 1 and one entry per rank.")
    transfer = fwd - straggler_wait(delays)[0]  # the forward without the wait
    return (
        float(exchange_bytes(dims, batch)[0]),
        float(np.median(transfer)),
        float(np.median(bwd)),
    )


def fit_alpha_beta(records: Iterable[Mapping[str, Any]], source: str) -> AlphaBetaComm:
    """α and β from measured all-to-alls (comm dataset records), named ``fitted``.

    Each record gives two points: its exchange's bytes against the median over ranks
    of the backward, and of the forward less each rank's straggler wait. The line
    ``α + bytes/β`` is fitted by least relative error (the times span decades), α
    kept ≥ 0. The source names ``source``, the records, the world sizes and the fit's
    median error, so a fit to a noisy or tiny dataset says so.
    """
    xs: list[float] = []
    ys: list[float] = []
    worlds: set[int] = set()
    for i, rec in enumerate(records):
        size, f, b = _record_points(rec, f"{source}, record {rec.get('index', i)}")
        xs += [size, size]
        ys += [f, b]
        worlds.add(len(rec["dims"]))
    ws = sorted(worlds)
    where = f"W {ws[0]}–{ws[-1]}" if len(ws) > 1 else f"W {ws[0]}" if ws else "no W"
    return fit_line(xs, ys, source, "all-to-alls", where, "fitted")


def fit_line(
    xs: list[float],
    ys: list[float],
    source: str,
    what: str,
    where: str,
    name: str,
    records: int | None = None,
) -> AlphaBetaComm:
    """α + bytes/β through the points by least relative error (α ≥ 0), named ``name``;
    ``records``: the measurements they come from (default: two points each)."""
    x, y = np.asarray(xs), np.asarray(ys)
    if len(set(xs)) < 2 or not (y > 0).all():
        raise UserError(
            f"{source}: {len(xs) // 2} comm record(s) with {len(set(xs))} exchange size(s) "
            f"and positive times are needed to fit α and β of its {what} (at least 2 "
            "sizes); measure more with `shardwise profile comm --samples N`."
        )
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    solution, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    alpha, inv_beta = float(solution[0]), float(solution[1])
    if alpha < 0:
        alpha = 0.0
        inv_beta = float(np.sum(x / y) / np.sum((x / y) ** 2))
    if not inv_beta > 0:
        raise UserError(
            f"{source}: the measured times of its {what} do not grow with the bytes "
            f"exchanged (fitted slope {inv_beta:.3g} s/B), so no bandwidth can be read from "
            "them. Measure larger exchanges, or use a preset."
        )
    err = float(np.median(np.abs((alpha + x * inv_beta) / y - 1.0)))
    n = len(xs) // 2 if records is None else records
    return AlphaBetaComm(
        name=name,
        alpha_s=float(alpha),
        bytes_per_s=float(1.0 / inv_beta),
        label=f"to {source}: {n} records, {where}, median error {100 * err:.0f}%",
        source=(
            f"least-relative-error fit of α + bytes/β to the {n} {what} measured in "
            f"{source} ({where}); median error {100 * err:.0f}%."
        ),
    )


@dataclass
class CollectivePoints:
    """One collective's measurements: per point the bytes a rank moves in its ring,
    the median seconds over ranks, the world size and the backend that ran it; two
    points (forward, backward) a reduce-scatter, one (backward) an all-reduce."""

    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    worlds: list[int] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    #: The world size of each measured collective (a record's entry) they come from.
    record_worlds: list[int] = field(default_factory=list)

    @property
    def records(self) -> int:
        """Measured collectives (records' entries) the points come from."""
        return len(self.record_worlds)

    def at(self, world: int) -> CollectivePoints:
        """The points measured at ``world`` ranks."""
        keep = [i for i, w in enumerate(self.worlds) if w == world]
        return CollectivePoints(
            [self.xs[i] for i in keep],
            [self.ys[i] for i in keep],
            [world] * len(keep),
            [self.backends[i] for i in keep],
            [w for w in self.record_worlds if w == world],
        )


def collective_points(records: Iterable[Mapping[str, Any]]) -> dict[str, CollectivePoints]:
    """Per collective name, the points of every record's ``extra["collectives"]``.
    Malformed entries are skipped: the all-to-all's fit checks the records themselves."""
    out: dict[str, CollectivePoints] = {}
    for rec in records:
        extra = rec.get("extra") or {}
        if not isinstance(extra, Mapping):
            continue
        backend = str(extra.get("backend", "gloo"))
        for c in extra.get("collectives", []):
            try:
                name, size, w = str(c["name"]), float(c["bytes"]), int(c["world_size"])
                times = [float(np.median(c[k])) for k in ("fwd_s", "bwd_s") if c.get(k)]
            except (KeyError, TypeError, ValueError):
                continue
            if name not in COLLECTIVES or w < 2 or size <= 0 or not times:
                continue
            pts = out.setdefault(name, CollectivePoints())
            pts.record_worlds.append(w)
            for t in times:
                pts.xs.append(ring_bytes(name, size, w))
                pts.ys.append(t)
                pts.worlds.append(w)
                pts.backends.append(backend)
    return out


def fit_comm(records: Iterable[Mapping[str, Any]], source: str) -> AlphaBetaComm:
    """:func:`fit_alpha_beta`, with each other collective the records measured
    (reduce-scatter, all-reduce) fitted on the bytes a rank moves in its ring and kept
    in ``collectives``; one measured at fewer than 2 sizes is left to the links."""
    recs = list(records)
    fitted = fit_alpha_beta(recs, source)
    extra = []
    for name, pts in collective_points(recs).items():
        if len(set(pts.xs)) < 2:
            continue
        ws = sorted(set(pts.worlds))
        where = f"W {ws[0]}–{ws[-1]}" if len(ws) > 1 else f"W {ws[0]}"
        try:
            fit = fit_line(
                pts.xs, pts.ys, source, COLLECTIVES[name], where, f"fitted {name}", pts.records
            )
        except UserError:  # no bandwidth in them: the all-to-all's fit prices them
            continue
        extra.append((name, fit))
    return replace(fitted, collectives=tuple(sorted(extra))) if extra else fitted
