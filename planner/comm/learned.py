"""The collectives a cost model learned: the row-wise reduce-scatter (with its
all-gather) and the data-parallel all-reduce, each an α–β line fitted at pre-training
to the comm dataset's measured collectives (docs/comm.md).

Pre-training keeps them in the model file, ``metadata["comm_collectives"]``, one entry
a collective (:meth:`LearnedCollective.to_json`); a calibration rescales them with
``metadata["calibration"]["collective_factors"]`` (:func:`collective_factors`), as the
all-to-all's speed factor rescales its network. :class:`~shardwise.planner.comm.model.
LearnedComm` carries them, and :func:`~shardwise.planner.comm.collectives.host_links`
prices the other kinds' collectives with them on one host, and within each host of a
job that spans several.

A label says what a figure is worth: ``learned`` only at a world size the fit rests
on honest measurements of, each rank with its own GPU or core. Gloo with more ranks
than the measuring host's cores measures its OS scheduler, not a network
(docs/design.md §6), so those figures, and any across hosts, stay ``modelled``.

Free of torch, and of the profiler: the records are plain mappings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.comm.fit import COLLECTIVES, collective_points, fit_line
from shardwise.planner.comm.model import AlphaBetaComm, ring_bytes

#: Where pre-training keeps the fits in a model's metadata.
COLLECTIVES_KEY = "comm_collectives"
#: Where a calibration keeps its factors, in ``metadata["calibration"]``.
FACTORS_KEY = "collective_factors"
_RETRAIN = "Re-create it with `shardwise pretrain` (or `make pretrain` for the bundled one)."
#: Measured or predicted times below this are noise, not a ratio to trust.
_FLOOR_S = 1e-7


def _span(worlds: Iterable[int]) -> str:
    ws = sorted(set(worlds))
    return f"W {ws[0]}–{ws[-1]}" if len(ws) > 1 else f"W {ws[0]}"


@dataclass(frozen=True)
class LearnedCollective:
    """One collective's α–β (``name``: ``reduce_scatter`` or ``all_reduce``), on the
    bytes a rank moves in its ring (:func:`~shardwise.planner.comm.model.ring_bytes`),
    and what it rests on."""

    name: str
    alpha_s: float
    bytes_per_s: float
    #: Measured collectives the line was fitted to.
    records: int
    world_sizes: tuple[int, ...]
    #: The largest world size at which every rank had its own GPU or core when measured
    #: (0: none); above it the measurement timed the scheduler.
    honest_up_to: int
    median_error: float
    #: Where it was measured: "gloo on 2 CPU core(s)", "nccl, a GPU per rank".
    measured_on: str
    #: This machine's seconds over the fit's (a calibration's), and what gave it.
    factor: float = 1.0
    factor_from: str = ""

    @property
    def what(self) -> str:
        return "reduce-scatter" if self.name == "reduce_scatter" else "all-reduce"

    def link(self) -> AlphaBetaComm:
        """The line as a link (with the factor): what the collectives' α–β prices on."""
        return AlphaBetaComm(
            name=f"learned {self.name}",
            alpha_s=self.alpha_s * self.factor,
            bytes_per_s=self.bytes_per_s / self.factor,
            source=self.phrase(),
            label=self.phrase(),
            kind="learned",
        )

    def seconds(self, size: float, world: int) -> float:
        """One collective of ``size`` bytes (a reduce-scatter's input, an all-reduce's
        buffer) over ``world`` ranks on one host, with the factor."""
        if size <= 0 or world < 2:
            return 0.0
        moved = ring_bytes(self.name, size, world)
        return self.factor * (self.alpha_s + moved / self.bytes_per_s)

    def phrase(self) -> str:
        """``fitted to 80 reduce-scatters, W 2–8, median error 9 % (gloo on 2 CPU
        core(s))``, with the calibration's factor when there is one."""
        text = (
            f"fitted to {self.records} {self.what}s, {_span(self.world_sizes)}, median error "
            f"{100 * self.median_error:.0f} % ({self.measured_on})"
        )
        if self.factor != 1.0:
            text += f", ×{self.factor:.3g} by {self.factor_from or 'a calibration'}"
        return text

    def label(self, world: int) -> str:
        """What prices this collective at ``world`` ranks on one host: ``learned`` where
        the fit rests on honest measurements at that size, else ``modelled`` and why."""
        lo, hi = min(self.world_sizes), max(self.world_sizes)
        if lo <= world <= min(hi, self.honest_up_to):
            return f"learned: {self.phrase()}"
        if world > hi or world < lo:
            why = f"W {world} was not measured: its ring bytes carry the fit there"
        else:
            why = (
                f"at W {world} the measurement ({self.measured_on}) timed the OS scheduler, "
                "not a network"
            )
        return f"modelled: the {self.what} {self.phrase()}; {why}"

    def to_json(self) -> dict[str, Any]:
        """The model file's entry (the fit alone: a calibration's factor lives apart)."""
        return {
            "alpha_s": self.alpha_s,
            "bytes_per_s": self.bytes_per_s,
            "records": self.records,
            "world_sizes": list(self.world_sizes),
            "honest_up_to": self.honest_up_to,
            "median_error": self.median_error,
            "measured_on": self.measured_on,
        }


