"""``shardwise calibrate``: adapt the best cost model at hand to this machine and to
the job's tables (docs/calibration.md).

- :mod:`.tasks`: the job, its by-table split and every sample's task;
- :mod:`.speed`: this machine's speed factors (fwd, bwd, comm) against a model;
- :mod:`.measure`: the time-boxed, resumable measuring loops;
- :mod:`.finetune`: fine-tuning the compute network, early-stopped on validation tables;
- :mod:`.heldout`: metrics on the held-out tables (per kernel, per plan-like group);
- :mod:`.pipeline`: :func:`calibrate`, the phases within the budget, and the model's
  ``metadata["calibration"]``.
"""

from shardwise.profiler.calibrate.pipeline import (
    Budget,
    CalibrationResult,
    PhaseProgress,
    calibrate,
)
from shardwise.profiler.calibrate.tasks import Job

__all__ = ["Budget", "CalibrationResult", "Job", "PhaseProgress", "calibrate"]
