"""An α–β interconnect model fitted to all-to-alls measured on the target (``--comm
fitted:DIR``, docs/comm.md).

The records are read here, not through the profiler's dataset class, because the
planner may not import the profiler (the layers point one way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.comm.model import AlphaBetaComm, exchange_bytes, straggler_wait


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
    x, y = np.asarray(xs), np.asarray(ys)
    if len(set(xs)) < 2 or not (y > 0).all():
        raise UserError(
            f"{source}: {len(xs) // 2} comm record(s) with {len(set(xs))} exchange size(s) "
            "and positive times are needed to fit α and β (at least 2 sizes); measure "
            "more with `shardwise profile comm --samples N`."
        )
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    solution, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    alpha, inv_beta = float(solution[0]), float(solution[1])
    if alpha < 0:
        alpha = 0.0
        inv_beta = float(np.sum(x / y) / np.sum((x / y) ** 2))
    if not inv_beta > 0:
        raise UserError(
            f"{source}: the measured times do not grow with the bytes exchanged "
            f"(fitted slope {inv_beta:.3g} s/B), so no bandwidth can be read from them. "
            "Measure larger exchanges, or use a preset."
        )
    err = float(np.median(np.abs((alpha + x * inv_beta) / y - 1.0)))
    ws = sorted(worlds)
    where = f"W {ws[0]}–{ws[-1]}" if len(ws) > 1 else f"W {ws[0]}"
    return AlphaBetaComm(
        name="fitted",
        alpha_s=float(alpha),
        bytes_per_s=float(1.0 / inv_beta),
        label=f"to {source}: {len(xs) // 2} records, {where}, median error {100 * err:.0f}%",
        source=(
            f"least-relative-error fit of α + bytes/β to the {len(xs) // 2} all-to-alls "
            f"measured in {source} ({where}); median error {100 * err:.0f}%."
        ),
    )