# ------------------------------------------------------------------ fitting


def honest_limit(backends: Iterable[str], worlds: Iterable[int], cores: int) -> int:
    """The largest world size measured honestly: every one where nccl ran (a GPU per
    rank), else those up to the measuring host's ``cores`` (gloo, a core per rank)."""
    ws = sorted(set(worlds))
    if not ws:
        return 0
    if set(backends) == {"nccl"}:
        return ws[-1]
    return max((w for w in ws if w <= cores), default=0)


def fit_learned(
    records: Iterable[Mapping[str, Any]], source: str, *, cores: int
) -> dict[str, LearnedCollective]:
    """Each collective the comm records measured (``extra["collectives"]``), as an α–β
    line by least relative error; ``cores``: the measuring host's (its fingerprint's),
    which bounds the honest world sizes under gloo. A collective measured at fewer than
    2 sizes, or whose times do not grow with its bytes, is left out (the links price
    it, as before)."""
    out: dict[str, LearnedCollective] = {}
    for name, pts in collective_points(records).items():
        if len(set(pts.xs)) < 2:
            continue
        try:
            fit = fit_line(
                pts.xs, pts.ys, source, COLLECTIVES[name], _span(pts.worlds), name, pts.records
            )
        except UserError:
            continue
        pred = fit.alpha_s + np.asarray(pts.xs) / fit.bytes_per_s
        err = float(np.median(np.abs(pred / np.asarray(pts.ys) - 1.0)))
        backends = sorted(set(pts.backends))
        on = (
            "nccl, a GPU per rank"
            if backends == ["nccl"]
            else f"{'/'.join(backends) or 'gloo'} on {cores} CPU core(s)"
        )
        out[name] = LearnedCollective(
            name=name,
            alpha_s=fit.alpha_s,
            bytes_per_s=fit.bytes_per_s,
            records=pts.records,
            world_sizes=tuple(sorted(set(pts.worlds))),
            honest_up_to=honest_limit(pts.backends, pts.worlds, cores),
            median_error=err,
            measured_on=on,
        )
    return out


def collectives_metadata(fits: Mapping[str, LearnedCollective]) -> dict[str, Any]:
    """``metadata["comm_collectives"]``: plain JSON, so the file loads weights-only."""
    return {name: fits[name].to_json() for name in sorted(fits)}


# ------------------------------------------------------------------ reading back


def _fail(source: str, where: str, problem: str) -> UserError:
    return UserError(f"{source}: metadata.{where} {problem}. {_RETRAIN}")


def _number(value: object, source: str, where: str, low: float, strict: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        bound = f"> {low:g}" if strict else f"≥ {low:g}"
        raise _fail(source, where, f"is {value!r}, not a finite number {bound}")
    return float(value)  # type: ignore[arg-type]


def _entry(name: str, raw: object, source: str) -> LearnedCollective:
    where = f"{COLLECTIVES_KEY}.{name}"
    if not isinstance(raw, Mapping):
        raise _fail(source, where, f"is a {type(raw).__name__}, not a mapping")
    worlds = raw.get("world_sizes")
    if (
        not isinstance(worlds, list)
        or not worlds
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 2 for w in worlds)
    ):
        raise _fail(source, f"{where}.world_sizes", f"is {worlds!r}, not a list of integers ≥ 2")
    records = raw.get("records")
    if not isinstance(records, int) or isinstance(records, bool) or records < 1:
        raise _fail(source, f"{where}.records", f"is {records!r}, not an integer ≥ 1")
    honest = raw.get("honest_up_to")
    if not isinstance(honest, int) or isinstance(honest, bool) or honest < 0:
        raise _fail(source, f"{where}.honest_up_to", f"is {honest!r}, not an integer ≥ 0")
    on = raw.get("measured_on")
    if not isinstance(on, str) or not on:
        raise _fail(source, f"{where}.measured_on", f"is {on!r}, not a description")
    return LearnedCollective(
        name=name,
        alpha_s=_number(raw.get("alpha_s"), source, f"{where}.alpha_s", 0.0, False),
        bytes_per_s=_number(raw.get("bytes_per_s"), source, f"{where}.bytes_per_s", 0.0, True),
        records=records,
        world_sizes=tuple(sorted(set(worlds))),
        honest_up_to=honest,
        median_error=_number(raw.get("median_error"), source, f"{where}.median_error", 0, False),
        measured_on=on,
    )


