"""Plans a profiling pod refined by measurement, as the operator sees them.

After calibrating, the profiling pod plans the job with NeuroShard and refines the plan
by timing its kernels on the job's GPU type at the job's batch (``shardwise
refine-plans``, docs/refinement.md), for the size the job runs at and its neighbours,
and publishes each as a ConfigMap (:mod:`shardwise.operator.pod.publish_plans`). The
annotation :data:`ANN_REFINED` says what it was refined for and what was measured; the
operator reads it without loading the plan (and never imports torch).

A refined plan stands in for the model-only plan only when it was made for the very
inputs the operator would plan for: the :func:`refined_key` of the tables' signatures,
the world size, the batch per rank, the GPU memory and reserve, the device, the GPU type
and the planner's seed. Anything else is a ``ModelOnly`` plan, and :func:`choose` says
why, naming what differs, so ``status.plan.why`` tells a user what to change.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise import names
from shardwise.basics import format_bytes
from shardwise.operator.cluster.summaries import child_ref
from shardwise.operator.crd import (
    CALIBRATION_MARGIN_SECONDS,
    MIN_REFINEMENT_BUDGET_SECONDS,
    DLRMJobSpec,
)
from shardwise.operator.models.plan_inputs import PlanInputs

#: On a refined-plan ConfigMap: what it was refined for and what was measured (JSON).
ANN_REFINED = f"{names.GROUP}/refined"
#: The DLRMJob's uid, given to the profiling pod: its refined plans are owned by the job.
ENV_JOB_UID = "SHARDWISE_JOB_UID"
#: ``status.plan.kind``.
KIND_REFINED = "Refined"
KIND_MODEL_ONLY = "ModelOnly"
#: Refinement starts from this planner's plan (and its runners-up).
REFINING_PLANNER = "neuroshard"
#: The figures of the annotation that ``status.plan.refinement`` shows.
FIGURES = (
    "measuredOn",
    "batchSizePerRank",
    "startMaxMs",
    "finalMaxMs",
    "startMaxComputeMs",
    "finalMaxComputeMs",
    "torchrecMaxMs",
    "startedFrom",
    "moves",
    "kernels",
    "seconds",
    "modelFingerprint",
    "publishedAt",
)


def refined_key(
    *,
    tables_hash: str,
    world_size: int,
    batch_size_per_rank: int,
    gpu_memory_bytes: int,
    memory_reserve: float,
    device: str,
    gpu_type: str,
    seed: int,
) -> str:
    """What a refined plan was made for, as one hash: the pod computes it from the plan
    it publishes, the operator from the inputs it would plan for."""
    canonical = json.dumps(
        {
            "tables": tables_hash,
            "world": world_size,
            "batch": batch_size_per_rank,
            "memory": gpu_memory_bytes,
            "reserve": memory_reserve,
            "device": device,
            "gpuType": gpu_type,
            "seed": seed,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Wanted:
    """The inputs a refined plan must have been made for to be used."""

    tables_hash: str
    world_size: int
    batch_size_per_rank: int
    gpu_memory_bytes: int
    memory_reserve: float
    device: str
    gpu_type: str
    seed: int

    @classmethod
    def of(cls, inputs: PlanInputs, tables_hash: str) -> Wanted:
        return cls(
            tables_hash,
            inputs.world_size,
            inputs.batch_size_per_rank,
            inputs.gpu_memory_bytes,
            inputs.memory_reserve,
            inputs.device,
            inputs.gpu_type,
            inputs.seed,
        )

    def key(self) -> str:
        return refined_key(
            tables_hash=self.tables_hash,
            world_size=self.world_size,
            batch_size_per_rank=self.batch_size_per_rank,
            gpu_memory_bytes=self.gpu_memory_bytes,
            memory_reserve=self.memory_reserve,
            device=self.device,
            gpu_type=self.gpu_type,
            seed=self.seed,
        )


@dataclass(frozen=True)
class RefinedPlanInfo:
    """A refined-plan ConfigMap, from its labels and annotation."""

    name: str
    namespace: str
    owner_uids: tuple[str, ...]
    key: str
    made_for: Wanted
    plan_hash: str
    #: The annotation's measured figures (camelCase, :data:`FIGURES`) and ``measureDevice``.
    figures: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def status(self) -> dict[str, Any]:
        """``status.plan.refinement``."""
        out: dict[str, Any] = {"configMap": self.name}
        if self.figures.get("measureDevice"):
            out["device"] = self.figures["measureDevice"]
        out.update({k: self.figures[k] for k in FIGURES if self.figures.get(k) is not None})
        return out

    def describe(self) -> str:
        f = self.figures
        start, final = f.get("startMaxMs"), f.get("finalMaxMs")
        measured = (
            f", measured {start:.2f} -> {final:.2f} ms"
            if isinstance(start, int | float) and isinstance(final, int | float)
            else ""
        )
        on = f" on {f['measureDevice']}" if f.get("measureDevice") else ""
        batch = self.made_for.batch_size_per_rank
        return f"{self.name} (refined{on} at {batch} per rank{measured})"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def parse_refined(body: Mapping[str, Any]) -> RefinedPlanInfo | None:
    """The refined plan a ConfigMap holds, or ``None`` (another component, or an
    annotation that is missing or unreadable: such a plan is never used)."""
    ref = child_ref(body)
    if ref.labels.get(names.LABEL_COMPONENT) != names.COMPONENT_REFINED_PLAN:
        return None
    try:
        data = json.loads(ref.annotations.get(ANN_REFINED, ""))
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        made_for = Wanted(
            str(data["tablesHash"]),
            int(data["worldSize"]),
            int(data["batchSizePerRank"]),
            int(data["gpuMemoryBytes"]),
            float(data["memoryReserve"]),
            str(data["device"]),
            str(data["gpuType"]),
            int(data["seed"]),
        )
        key = str(data["key"])
    except (KeyError, TypeError, ValueError):
        return None
    figures = {
        k: v
        for k, v in data.items()
        if k in (*FIGURES, "measureDevice") and (isinstance(v, str) or _number(v) is not None)
    }
    return RefinedPlanInfo(
        ref.name, ref.namespace, ref.owner_uids, key, made_for, str(data.get("planHash", "")),
        figures,
    )  # fmt: skip


def annotation(made_for: Wanted, plan_hash: str, figures: Mapping[str, Any]) -> str:
    """The :data:`ANN_REFINED` JSON the profiling pod writes (compact)."""
    doc = {
        "key": made_for.key(),
        "tablesHash": made_for.tables_hash,
        "worldSize": made_for.world_size,
        "batchSizePerRank": made_for.batch_size_per_rank,
        "gpuMemoryBytes": made_for.gpu_memory_bytes,
        "memoryReserve": made_for.memory_reserve,
        "device": made_for.device,
        "gpuType": made_for.gpu_type,
        "seed": made_for.seed,
        "planHash": plan_hash,
        **{k: v for k, v in figures.items() if v is not None},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------- the choice


def not_refining(spec: DLRMJobSpec) -> str | None:
    """Why no profiling pod refines plans for this spec, or ``None`` when one does."""
    if spec.profiling.policy == "Never":
        return "spec.profiling.policy is Never: no profiling pod refines plans"
    if not spec.profiling.refinement.enabled:
        return "spec.profiling.refinement.enabled is false"
    if spec.planner.algorithm != REFINING_PLANNER:
        return (
            f"spec.planner.algorithm is {spec.planner.algorithm}: the profiling pod refines "
            f"{REFINING_PLANNER}'s plans"
        )
    return None


def _gpus(sizes: Sequence[int]) -> str:
    ordered = [str(s) for s in sorted(set(sizes))]
    listed = ordered[0] if len(ordered) == 1 else f"{', '.join(ordered[:-1])} and {ordered[-1]}"
    return f"{listed} GPU{'s' if ordered != ['1'] else ''}"


def _differences(made: Wanted, want: Wanted) -> list[str]:
    out = []
    if made.tables_hash != want.tables_hash:
        out.append("other tables")
    if made.batch_size_per_rank != want.batch_size_per_rank:
        out.append(
            f"batch {made.batch_size_per_rank} per rank (the job's: {want.batch_size_per_rank})"
        )
    if made.gpu_memory_bytes != want.gpu_memory_bytes:
        out.append(
            f"GPU memory {format_bytes(made.gpu_memory_bytes)} (the job's: "
            f"{format_bytes(want.gpu_memory_bytes)})"
        )
    if made.memory_reserve != want.memory_reserve:
        out.append(f"memory reserve {made.memory_reserve:g} (the job's: {want.memory_reserve:g})")
    if made.device != want.device:
        out.append(f"device {made.device} (the job's: {want.device})")
    if made.gpu_type != want.gpu_type:
        out.append(f"GPU type {made.gpu_type} (the job's: {want.gpu_type})")
    if made.seed != want.seed:
        out.append(f"planner seed {made.seed} (the job's: {want.seed})")
    return out


def choose(
    published: Sequence[RefinedPlanInfo], want: Wanted
) -> tuple[RefinedPlanInfo | None, str]:
    """The refined plan made for ``want``, or ``None`` and why there is none (the newest
    of several equal ones: a later attempt measured again)."""
    key = want.key()
    matching = [p for p in published if p.key == key and p.made_for == want]
    if matching:
        return max(matching, key=lambda p: str(p.figures.get("publishedAt", ""))), ""
    if not published:
        return None, "no refined plan was published for this job"
    same_size = [p for p in published if p.made_for.world_size == want.world_size]
    if not same_size:
        return None, (
            f"no refined plan for {_gpus([want.world_size])}; the profiling pod refined for "
            f"{_gpus([p.made_for.world_size for p in published])}"
        )
    newest = max(same_size, key=lambda p: str(p.figures.get("publishedAt", "")))
    diffs = _differences(newest.made_for, want) or ["other inputs"]
    return None, (
        f"the refined plan for {_gpus([want.world_size])} ({newest.name}) was made for "
        f"{', '.join(diffs)}"
    )


# --------------------------------------------------------------------------- the pod's part


def world_sizes(spec: DLRMJobSpec, world_size: int) -> list[int]:
    """The sizes the profiling pod refines for: the job's own first, then one worker
    fewer and one more, within ``workers.min``/``max`` (with ``neighbours``)."""
    g = spec.gpus_per_worker
    workers = max(1, world_size // g)
    out = [world_size]
    if spec.profiling.refinement.neighbours:
        out += [
            w * g
            for w in (workers - 1, workers + 1)
            if spec.workers.min <= w <= spec.workers.max and w * g != world_size
        ]
    return out


def budget_seconds(spec: DLRMJobSpec) -> int:
    """``refinement.budgetSeconds``, cut to what the attempt's deadline leaves after
    the calibration and the start-up and publication margin (0: no time at all)."""
    p = spec.profiling
    room = p.timeout_seconds - CALIBRATION_MARGIN_SECONDS - 60 * p.calibration_budget_minutes
    budget = min(p.refinement.budget_seconds, room)
    return budget if budget >= MIN_REFINEMENT_BUDGET_SECONDS else 0


# --------------------------------------------------------------------------- status


def plan_kind_fields(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``status.plan``'s kind, and ``why`` (ModelOnly) or ``refinement`` (Refined), from
    the plan ConfigMap's summary."""
    kind = summary.get("kind")
    if not isinstance(kind, str) or not kind:
        return {}
    out: dict[str, Any] = {"kind": kind}
    if kind == KIND_MODEL_ONLY and summary.get("why"):
        out["why"] = str(summary["why"])
    refinement = summary.get("refinement")
    if kind == KIND_REFINED and isinstance(refinement, Mapping):
        out["refinement"] = dict(refinement)
    return out
