"""The DLRMJob spec as typed models mirroring ``crds/dlrmjob.yaml``.

The API server already rejects what the CRD schema can express (types, minimums,
enums, ``workers.min <= max``). :func:`parse_spec` re-checks the spec (an operator may
meet objects from an older CRD) and adds what no schema can: the table specs' own
rules (histograms summing to 1), GPU limits that contradict ``gpusPerWorker``,
environment variables the operator owns, mounts of volumes that do not exist. Every
problem names its field as ``spec.…`` so the ``InvalidSpec`` condition says what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from shardwise.basics import parse_duration, parse_quantity
from shardwise.names import OPERATOR_ENV, PLAN_DIR
from shardwise.operator.cluster import node_affinity
from shardwise.planner.registry import planner_names
from shardwise.planner.tables import MAX_DIM, MAX_POOLING_FACTOR, MAX_ROWS, TableSpec

_CAMEL = {"pooling_factor": "poolingFactor", "access_hist": "accessHist"}
#: The CRD's bounds (crds/dlrmjob.yaml states the reasons).
MAX_BATCH_SIZE_PER_RANK = 2**24
#: Fewer compute samples can leave a by-table split without enough validation samples.
MIN_PROFILING_COMPUTE_SAMPLES = 200
#: A profiling attempt's deadline beyond its calibration budget: start-up, publication.
CALIBRATION_MARGIN_SECONDS = 300
#: Pre-training's own minimum (``shardwise.profiler.pretrain``, which imports torch).
MIN_COMM_SAMPLES = 20


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class TableEntry(_Model):
    """One inline table, camelCase as in the CRD."""

    name: str
    rows: int = Field(ge=1, le=MAX_ROWS)
    dim: int = Field(ge=4, le=MAX_DIM, multiple_of=4)
    pooling_factor: float = Field(ge=0, le=MAX_POOLING_FACTOR)
    dtype: Literal["fp32", "fp16"] = "fp32"
    access_hist: list[float] | None = Field(default=None, min_length=17, max_length=17)

    def to_spec(self) -> TableSpec:
        data: dict[str, Any] = {
            "name": self.name,
            "rows": self.rows,
            "dim": self.dim,
            "pooling_factor": self.pooling_factor,
            "dtype": self.dtype,
        }
        if self.access_hist is not None:
            data["access_hist"] = tuple(self.access_hist)
        return TableSpec.model_validate(data)


class ConfigMapRef(_Model):
    name: str = Field(min_length=1)
    key: str = "tables.yaml"


class Tables(_Model):
    inline: list[TableEntry] | None = Field(default=None, min_length=1)
    config_map_ref: ConfigMapRef | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Tables:
        if (self.inline is None) == (self.config_map_ref is None):
            raise ValueError("give exactly one of tables.inline and tables.configMapRef")
        return self


class Workers(_Model):
    min: int = Field(default=1, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Workers:
        if self.min > self.max:
            raise ValueError(f"workers.min ({self.min}) must not exceed workers.max ({self.max})")
        return self


class Resources(_Model):
    limits: dict[str, int | str] = Field(default_factory=dict)
    requests: dict[str, int | str] = Field(default_factory=dict)


class VolumeMount(_Model):
    name: str
    mount_path: str
    sub_path: str | None = None
    read_only: bool | None = None


class PodMetadata(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class PodOverridesSpec(_Model):
    """``template.podOverrides.spec``: pod fields a platform team sets, as in a PodSpec."""

    affinity: dict[str, Any] | None = None
    topology_spread_constraints: list[dict[str, Any]] | None = None
    priority_class_name: str | None = None
    image_pull_secrets: list[dict[str, Any]] | None = None
    runtime_class_name: str | None = None
    scheduler_name: str | None = None
    #: The pod's securityContext, laid over the operator's "restricted" defaults.
    security_context: dict[str, Any] | None = None
    host_network: bool | None = None
    host_ipc: bool | None = Field(default=None, alias="hostIPC")
    dns_policy: Literal["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"] | None = None
    dns_config: dict[str, Any] | None = None
    init_containers: list[dict[str, Any]] | None = None
    containers: list[dict[str, Any]] | None = None
    # The operator's (refused, naming where they belong): read only to say so.
    restart_policy: Any = None
    subdomain: Any = None
    hostname: Any = None
    volumes: Any = None
    node_selector: Any = None
    tolerations: Any = None
    service_account_name: Any = None
    termination_grace_period_seconds: Any = None


class PodOverrides(_Model):
    """``template.podOverrides``: laid over the worker pods (and, where it makes sense,
    the profiling pods) by :mod:`shardwise.operator.render.pods`."""

    metadata: PodMetadata = Field(default_factory=PodMetadata)
    spec: PodOverridesSpec = Field(default_factory=PodOverridesSpec)


#: ``podOverrides.spec`` fields the operator sets, and where the user's say goes instead.
OWNED_POD_FIELDS = {
    "restartPolicy": "the operator's (Never: the Job controller replaces a failed rank)",
    "subdomain": "the operator's (the workers' Service: the rendezvous host's name)",
    "hostname": "set per rank by the Job controller",
    "volumes": "given in spec.template.volumes",
    "nodeSelector": "given in spec.template.nodeSelector",
    "tolerations": "given in spec.template.tolerations",
    "serviceAccountName": "given in spec.template.serviceAccountName",
    "terminationGracePeriodSeconds": "given in spec.template.terminationGracePeriodSeconds",
}
#: Label and annotation prefixes and keys the operator and the Job controller set.
OWNED_LABEL_PREFIXES = ("shardwise.dev/", "batch.kubernetes.io/")
OWNED_LABELS = frozenset({"job-name", "controller-uid"})
#: Container names of the operator's own containers.
OWNED_CONTAINERS = ("worker", "profiler")
#: Volume names the operator gives its own volumes (plan, /tmp, /dev/shm).
OWNED_VOLUME_PREFIX = "shardwise-"


class Template(_Model):
    """The worker pods: what the user controls (the operator adds GPUs, plan, rendezvous)."""

    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    command: list[str] | None = None
    args: list[str] = Field(default_factory=list)
    env: list[dict[str, Any]] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    service_account_name: str | None = None
    checkpoint_dir: str | None = None
    termination_grace_period_seconds: int = Field(default=120, ge=30)
    backoff_limit: int = Field(default=0, ge=0)
    #: The worker container's securityContext, laid over the "restricted" defaults.
    security_context: dict[str, Any] | None = None
    #: ``/dev/shm``'s size (default: half the worker's memory when it has several ranks).
    shm_size: int | str | None = None
    pod_overrides: PodOverrides = Field(default_factory=PodOverrides)


class PlannerOptionsSpec(_Model):
    seed: int = Field(default=0, ge=0)


class PlannerSpec(_Model):
    algorithm: str = "neuroshard"
    gpu_memory: int | str | None = None
    memory_reserve: float = Field(default=0.15, ge=0, le=0.95)
    batch_size_per_rank: int = Field(default=65536, ge=1, le=MAX_BATCH_SIZE_PER_RANK)
    device: Literal["cuda", "cpu"] = "cuda"
    options: PlannerOptionsSpec = Field(default_factory=PlannerOptionsSpec)

    def gpu_memory_bytes(self) -> int | None:
        if self.gpu_memory is None:
            return None
        return parse_quantity(self.gpu_memory, "spec.planner.gpuMemory")


#: ``profiling.refinement.budgetSeconds``: its default and least (one measured round of a
#: few ranks with the planning before it; less refines nothing worth publishing).
REFINEMENT_BUDGET_SECONDS = 300
MIN_REFINEMENT_BUDGET_SECONDS = 30


class RefinementSpec(_Model):
    """``profiling.refinement``: after calibrating, the profiling pod plans the job with
    NeuroShard and refines the plans by measurement on its GPU (docs/refinement.md)."""

    enabled: bool = True
    #: All sizes together, planning included; the job's own size gets the larger share.
    budget_seconds: int = Field(
        default=REFINEMENT_BUDGET_SECONDS, ge=MIN_REFINEMENT_BUDGET_SECONDS, le=7200
    )
    #: Also one worker more and one fewer (within workers.min/max): what resharding needs.
    neighbours: bool = True


class ProfilingSpec(_Model):
    policy: Literal["IfStale", "Always", "Never"] = "IfStale"
    max_age: str = "168h"
    image: str | None = None
    #: ``shardwise calibrate --minutes``: the calibration's time budget.
    calibration_minutes: int = Field(default=10, ge=1, le=120)
    #: Deprecated: calibration is bounded by time (``calibrationMinutes``), not samples.
    compute_samples: int = Field(default=2000, ge=MIN_PROFILING_COMPUTE_SAMPLES, le=100_000)
    #: Deprecated, like ``compute_samples``.
    comm_samples: int = Field(default=120, ge=0, le=10_000)
    retries: int = Field(default=2, ge=0, le=10)
    backoff_seconds: int = Field(default=60, ge=1)
    timeout_seconds: int = Field(default=7200, ge=60)
    startup_timeout_seconds: int = Field(default=300, ge=30)
    service_account_name: str = "shardwise-profiler"
    refinement: RefinementSpec = Field(default_factory=RefinementSpec)

    @model_validator(mode="after")
    def _enough_comm_samples(self) -> ProfilingSpec:
        if 0 < self.comm_samples < MIN_COMM_SAMPLES:
            raise ValueError(
                f"profiling.commSamples must be 0 (keep the bundled all-to-all model) or at "
                f"least {MIN_COMM_SAMPLES} (what training an all-to-all model needs), not "
                f"{self.comm_samples}"
            )
        return self

    @property
    def calibration_budget_minutes(self) -> int:
        """``calibrationMinutes``, cut so that the calibration ends
        ``CALIBRATION_MARGIN_SECONDS`` before the attempt's deadline (at least 1)."""
        room = (self.timeout_seconds - CALIBRATION_MARGIN_SECONDS) // 60
        return max(1, min(self.calibration_minutes, room))

    @property
    def max_age_seconds(self) -> float:
        return parse_duration(self.max_age, "spec.profiling.maxAge")


