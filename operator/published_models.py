"""Published cost models: one per GPU type and namespace, shared by every job there.

A profiling Job publishes its model with :mod:`shardwise.profiler.publish` as the
chunked ConfigMaps ``shardwise-costmodel-<gpu type>-<i>`` (component ``costmodel``,
label ``shardwise.dev/gpu-type``, annotation ``shardwise.dev/published-at``). They
are deliberately *not* owned by a DLRMJob: a model describes the hardware, and
outlives the job that measured it, so the next job on that GPU type need not profile.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise import names
from shardwise.operator.observe import child_ref, format_time, parse_time


@dataclass(frozen=True)
class CostModelInfo:
    """Chunk 0 of a published model: enough to judge freshness and name it in status."""

    gpu_type: str
    payload: str
    published_at: datetime.datetime | None
    fingerprint: str
    sha256: str
    namespace: str

    def age_seconds(self, now: datetime.datetime) -> float | None:
        return None if self.published_at is None else (now - self.published_at).total_seconds()

    def is_fresh(self, now: datetime.datetime, max_age_seconds: float) -> bool:
        age = self.age_seconds(now)
        return age is not None and age < max_age_seconds

    def describe(self) -> str:
        when = format_time(self.published_at) if self.published_at else "an unknown time"
        return f"{self.payload} (published {when})"


def model_info(body: Mapping[str, Any]) -> CostModelInfo | None:
    """The model a ConfigMap heads, or ``None`` for other chunks and foreign objects."""
    ref = child_ref(body)
    ann = ref.annotations
    if (
        ref.labels.get(names.LABEL_COMPONENT) != names.COMPONENT_COSTMODEL
        or ann.get(names.ANN_CHUNK_INDEX) != "0"
    ):
        return None
    gpu = ref.labels.get(names.LABEL_GPU_TYPE)
    if not gpu:
        return None
    return CostModelInfo(
        gpu_type=gpu,
        payload=ann.get(names.ANN_PAYLOAD, ""),
        published_at=parse_time(ann.get(names.ANN_PUBLISHED_AT)) or ref.created,
        fingerprint=ann.get(names.ANN_FINGERPRINT, ""),
        sha256=ann.get(names.ANN_SHA, ""),
        namespace=ref.namespace,
    )


def newest(models: Sequence[CostModelInfo]) -> CostModelInfo | None:
    far = datetime.datetime.min.replace(tzinfo=datetime.UTC)
    return max(models, key=lambda m: m.published_at or far, default=None)
