"""The collectives a cost model learned: the row-wise reduce-scatter (with its
all-gather) and the data-parallel all-reduce, each one α–β line per world size,
fitted at pre-training to the comm dataset's measured collectives (docs/comm.md).

Pre-training keeps them in the model file, ``metadata["comm_collectives"]``, one entry
a collective (:meth:`LearnedCollective.to_json`); a calibration rescales them with
``metadata["calibration"]["collective_factors"]`` (:func:`collective_factors`), as the
all-to-all's speed factor rescales its network. :func:`model_collectives` reads them
for a :class:`~shardwise.planner.comm.model.LearnedComm`, and
:func:`~shardwise.planner.comm.collectives.host_links`
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
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.comm.fit import COLLECTIVES, CollectivePoints, collective_points, fit_line
from shardwise.planner.comm.model import AlphaBetaComm, LearnedComm, ring_bytes

#: Where pre-training keeps the fits in a model's metadata.
COLLECTIVES_KEY = "comm_collectives"
#: Where a calibration keeps its factors, in ``metadata["calibration"]``.
FACTORS_KEY = "collective_factors"
_RETRAIN = "Re-create it with `shardwise pretrain` (or `make pretrain` for the bundled one)."
_RECALIBRATE = "Calibrate it again with `shardwise calibrate`."
#: Measured or predicted times below this are noise, not a ratio to trust.
_FLOOR_S = 1e-7


@dataclass(frozen=True)
class CollectiveLine:
    """α + bytes/β at one world size, fitted to ``records`` collectives measured there."""

    world: int
    alpha_s: float
    bytes_per_s: float
    records: int
    median_error: float

    def to_json(self) -> dict[str, Any]:
        return {
            "alpha_s": self.alpha_s,
            "bytes_per_s": self.bytes_per_s,
            "records": self.records,
            "median_error": self.median_error,
        }


@dataclass(frozen=True)
class LearnedCollective:
    """One collective (``name``: ``reduce_scatter`` or ``all_reduce``) as one α–β line
    per measured world size, on the bytes a rank moves in its ring
    (:func:`~shardwise.planner.comm.model.ring_bytes`), and what the lines rest on.

    A line a world size, not one for all: gloo's ranks beyond the host's cores queue
    for them, which adds to every call (this machine's α is 0.65 ms at W 2, 6 ms at
    W 4, 22 ms at W 8), so one line through them all is off by 60–80 %."""

    name: str
    #: By world size, ascending.
    lines: tuple[CollectiveLine, ...]
    #: The largest world size at which every rank had its own GPU or core when measured
    #: (0: none); above it the measurement timed the scheduler.
    honest_up_to: int
    #: Where it was measured: "gloo on 2 CPU core(s)", "nccl, a GPU per rank".
    measured_on: str
    #: This machine's seconds over the fit's (a calibration's), and what gave it.
    factor: float = 1.0
    factor_from: str = ""

    @property
    def what(self) -> str:
        return "reduce-scatter" if self.name == "reduce_scatter" else "all-reduce"

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(line.world for line in self.lines)

    def line(self, world: int) -> CollectiveLine:
        """The line measured at ``world`` ranks, else at the nearest world size
        measured (the larger of two as near)."""
        return min(self.lines, key=lambda x: (abs(x.world - world), -x.world))

    @cached_property
    def _links(self) -> dict[int, AlphaBetaComm]:
        return {
            line.world: AlphaBetaComm(
                name=f"learned {self.name} at W {line.world}",
                alpha_s=line.alpha_s * self.factor,
                bytes_per_s=line.bytes_per_s / self.factor,
                source=self.phrase(line.world),
                label=self.phrase(line.world),
                kind="learned",
            )
            for line in self.lines
        }

    def link(self, world: int) -> AlphaBetaComm:
        """The line for ``world`` ranks as a link (with the factor): what the
        collectives' α–β prices on."""
        return self._links[self.line(world).world]

    def seconds(self, size: float, world: int) -> float:
        """One collective of ``size`` bytes (a reduce-scatter's input, an all-reduce's
        buffer) over ``world`` ranks on one host, with the factor."""
        if size <= 0 or world < 2:
            return 0.0
        link = self.link(world)
        return link.alpha_s + ring_bytes(self.name, size, world) / link.bytes_per_s

    def phrase(self, world: int) -> str:
        """``fitted to 80 reduce-scatters at W 2, median error 9 % (gloo on 2 CPU
        core(s))``: the line used at ``world``, with the calibration's factor."""
        line = self.line(world)
        text = (
            f"fitted to {line.records} {self.what}s at W {line.world}, median error "
            f"{100 * line.median_error:.0f} % ({self.measured_on})"
        )
        if self.factor != 1.0:
            text += f", ×{self.factor:.3g} by {self.factor_from or 'a calibration'}"
        return text

    def label(self, world: int) -> str:
        """What prices this collective at ``world`` ranks on one host: ``learned`` where
        a line was measured honestly at that size, else ``modelled`` and why."""
        line = self.line(world)
        if line.world == world and world <= self.honest_up_to:
            return f"learned: {self.phrase(world)}"
        if line.world != world:
            why = f"W {world} was not measured: the line of W {line.world} prices it"
        else:
            why = (
                f"at W {world} the measurement ({self.measured_on}) timed the OS scheduler, "
                "not a network"
            )
        return f"modelled: the {self.what} {self.phrase(world)}; {why}"

    def to_json(self) -> dict[str, Any]:
        """The model file's entry (the fit alone: a calibration's factor lives apart)."""
        return {
            "measured_on": self.measured_on,
            "honest_up_to": self.honest_up_to,
            "by_world": {str(line.world): line.to_json() for line in self.lines},
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


def _line(pts: CollectivePoints, name: str, world: int, source: str) -> CollectiveLine | None:
    """The line through one world size's points; None below 2 sizes, or where the
    times do not grow with the bytes (no bandwidth in them)."""
    if len(set(pts.xs)) < 2:
        return None
    try:
        fit = fit_line(pts.xs, pts.ys, source, COLLECTIVES[name], f"W {world}", name, pts.records)
    except UserError:
        return None
    pred = fit.alpha_s + np.asarray(pts.xs) / fit.bytes_per_s
    err = float(np.median(np.abs(pred / np.asarray(pts.ys) - 1.0)))
    return CollectiveLine(world, fit.alpha_s, fit.bytes_per_s, pts.records, err)


def fit_learned(
    records: Iterable[Mapping[str, Any]], source: str, *, cores: int
) -> dict[str, LearnedCollective]:
    """Each collective the comm records measured (``extra["collectives"]``), as one
    α–β line per world size by least relative error; ``cores``: the measuring host's
    (its fingerprint's), which bounds the honest world sizes under gloo. A world size
    measured at fewer than 2 sizes, or whose times do not grow with the bytes, gets no
    line; a collective without any is left out (the links price it, as before)."""
    out: dict[str, LearnedCollective] = {}
    for name, pts in collective_points(records).items():
        lines = [
            line
            for w in sorted(set(pts.worlds))
            if (line := _line(pts.at(w), name, w, source)) is not None
        ]
        if not lines:
            continue
        backends = sorted(set(pts.backends))
        on = (
            "nccl, a GPU per rank"
            if backends == ["nccl"]
            else f"{'/'.join(backends)} on {cores} CPU core(s)"
        )
        out[name] = LearnedCollective(
            name=name,
            lines=tuple(lines),
            honest_up_to=honest_limit(pts.backends, pts.worlds, cores),
            measured_on=on,
        )
    return out


def collectives_metadata(fits: Mapping[str, LearnedCollective]) -> dict[str, Any]:
    """``metadata["comm_collectives"]``: plain JSON, so the file loads weights-only."""
    return {name: fits[name].to_json() for name in sorted(fits)}


# ------------------------------------------------------------------ reading back


def _fail(source: str, where: str, problem: str) -> UserError:
    fix = _RECALIBRATE if where.startswith("calibration.") else _RETRAIN
    return UserError(f"{source}: metadata.{where} {problem}. {fix}")


def _number(value: object, source: str, where: str, low: float, strict: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        bound = f"> {low:g}" if strict else f"≥ {low:g}"
        raise _fail(source, where, f"is {value!r}, not a finite number {bound}")
    return float(value)  # type: ignore[arg-type]


def _count(value: object, source: str, where: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _fail(source, where, f"is {value!r}, not an integer ≥ {low}")
    return value


def _line_entry(key: object, line: object, at: str, source: str) -> CollectiveLine:
    if not str(key).isdigit() or int(str(key)) < 2:
        raise _fail(source, at, "is not keyed by a world size ≥ 2")
    if not isinstance(line, Mapping):
        raise _fail(source, at, f"is a {type(line).__name__}, not a mapping")

    def num(field: str, low: float, strict: bool) -> float:
        return _number(line.get(field), source, f"{at}.{field}", low, strict)

    return CollectiveLine(
        world=int(str(key)),
        alpha_s=num("alpha_s", 0.0, False),
        bytes_per_s=num("bytes_per_s", 0.0, True),
        records=_count(line.get("records"), source, f"{at}.records", 1),
        median_error=num("median_error", 0.0, False),
    )


def _entry(name: str, raw: object, source: str) -> LearnedCollective:
    where = f"{COLLECTIVES_KEY}.{name}"
    if not isinstance(raw, Mapping):
        raise _fail(source, where, f"is a {type(raw).__name__}, not a mapping")
    by_world = raw.get("by_world")
    if not isinstance(by_world, Mapping) or not by_world:
        raise _fail(source, f"{where}.by_world", f"is {by_world!r}, not lines by world size")
    lines = [
        _line_entry(key, line, f"{where}.by_world.{key}", source) for key, line in by_world.items()
    ]
    on = raw.get("measured_on")
    if not isinstance(on, str) or not on:
        raise _fail(source, f"{where}.measured_on", f"is {on!r}, not a description")
    return LearnedCollective(
        name=name,
        lines=tuple(sorted(lines, key=lambda x: x.world)),
        honest_up_to=_count(raw.get("honest_up_to"), source, f"{where}.honest_up_to", 0),
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


_OF_MODEL: weakref.WeakKeyDictionary[LearnedComm, dict[str, LearnedCollective]] = (
    weakref.WeakKeyDictionary()
)


def model_collectives(comm: LearnedComm) -> dict[str, LearnedCollective]:
    """The reduce-scatter and all-reduce fits of ``comm``'s cost model, with its
    calibration's factors (:func:`learned_collectives`); none in a model pre-trained
    without them, whose collectives the presets price. Read once per comm model."""
    if comm not in _OF_MODEL:
        model = comm.predictor.model
        _OF_MODEL[comm] = learned_collectives(model.metadata, model.source)
    return _OF_MODEL[comm]


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
        predicted = np.asarray(
            [
                fit.link(w).alpha_s + x / fit.link(w).bytes_per_s
                for x, w in zip(got.xs, got.worlds, strict=True)
            ]
        )
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
