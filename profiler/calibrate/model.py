"""The calibrated model's parts: the base with this machine's factors, with or without a
rank head, and the metadata a calibration leaves in the model file."""

from __future__ import annotations

import copy
import json
from typing import Any

import shardwise
from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.rankhead import RankHead
from shardwise.profiler.calibrate.finetune import FineTune
from shardwise.profiler.calibrate.speed import SpeedFit
from shardwise.profiler.calibrate.tasks import Job
from shardwise.profiler.fingerprint import Fingerprint


def with_head(model: CostModel, head: RankHead | None) -> CostModel:
    """``model`` (a copy) pricing ranks with ``head`` (None: the network alone)."""
    metadata = copy.deepcopy(model.metadata)
    calibration = dict(metadata.get("calibration") or {})
    if head is None:
        calibration.pop("rank_head", None)
    else:
        calibration["rank_head"] = head.to_json()
    metadata["calibration"] = calibration
    return CostModel(model.compute, model.comm, metadata, model.source)


def with_factors(base: CostModel, speed: SpeedFit) -> CostModel:
    """``base`` with ``speed``'s factors and without a rank head of its own (a copy)."""
    metadata = copy.deepcopy(base.metadata)
    calibration = dict(metadata.get("calibration") or {})
    calibration["speed_factors"] = speed.factors.to_dict()
    calibration.pop("rank_head", None)
    metadata["calibration"] = calibration
    return CostModel(base.compute, base.comm, metadata, base.source)


def calibrated_metadata(
    base: CostModel,
    fingerprint: Fingerprint,
    calibration: dict[str, Any],
    tuned: FineTune,
    job: Job,
) -> dict[str, Any]:
    """The base's metadata, for this machine, with ``calibration`` (plain JSON only,
    so the file loads weights-only)."""
    metadata = copy.deepcopy(base.metadata)
    metadata["fingerprint"] = fingerprint.to_dict()
    metadata["fingerprint_key"] = fingerprint.key()
    metadata["code_version"] = shardwise.__version__
    if tuned.kept:  # the network now learnt the job's batch too
        trained = {int(b) for b in metadata.get("batch_sizes", [])} | {job.global_batch}
        metadata["batch_sizes"] = sorted(trained)
    metadata["calibration"] = calibration
    out: dict[str, Any] = json.loads(json.dumps(metadata, default=float, allow_nan=False))
    return out
