"""Published cost models: one per GPU type and namespace, shared by every job there.

A profiling Job publishes its model with :mod:`shardwise.profiler.publish` as the
chunked ConfigMaps ``shardwise-costmodel-<gpu type>-<i>`` (component ``costmodel``,
label ``shardwise.dev/gpu-type``, annotation ``shardwise.dev/published-at``). They
are deliberately *not* owned by a DLRMJob: a model describes the hardware, and
outlives the job that measured it, so the next job on that GPU type need not profile.

A calibrated model (``shardwise calibrate``, docs/design.md §7) also carries
``shardwise.dev/calibration``: JSON with the table signatures it was calibrated on
(``tables``) and a summary of the calibration (machine, time, samples, speed
factors, held-out metrics). The operator reads it from the annotation, without
loading the model (the operator process never imports torch), to judge whether the
model covers a job's tables (:func:`shardwise.operator.decide.profiling.coverage`) and to
say how the model that planned a job was calibrated.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise import names
from shardwise.operator.cluster.summaries import child_ref, format_time, parse_time

#: JSON: the covered table signatures and the calibration summary (on every chunk).
ANN_CALIBRATION = f"{names.GROUP}/calibration"
#: Most held-out metrics kept in the summary (flattened ``a.b.c`` keys).
MAX_METRICS = 40


@dataclass(frozen=True)
class Calibration:
    """How a published model was calibrated (the ``shardwise.dev/calibration`` JSON)."""

    #: The table signatures it was calibrated on (``planner.tables.table_signature``).
    tables: frozenset[str]
    #: The rest, camelCase, as ``status.costModel.calibration`` shows it.
    summary: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def status(self, covered: int, of: int) -> dict[str, Any]:
        """``status.costModel.calibration`` for a job with ``of`` tables, ``covered`` of
        them calibrated on."""
        return {**self.summary, "tablesCovered": covered, "tablesTotal": of}


@dataclass(frozen=True)
class CostModelInfo:
    """Chunk 0 of a published model: enough to judge freshness and name it in status."""

    gpu_type: str
    payload: str
    published_at: datetime.datetime | None
    fingerprint: str
    sha256: str
    namespace: str
    #: How many ConfigMaps the payload takes (``<payload>-0`` … ``-<chunks-1>``).
    chunks: int = 1
    #: ``None``: a model published without calibration (it covers no job's tables).
    calibration: Calibration | None = None

    def age_seconds(self, now: datetime.datetime) -> float | None:
        return None if self.published_at is None else (now - self.published_at).total_seconds()

    def is_fresh(self, now: datetime.datetime, max_age_seconds: float) -> bool:
        age = self.age_seconds(now)
        return age is not None and age < max_age_seconds

    def describe(self) -> str:
        when = format_time(self.published_at) if self.published_at else "an unknown time"
        return f"{self.payload} (published {when})"

    def chunk_names(self) -> list[str]:
        return [f"{self.payload}-{i}" for i in range(self.chunks)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _flatten(metrics: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if not isinstance(metrics, Mapping):
        return out
    for key in sorted(metrics, key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        value = metrics[key]
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        elif (number := _number(value)) is not None:
            out[name] = round(number, 4)
    return out


def flat_metrics(metrics: Any) -> dict[str, float]:
    """Nested held-out metrics as ``{"a.b": number}`` (finite numbers only): what a
    status schema of numbers can hold. At most :data:`MAX_METRICS`: the calibrated
    model's own (``final.…``) first, then the counts, then the models it is compared
    with (``speed_only.…``, ``base.…``)."""
    rank = {"final": 0, "speed_only": 2, "base": 3}
    flat = _flatten(metrics)

    def order(key: str) -> int:
        head = key.split(".", 1)[0]
        return rank.get(head, 1 if "." not in key else 4)

    return {k: flat[k] for k in sorted(flat, key=order)[:MAX_METRICS]}


def calibration_annotation(
    calibration: Mapping[str, Any],
    *,
    machine: str = "",
    minutes: float | None = None,
) -> str:
    """The ``shardwise.dev/calibration`` JSON of a model whose metadata holds
    ``calibration`` (``CostModel.metadata["calibration"]``): plain data, compact."""
    summary: dict[str, Any] = {"tables": sorted({str(s) for s in calibration.get("tables", [])})}
    if machine:
        summary["machine"] = machine
    if calibration.get("fingerprint_key"):
        summary["fingerprint"] = str(calibration["fingerprint_key"])
    if minutes is not None:
        summary["budgetMinutes"] = minutes
    if (seconds := _number(calibration.get("seconds"))) is not None:
        summary["seconds"] = round(seconds, 1)
        summary["minutes"] = round(seconds / 60, 2)
    samples = calibration.get("samples")
    if isinstance(samples, Mapping):
        summary["samples"] = {
            k: int(v)
            for k, v in samples.items()
            if k in ("compute", "comm") and _number(v) is not None
        }
    factors = calibration.get("speed_factors")
    if isinstance(factors, Mapping):
        summary["speedFactors"] = {
            k: round(float(v), 4)
            for k, v in factors.items()
            if k in ("fwd", "bwd", "comm") and _number(v) is not None
        }
    if isinstance(calibration.get("phases"), list):
        summary["phases"] = [str(p) for p in calibration["phases"]]
    if calibration.get("base"):
        summary["base"] = str(calibration["base"])
    created = parse_time(calibration.get("created_at"))
    if created is not None:
        summary["createdAt"] = format_time(created)
    job = calibration.get("job")
    if isinstance(job, Mapping):
        for src, dst in (("gpus", "gpus"), ("batch_per_rank", "batchPerRank")):
            if (value := _number(job.get(src))) is not None:
                summary[dst] = int(value)
    if isinstance(calibration.get("batch_sizes"), list):
        summary["batchSizes"] = [
            int(b) for b in calibration["batch_sizes"] if _number(b) is not None
        ]
    metrics = flat_metrics(calibration.get("metrics"))
    if metrics:
        summary["metrics"] = metrics
    return json.dumps(summary, sort_keys=True, separators=(",", ":"))


def parse_calibration(text: str | None) -> Calibration | None:
    """The annotation read back; ``None`` when absent or unreadable (such a model
    covers no tables, so ``IfStale`` calibrates on the job's own)."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tables"), list):
        return None
    tables = frozenset(str(s) for s in data.pop("tables"))
    return Calibration(tables, data)


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
    try:
        chunks = max(1, int(ann.get(names.ANN_CHUNK_COUNT, "1")))
    except ValueError:
        chunks = 1
    return CostModelInfo(
        gpu_type=gpu,
        payload=ann.get(names.ANN_PAYLOAD, ""),
        published_at=parse_time(ann.get(names.ANN_PUBLISHED_AT)) or ref.created,
        fingerprint=ann.get(names.ANN_FINGERPRINT, ""),
        sha256=ann.get(names.ANN_SHA, ""),
        namespace=ref.namespace,
        chunks=chunks,
        calibration=parse_calibration(ann.get(ANN_CALIBRATION)),
    )


def newest(models: Sequence[CostModelInfo]) -> CostModelInfo | None:
    far = datetime.datetime.min.replace(tzinfo=datetime.UTC)
    return max(models, key=lambda m: m.published_at or far, default=None)
