"""``shardwise calibrate``: adapt the best cost model at hand to this machine and to
the job's tables (docs/calibration.md).

- :mod:`.tasks`: the job, its by-table split and the kernels' tasks;
- :mod:`.anchors`: every job table timed alone (and the heaviest's column halves and
  first row ranges, the smallest's data-parallel copies);
- :mod:`.plans`: the ranks of candidate plans for the training and the test tables;
- :mod:`.shards`: a plan rank's shards of every kind, as stored, timed and priced;
- :mod:`.speed`: this machine's speed factors (fwd, bwd, comm, collectives) against a model;
- :mod:`.measure`: the time-boxed, resumable measuring loops;
- :mod:`.finetune`: fine-tuning the compute network, early-stopped on training plans;
- :mod:`.rankfit`: the rank head's fusion factors, and metrics on plan ranks;
- :mod:`.spreads`: the rank head from the anchors, and the error of unmeasured shards;
- :mod:`.model`: the calibrated model's parts and the metadata it carries;
- :mod:`.heldout`: models judged on the held-out plan ranks, the ablation, the verdict;
- :mod:`.progress`: the clock and the progress callbacks;
- :mod:`.pipeline`: :func:`calibrate`, the phases within the budget, and the model's
  ``metadata["calibration"]``.
"""

from shardwise.profiler.calibrate.pipeline import Budget, CalibrationResult, calibrate
from shardwise.profiler.calibrate.progress import PhaseProgress
from shardwise.profiler.calibrate.tasks import Job

__all__ = ["Budget", "CalibrationResult", "Job", "PhaseProgress", "calibrate"]