def _factors(metadata: Mapping[str, Any], source: str) -> tuple[dict[str, float], str]:
    """A calibration's factors by collective, and what gave them: its own
    (``collective_factors``), else its all-to-all speed factor (the same gloo or nccl
    stack on the same machine), else none."""
    cal = metadata.get("calibration")
    if not isinstance(cal, Mapping):
        return {}, ""
    own = cal.get(FACTORS_KEY)
    if own is not None:
        where = f"calibration.{FACTORS_KEY}"
        if not isinstance(own, Mapping):
            raise _fail(source, where, f"is a {type(own).__name__}, not a mapping")
        out = {}
        for name, entry in own.items():
            if name not in COLLECTIVES or not isinstance(entry, Mapping):
                raise _fail(source, f"{where}.{name}", "is not a collective's factor")
            out[str(name)] = _number(entry.get("factor"), source, f"{where}.{name}.factor", 0, True)
        return out, "this machine's calibration"
    speed = cal.get("speed_factors")
    comm = speed.get("comm", 1.0) if isinstance(speed, Mapping) else 1.0
    if isinstance(comm, int | float) and math.isfinite(comm) and comm > 0 and comm != 1.0:
        return {n: float(comm) for n in COLLECTIVES}, "the calibration's all-to-all factor"
    return {}, ""


def learned_collectives(
    metadata: Mapping[str, Any], source: str = "the cost model"
) -> dict[str, LearnedCollective]:
    """A model's fitted collectives (none in a model pre-trained without them), with
    its calibration's factors; a :class:`UserError` naming the field when damaged."""
    raw = metadata.get(COLLECTIVES_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail(source, COLLECTIVES_KEY, f"is a {type(raw).__name__}, not a mapping")
    unknown = sorted(str(k) for k in raw if k not in COLLECTIVES)
    if unknown:
        raise _fail(
            source,
            COLLECTIVES_KEY,
            f"has unknown keys {unknown} (it holds {', '.join(COLLECTIVES)})",
        )
    fits = {str(name): _entry(str(name), entry, source) for name, entry in raw.items()}
    factors, origin = _factors(metadata, source)
    return {
        name: replace(fit, factor=factors[name], factor_from=origin) if name in factors else fit
        for name, fit in fits.items()
    }


# ------------------------------------------------------------------ calibration


def collective_factors(
    fits: Mapping[str, LearnedCollective], records: Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``metadata["calibration"]["collective_factors"]`` from collectives measured on
    this machine (comm records with ``extra["collectives"]``): per fitted collective,
    its factor times exp(median log(measured / predicted)), as the all-to-all's speed
    factor is fitted, so the median of a noisy neighbour's spikes cannot move it. Only
    collectives both fitted and measured get one."""
    out: dict[str, dict[str, Any]] = {}
    pts = collective_points(records)
    for name, fit in fits.items():
        got = pts.get(name)
        if got is None:
            continue
        measured = np.asarray(got.ys)
        predicted = fit.factor * (fit.alpha_s + np.asarray(got.xs) / fit.bytes_per_s)
        ok = (measured > _FLOOR_S) & (predicted > _FLOOR_S)
        if not ok.any():
            continue
        ratio = math.exp(float(np.median(np.log(measured[ok] / predicted[ok]))))
        out[name] = {
            "factor": fit.factor * ratio,
            "samples": got.records,
            "world_sizes": sorted(set(got.worlds)),
        }
    return out
