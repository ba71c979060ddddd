"""Neural cost models and the batched, cached inference the planner uses.

Two models predict log-seconds: ``ComputeNet`` (NeuroShard's architecture) prices a
rank's fused embedding kernel, ``CommNet`` the all-to-all for any world size. Feature
normalization (mean/std fitted on the training split) is stored with the weights.

- :mod:`.features`: the raw table, set and rank features, and :class:`Normalizer`;
- :mod:`.networks`: :class:`ComputeNet`, :class:`CommNet` and what their output means;
- :mod:`.artifact`: :class:`CostModel`, its file (save, load, validation) and the
  bundled CPU model;
- :mod:`.predictor`: :class:`CostPredictor`, batched and cached inference, and a
  plan's predicted per-rank cost;
- :mod:`.cache`: :class:`ModelCache`, calibrated models by machine, and
  :class:`ModelChoice`, the model a command prices with (docs/model-cache.md);
- :mod:`.batch_range`: whether a global batch is inside the range a model was trained on.

The planner imports this package, never :mod:`shardwise.profiler`; training lives in
:mod:`shardwise.profiler.pretrain`. The names below are re-exported for importers of
``shardwise.planner.costmodel``.
"""

from shardwise.planner.costmodel.artifact import (
    BUNDLED_MODEL,
    FORMAT_NAME,
    FORMAT_VERSION,
    CostModel,
    load_bundled,
)
from shardwise.planner.costmodel.batch_range import batch_note, trained_batches
from shardwise.planner.costmodel.cache import (
    ENV_CACHE,
    ENV_MODEL,
    ModelCache,
    ModelChoice,
    cache_root,
)
from shardwise.planner.costmodel.features import (
    RANK_FEATURES,
    SET_FEATURES,
    TABLE_FEATURES,
    Normalizer,
    TableKey,
    rank_features,
    rank_features_many,
    set_features,
    table_features,
    table_key,
)
from shardwise.planner.costmodel.networks import CommNet, ComputeNet, comm_seconds
from shardwise.planner.costmodel.predictor import CostPredictor, PlanPrediction

__all__ = [
    "BUNDLED_MODEL",
    "ENV_CACHE",
    "ENV_MODEL",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "RANK_FEATURES",
    "SET_FEATURES",
    "TABLE_FEATURES",
    "CommNet",
    "ComputeNet",
    "CostModel",
    "CostPredictor",
    "ModelCache",
    "ModelChoice",
    "Normalizer",
    "PlanPrediction",
    "TableKey",
    "batch_note",
    "cache_root",
    "comm_seconds",
    "load_bundled",
    "rank_features",
    "rank_features_many",
    "set_features",
    "table_features",
    "table_key",
    "trained_batches",
]