class OnImbalanceSpec(_Model):
    """``resharding.onImbalance``: the closed loop (docs/resharding.md)."""

    enabled: bool = False
    threshold: float = Field(default=1.25, gt=1.0, le=10.0)
    min_gain: float = Field(default=0.1, gt=0.0, le=10.0)
    max_per_hour: int = Field(default=2, ge=1, le=60)
    sustain_seconds: int = Field(default=60, ge=0, le=86400)


class ReshardingSpec(_Model):
    enabled: bool = False
    debounce_seconds: int = Field(default=60, ge=0)
    on_imbalance: OnImbalanceSpec = Field(default_factory=OnImbalanceSpec)


class DLRMJobSpec(_Model):
    tables: Tables
    gpus_per_worker: int = Field(ge=1, le=64)
    workers: Workers
    template: Template
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    profiling: ProfilingSpec = Field(default_factory=ProfilingSpec)
    resharding: ReshardingSpec = Field(default_factory=ReshardingSpec)
    suspend: bool = False


class SpecError(ValueError):
    """The spec cannot run; ``problems`` name the fields (``spec.workers.min: …``)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _loc(parts: tuple[int | str, ...], root: str = "spec") -> str:
    out = root
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{_CAMEL.get(str(p), p)}"
    return out


def parse_spec(raw: Mapping[str, Any] | None, gpu_resource: str = "nvidia.com/gpu") -> DLRMJobSpec:
    """The typed spec, or a :class:`SpecError` listing every problem found."""
    try:
        spec = DLRMJobSpec.model_validate(dict(raw or {}))
    except ValidationError as err:
        raise SpecError(
            [
                f"{_loc(tuple(e['loc']))}: {str(e['msg']).removeprefix('Value error, ')}"
                for e in err.errors()[:20]
            ]
        ) from None
    problems = _semantic_problems(spec, gpu_resource)
    if problems:
        raise SpecError(problems)
    return spec


def inline_tables(spec: DLRMJobSpec) -> list[TableSpec]:
    """The inline tables as planner specs (``parse_spec`` has checked they convert)."""
    return [t.to_spec() for t in spec.tables.inline or []]


def _semantic_problems(spec: DLRMJobSpec, gpu_resource: str) -> list[str]:
    out: list[str] = []
    for i, entry in enumerate(spec.tables.inline or []):
        try:
            entry.to_spec()
        except ValidationError as err:
            for e in err.errors():
                field = _loc(tuple(e["loc"]), f"spec.tables.inline[{i}]")
                msg = str(e["msg"]).removeprefix("Value error, ")
                out.append(f"{field} (table {entry.name!r}): {msg}")
    if spec.planner.algorithm not in planner_names():
        out.append(
            f"spec.planner.algorithm: unknown planner {spec.planner.algorithm!r}; choose one "
            f"of {', '.join(planner_names())}"
        )
    for check in (spec.planner.gpu_memory_bytes, lambda: spec.profiling.max_age_seconds):
        try:
            check()
        except ValueError as err:
            out.append(str(err))
    if spec.planner.device == "cpu" and spec.planner.gpu_memory is None:
        out.append("spec.planner.gpuMemory: required when planner.device is cpu (memory per rank)")
    t = spec.template
    for section in ("limits", "requests"):
        given = getattr(t.resources, section).get(gpu_resource)
        if given is not None and str(given) != str(spec.gpus_per_worker):
            out.append(
                f"spec.template.resources.{section}[{gpu_resource}]: {given} contradicts "
                f"gpusPerWorker ({spec.gpus_per_worker}); leave it out, the operator sets it"
            )
    for i, env in enumerate(t.env):
        if env.get("name") in OPERATOR_ENV:
            out.append(f"spec.template.env[{i}].name: {env['name']} is set by the operator")
    out += _template_problems(spec)
    volumes = {str(v.get("name")) for v in t.volumes}
    for i, mount in enumerate(t.volume_mounts):
        if mount.name not in volumes:
            out.append(
                f"spec.template.volumeMounts[{i}].name: no volume {mount.name!r} in "
                "spec.template.volumes"
            )
        if mount.mount_path.rstrip("/") == PLAN_DIR:
            out.append(f"spec.template.volumeMounts[{i}].mountPath: {PLAN_DIR} holds the plan")
    return out


def _template_problems(spec: DLRMJobSpec) -> list[str]:
    """What the CRD's rules refuse of the pod template (its owned fields, ``/dev/shm``
    larger than the memory it counts against), for objects made before them."""
    t, out = spec.template, []
    where = "spec.template"
    for i, volume in enumerate(t.volumes):
        if str(volume.get("name", "")).startswith(OWNED_VOLUME_PREFIX):
            out.append(
                f"{where}.volumes[{i}].name: {volume['name']!r}: names starting with "
                f"{OWNED_VOLUME_PREFIX!r} are the operator's volumes (the plan, /tmp, /dev/shm)"
            )
    o = t.pod_overrides
    given = o.spec.model_dump(by_alias=True, exclude_none=True)
    for key, why in OWNED_POD_FIELDS.items():
        if key in given:
            out.append(f"{where}.podOverrides.spec.{key}: {why}")
    affinity_where = f"{where}.podOverrides.spec.affinity.nodeAffinity"
    out += node_affinity.problems(
        node_affinity.required(o.spec.affinity),
        f"{affinity_where}.requiredDuringSchedulingIgnoredDuringExecution",
    )
    for section in ("labels", "annotations"):
        for key in getattr(o.metadata, section):
            if key.startswith(OWNED_LABEL_PREFIXES) or key in OWNED_LABELS:
                out.append(
                    f"{where}.podOverrides.metadata.{section}[{key}]: set by the operator "
                    "or the Job controller"
                )
    for section in ("containers", "initContainers"):
        for i, c in enumerate(given.get(section) or []):
            if c.get("name") in OWNED_CONTAINERS:
                out.append(
                    f"{where}.podOverrides.spec.{section}[{i}].name: {c['name']!r} is the "
                    "operator's container (its command is the rank's; set its "
                    "securityContext in spec.template.securityContext)"
                )
    if t.shm_size is not None:
        try:
            shm = parse_quantity(t.shm_size, f"{where}.shmSize")
        except ValueError as err:
            out.append(str(err))
        else:
            limit = t.resources.limits.get("memory")
            if limit is not None and shm > parse_quantity(limit, f"{where}.resources.limits"):
                out.append(
                    f"{where}.shmSize: {t.shm_size} is more than the worker's memory limit "
                    f"({limit}): what /dev/shm holds counts against it"
                )
    return out
