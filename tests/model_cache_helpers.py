"""Calibrated cost models for the model-cache tests: tiny networks and the calibration
metadata `shardwise calibrate` writes (docs/model-cache.md), so the cache's choice can
be tested without measuring anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.planner.costmodel import CommNet, ComputeNet, CostModel
from shardwise.planner.tables import TableSpec, tables_signatures

FINGERPRINT = {
    "device": "cpu:test",
    "device_type": "cpu",
    "cores": 2,
    "torch": "2.13.0+cpu",
    "fbgemm": "1.8.0+cpu",
    "python": "3.11.7",
}
KEY = "0123456789abcdef"


def calibrated(
    tables: Sequence[TableSpec],
    key: str = KEY,
    created: str = "2026-11-24T03:00:00+00:00",
    batches: Sequence[int] = (512,),
    seed: int = 0,
    fingerprint: dict[str, Any] | None = None,
) -> CostModel:
    """A tiny model calibrated on machine ``key`` on ``tables`` (``seed`` marks it)."""
    torch.manual_seed(seed)
    return CostModel(
        ComputeNet(hidden=8),
        CommNet(hidden=8),
        {
            "fingerprint": fingerprint or FINGERPRINT,
            "batch_sizes": [256, 1024],
            "seed": seed,
            "calibration": {
                "fingerprint_key": key,
                "tables": tables_signatures(tables),
                "batch_sizes": list(batches),
                "base": "bundled",
                "speed_factors": {"fwd": 1.0, "bwd": 1.0, "comm": 1.0},
                "phases": ["speed"],
                "samples": {"compute": 10, "comm": 2},
                "seconds": 1.0,
                "metrics": {},
                "created_at": created,
            },
        },
    )
