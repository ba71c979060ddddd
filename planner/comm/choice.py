"""Which comm model a ``--comm`` value names, and what ``auto`` picks (docs/comm.md).

``auto`` measures only where the host can measure honestly (each rank its own GPU or
core); elsewhere it uses the cost model's network or an interconnect preset, and says
why. Apart from :mod:`shardwise.planner.comm.model` so the models need not know the
predictor or the fit, which build on them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.basics import UserError
from shardwise.planner.comm.fit import fit_comm, load_comm_records
from shardwise.planner.comm.hosts import HOST_PRESETS, default_preset
from shardwise.planner.comm.model import (
    PRESETS,
    AlphaBetaComm,
    CommModel,
    LearnedComm,
    MeasuredComm,
    format_bandwidth,
    format_seconds,
)

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor
    from shardwise.planner.topology import Topology


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def honest_comm_measurement(world: int, device: str | None) -> str | None:
    """None when this host can measure a ``world``-rank all-to-all honestly (each rank
    its own GPU, or its own core), else why not (docs/design.md §6)."""
    if world <= 1:
        return None
    gpus = 0 if device == "cpu" else _cuda_count()
    if gpus >= world:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores >= world:
        return None
    return (
        f"{world} ranks but {cores} CPU core(s)"
        + (f" and {gpus} GPU(s)" if gpus else "")
        + f" here: {world} gloo processes on {cores} core(s) measure the OS scheduler, "
        "not a network"
    )


#: The values of ``--comm`` besides the presets, and what each means.
COMM_VALUES = {
    "auto": "measured (evaluator) or learned (planner) where each rank has its own GPU "
    "or core, else the nvlink preset (W ≤ 8) or the hgx-h100 host preset (W > 8)",
    "measured": "real all-to-alls, and on one host the other kinds' collectives (evaluator only)",
    "model": "the cost model's all-to-all network",
    "fitted:DIR": "α–β fitted to a comm dataset (`shardwise profile comm --out DIR`), "
    "its reduce-scatters and all-reduces too where it holds them",
    "alpha-beta:US,GBPS": "your own α in µs and β in GB/s per GPU, e.g. alpha-beta:30,6.25",
}


def comm_choices() -> str:
    """Every ``--comm`` value in one line, for help texts and errors."""
    values = "; ".join(f"{k}: {v}" for k, v in COMM_VALUES.items())
    presets = "; ".join(
        f"{p.name}: {p.label} (α {format_seconds(p.alpha_s)}, {format_bandwidth(p.bytes_per_s)})"
        for p in PRESETS.values()
    )
    hosts = "; ".join(
        f"{h.name}: {h.label}, {h.intra.name} within a host, {h.inter.label} between "
        f"({format_bandwidth(h.inter.bytes_per_s)})"
        for h in HOST_PRESETS.values()
    )
    return f"{values}; presets: {presets}; host presets: {hosts}"


def _learned(predictor: CostPredictor | None, reason: str | None) -> LearnedComm:
    if predictor is None:
        raise UserError(
            "--comm model: no cost model is at hand to price the all-to-all; give a "
            "preset or fitted:DIR instead (docs/comm.md)."
        )
    if predictor.model.comm is None:
        raise UserError(
            f"--comm model: {predictor.model.source} has no all-to-all network (it was "
            "trained without a comm dataset); give a preset or fitted:DIR instead."
        )
    return LearnedComm(predictor, auto_reason=reason)


def _declared_alpha_beta(value: str) -> AlphaBetaComm:
    """``alpha-beta:US,GBPS``: α and β as the user states them (say, a NIC shared by
    8 GPUs: alpha-beta:30,6.25)."""
    try:
        alpha_us, gbps = (float(x) for x in value[len("alpha-beta:") :].split(","))
    except ValueError:
        raise UserError(
            f"--comm {value!r}: give alpha-beta:US,GBPS, α in microseconds and β in GB/s "
            "per GPU, e.g. alpha-beta:30,6.25."
        ) from None
    return AlphaBetaComm(
        name=value,
        alpha_s=alpha_us * 1e-6,
        bytes_per_s=gbps * 1e9,
        source="declared on the command line",
        label="declared",
    )


def planning_comm(predictor: CostPredictor, topology: Topology) -> CommModel:
    """What ``--comm auto`` declares for a planner that measures nothing (the operator's
    planner process, a planner given no predictor): the preset for the job's size, or
    the model's network where each rank could have its own GPU or core."""
    return resolve_comm(
        "auto",
        world=topology.gpus,
        device=topology.device,
        predictor=predictor,
        measuring=False,
    )


def resolve_comm(
    value: str,
    *,
    world: int,
    device: str | None,
    predictor: CostPredictor | None,
    measuring: bool,
) -> CommModel:
    """The comm model a ``--comm`` value names, for a ``world``-rank job (docs/comm.md).

    ``measuring``: for the evaluator (which can measure) rather than a planner. Values:
    ``auto``, a preset or host preset name, ``model``, ``measured``, ``fitted:DIR``,
    ``alpha-beta:US,GBPS``; anything else is a :class:`UserError` listing them.
    """
    v = value.strip()
    if v == "auto":
        why = honest_comm_measurement(world, device)
        if why is None:
            own = "each rank has its own GPU or core here"
            if measuring:
                return MeasuredComm(auto_reason=own)
            if predictor is not None and predictor.model.comm is not None:
                return LearnedComm(predictor, auto_reason=own)
            why = "no cost model with an all-to-all network is at hand"
        return replace(default_preset(world), auto_reason=f"not measured: {why}")
    if v.lower() in PRESETS:
        return PRESETS[v.lower()]
    if v.lower() in HOST_PRESETS:
        return HOST_PRESETS[v.lower()]
    if v in ("model", "learned"):
        return _learned(predictor, None)
    if v == "measured":
        if not measuring:
            raise UserError(
                "--comm measured: only the evaluator measures all-to-alls; a planner "
                "prices them with a model. Give model, a preset or fitted:DIR."
            )
        return MeasuredComm(warning=honest_comm_measurement(world, device))
    if v.startswith("fitted:") and v[len("fitted:") :]:
        directory = Path(v[len("fitted:") :])
        return fit_comm(load_comm_records(directory), str(directory))
    if v.startswith("alpha-beta:"):
        return _declared_alpha_beta(v)
    raise UserError(f"--comm {value!r} is not a comm model. Give one of: {comm_choices()}.")
