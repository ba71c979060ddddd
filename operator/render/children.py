"""The children of a DLRMJob as plain dicts: pure functions of the spec and the plan.

Every child carries the common labels (``shardwise.dev/job``,
``shardwise.dev/component``) and a controller ``ownerReference`` to the DLRMJob, so
``kubectl get all -l shardwise.dev/job=NAME`` finds them and deleting the job deletes
them (the garbage collector does it). Names come from :mod:`shardwise.names`.

The workers are one *Indexed* ``batch/v1`` Job (pods ``<job>-workers-<i>``) behind a
headless Service of the same name: the Job controller owns pod creation, retries,
completion, failure and ``suspend`` (which maps to the DLRMJob's), and the index
gives each pod a stable DNS name, so worker 0 (``<job>-workers-0.<job>-workers``)
hosts torchrun's c10d rendezvous.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Any

from shardwise import names
from shardwise.names import (
    child_name,
    plan_configmap_name,
    profiling_job_name,
    workers_name,
)
from shardwise.operator.config import OperatorConfig
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.models import refined_plans
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.render import container as c
from shardwise.operator.render import elastic, pods
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec, dump_tables

#: The model cache's root (``shardwise.planner.costmodel.cache``; read there, set here).
ENV_MODEL_CACHE = "SHARDWISE_MODEL_CACHE"


@dataclass(frozen=True)
class JobMeta:
    """The identity of the DLRMJob the children belong to."""

    name: str
    namespace: str
    uid: str
    generation: int = 1
    #: The Kueue LocalQueue the DLRMJob is labelled with (``""``: not queued).
    queue: str = ""
    #: Its Kueue WorkloadPriorityClass label, copied onto its Jobs (``""``: none).
    priority_class: str = ""


def queued(body: dict[str, Any], queue: str, priority_class: str = "") -> dict[str, Any]:
    """``body`` (a Job) put in the Kueue LocalQueue ``queue``: labelled, and created
    suspended, since Kueue unsuspends a queued Job when it admits it (its webhook would
    suspend it anyway). ``queue`` empty: ``body`` as it was."""
    if queue:
        body["metadata"]["labels"][names.LABEL_KUEUE_QUEUE] = queue
        if priority_class:
            body["metadata"]["labels"][names.LABEL_KUEUE_PRIORITY] = priority_class
        body["spec"]["suspend"] = True
    return body


def owner_reference(job: JobMeta) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(job: JobMeta, component: str, **extra: str) -> dict[str, str]:
    return {names.LABEL_JOB: job.name, names.LABEL_COMPONENT: component, **extra}


def _metadata(
    job: JobMeta, name: str, lbls: dict[str, str], ann: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": lbls,
        "ownerReferences": [owner_reference(job)],
    }
    if ann:
        meta["annotations"] = ann
    return meta


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- plan


def plan_configmap(
    job: JobMeta, plan: Plan, tables: list[TableSpec], inputs_hash: str, summary: dict[str, Any]
) -> dict[str, Any]:
    """The immutable plan ConfigMap ``<job>-plan-<hash8>``: ``plan.json`` (what
    ``SHARDWISE_PLAN`` names) and ``tables.yaml`` (the specs it was made from)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            job,
            plan_configmap_name(job.name, plan.hash),
            labels(job, names.COMPONENT_PLAN, **{names.LABEL_PLAN_HASH: plan.hash[:8]}),
            {
                names.ANN_INPUTS_HASH: inputs_hash,
                names.ANN_PLAN: json.dumps(summary, sort_keys=True),
            },
        ),
        "immutable": True,
        "data": {
            names.PLAN_KEY: plan.model_dump_json() + "\n",
            names.TABLES_KEY: dump_tables(tables, "yaml"),
        },
    }


# --------------------------------------------------------------------------- workers


def worker_service(job: JobMeta) -> dict[str, Any]:
    """Headless Service: stable DNS for the worker pods (and the rendezvous host)."""
    name = workers_name(job.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, name, labels(job, names.COMPONENT_WORKER)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_JOB: job.name, names.LABEL_COMPONENT: names.COMPONENT_WORKER},
            "ports": [{"name": "rdzv", "port": c.RDZV_PORT, "targetPort": c.RDZV_PORT}],
        },
    }


def rendezvous_endpoint(job: JobMeta) -> str:
    name = workers_name(job.name)
    return f"{name}-0.{name}:{c.RDZV_PORT}"


def worker_command(job: JobMeta, spec: DLRMJobSpec, workers: int) -> tuple[list[str], list[str]]:
    """The user's command and args as given, else torchrun (through the launcher that
    turns a clean SIGTERM stop into exit 0) running the default training entry."""
    t = spec.template
    if t.command:
        return list(t.command), list(t.args)
    size = (
        elastic.torchrun_args(spec) if elastic.applies(spec, job.queue) else [f"--nnodes={workers}"]
    )
    args = [
        *size,
        f"--nproc_per_node={spec.gpus_per_worker}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rendezvous_endpoint(job)}",
        f"--rdzv_id={job.uid}",
        "-m",
        c.DEFAULT_ENTRY,
        "--tables",
        names.TABLES_PATH,
    ]
    if t.checkpoint_dir:
        args += ["--checkpoint-dir", t.checkpoint_dir]
    return list(c.LAUNCHER), args + list(t.args)


def _gpu_resources(spec: DLRMJobSpec, config: OperatorConfig, gpus: int) -> dict[str, Any]:
    limits = dict(spec.template.resources.limits)
    requests = dict(spec.template.resources.requests)
    if spec.planner.device == "cuda":
        limits[config.gpu_resource] = gpus
        requests[config.gpu_resource] = gpus
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _node_selector(spec: DLRMJobSpec, gpu_type: str, config: OperatorConfig) -> dict[str, str]:
    selector = dict(spec.template.node_selector)
    if spec.planner.device == "cuda":
        selector[config.gpu_type_label] = gpu_type
    return selector


def worker_job(
    job: JobMeta,
    spec: DLRMJobSpec,
    plan_configmap: str,
    plan_hash: str,
    workers: int,
    gpu_type: str,
    config: OperatorConfig,
) -> dict[str, Any]:
    """The Indexed Job running ``workers`` torchrun nodes with the plan mounted."""
    t = spec.template
    name = workers_name(job.name)
    command, args = worker_command(job, spec, workers)
    env = [
        {"name": names.ENV_PLAN, "value": f"{names.PLAN_DIR}/{names.PLAN_KEY}"},
        {"name": names.ENV_PLAN_HASH, "value": plan_hash},
        {"name": names.ENV_JOB, "value": job.name},
        {"name": names.ENV_NAMESPACE, "value": job.namespace},
        {"name": names.ENV_NNODES, "value": str(workers)},
        {"name": names.ENV_NPROC, "value": str(spec.gpus_per_worker)},
        {"name": names.ENV_RDZV_ENDPOINT, "value": rendezvous_endpoint(job)},
        {"name": names.ENV_RDZV_ID, "value": job.uid},
        {"name": names.ENV_LIVE_CONFIGMAP, "value": names.live_configmap_name(job.name)},
        *t.env,
    ]
    container: dict[str, Any] = {
        "name": c.WORKER_CONTAINER,
        "image": t.image,
        "command": command,
        "args": args,
        "env": env,
        "ports": [
            {"name": "rdzv", "containerPort": c.RDZV_PORT},
            {"name": "metrics", "containerPort": c.METRICS_PORT},
        ],
        "volumeMounts": [
            {"name": c.PLAN_VOLUME, "mountPath": names.PLAN_DIR, "readOnly": True},
            *(m.model_dump(by_alias=True, exclude_none=True) for m in t.volume_mounts),
        ],
    }
    if t.image_pull_policy:
        container["imagePullPolicy"] = t.image_pull_policy
    resources = _gpu_resources(spec, config, spec.gpus_per_worker)
    if resources:
        container["resources"] = resources
    pod_labels = labels(job, names.COMPONENT_WORKER, **{names.LABEL_PLAN_HASH: plan_hash[:8]})
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": name,
        "terminationGracePeriodSeconds": t.termination_grace_period_seconds,
        "containers": [container],
        "volumes": [{"name": c.PLAN_VOLUME, "configMap": {"name": plan_configmap}}, *t.volumes],
    }
    selector = _node_selector(spec, gpu_type, config)
    if selector:
        pod["nodeSelector"] = selector
    if t.tolerations:
        pod["tolerations"] = list(t.tolerations)
    # The template's account, else the operator's (rank 0 writes the live summary
    # through it), else the namespace's default.
    account = t.service_account_name or config.worker_service_account_for(job.namespace)
    if account:
        pod["serviceAccountName"] = account
    body: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(
            job,
            name,
            labels(job, names.COMPONENT_WORKER, **{names.LABEL_GPU_TYPE: gpu_type}),
            {names.ANN_WORKERS: str(workers), names.ANN_PLAN: plan_configmap},
        ),
        "spec": {
            "completionMode": "Indexed",
            "completions": workers,
            "parallelism": workers,
            "backoffLimit": t.backoff_limit,
            "podFailurePolicy": {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
            "suspend": spec.suspend,
            "template": pods.shape({"metadata": {"labels": pod_labels}, "spec": pod}, spec),
        },
    }
    if elastic.applies(spec, job.queue):
        elastic.adapt(body, job.name, spec)
    queued(body, job.queue, job.priority_class)
    body["metadata"]["annotations"][names.ANN_TEMPLATE_HASH] = template_hash(body)
    body["metadata"]["annotations"][names.ANN_GENERATION] = str(job.generation)
    return body


def live_configmap(job: JobMeta) -> dict[str, Any]:
    """The job's live ConfigMap, empty: rank 0 of the running workers patches its live
    summary (``names.LIVE_KEY``) into it. The operator creates it with the worker Job,
    owned by the DLRMJob so that it goes with the job; a worker creates one only when it
    finds none."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            job, names.live_configmap_name(job.name), labels(job, names.COMPONENT_LIVE)
        ),
        "data": {},
    }


def plans_configmap(job: JobMeta, data: dict[str, str]) -> dict[str, Any]:
    """An elastic job's plans ConfigMap (:mod:`.elastic`), as first created with
    ``data``; later plans are patched in."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            job, names.plans_configmap_name(job.name), labels(job, names.COMPONENT_PLANS)
        ),
        "data": data,
    }


def template_hash(job_body: dict[str, Any]) -> str:
    """What makes two worker Jobs the same run: the spec without ``suspend`` (which is
    patched in place) and the labels. A different hash means a new Job. An elastic
    Job's size is not part of it: it changes in place (:mod:`.elastic`)."""
    resized = ("parallelism", "completions") if elastic.is_elastic(job_body) else ()
    spec = {k: v for k, v in job_body["spec"].items() if k != "suspend" and k not in resized}
    return _hash({"spec": spec, "labels": job_body["metadata"]["labels"]})


# --------------------------------------------------------------------------- profiling

#: Where a profiling pod finds the job's tables (the operator's tables ConfigMap) ...
PROFILE_TABLES_DIR = "/etc/shardwise-tables"
#: ... the published model to start from (chunk ``i`` in ``<dir>/<i>/``) ...
PROFILE_BASE_DIR = "/etc/shardwise-base"
#: ... and its scratch space (an emptyDir: datasets, the model, the model cache).
PROFILE_WORK_DIR = "/tmp/shardwise-profile"
#: The calibration's seed: the same tables and budget measure the same samples.
PROFILE_SEED = 1
#: How a calibration names its base when no published model was there to start from.
BUNDLED_BASE = "the bundled CPU model"


@dataclass(frozen=True)
class Calibration:
    """What a profiling attempt calibrates on, besides the spec: the job's tables (the
    operator's copy, :func:`tables_configmap`, and their signatures' hash), the job's
    world size (the batch is ``batchSizePerRank`` times it), the published model to
    start from (``None``: the bundled one), and the GPU memory the job is planned for
    (``spec.planner.gpuMemory`` or the nodes' label), which measured refinement plans
    with (``None``: the spec's)."""

    tables_configmap: str
    tables_hash: str
    world_size: int
    base: CostModelInfo | None = None
    gpu_memory_bytes: int | None = None


def tables_configmap(job: JobMeta, tables: list[TableSpec]) -> dict[str, Any]:
    """The job's tables for its profiling pods, ``<job>-tables-<hash8>`` (immutable,
    named by content): inline ones, or a copy of the referenced ConfigMap's as the
    operator read them, so the pod calibrates on the tables coverage was judged on."""
    text = dump_tables(tables, "yaml")
    digest = hashlib.sha256(text.encode()).hexdigest()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            job,
            child_name(job.name, "tables", digest[:8]),
            labels(job, names.COMPONENT_PROFILER),
        ),
        "immutable": True,
        "data": {names.TABLES_KEY: text},
    }


def published_base(model: CostModelInfo) -> str:
    """How a calibration names the published model it started from."""
    return f"the published model {model.describe()}"


def profiling_script(
    job: JobMeta, spec: DLRMJobSpec, gpu_type: str, calibration: Calibration
) -> str:
    """Calibrate this GPU type's cost model on the job's tables and batch, starting from
    its published model when there is one, and publish it through the API. It measures
    on the job's device (``--measure-on``): a pod that sees no GPU fails (exit 2) rather
    than publish a CPU's timings as the GPU type's."""
    work, minutes = PROFILE_WORK_DIR, spec.profiling.calibration_budget_minutes
    # The base model, named for the calibration's record (status.costModel.calibration
    # .base): the published model the pod's copy was rebuilt from, else the bundled
    # one (the pod's model cache starts empty, so calibrate starts from it).
    lines = ["set -eu", f"set -- --base-name {shlex.quote(BUNDLED_BASE)}"]
    if calibration.base is not None:
        b = calibration.base
        lines.append(
            f"if python -m shardwise.operator.pod.base_model {PROFILE_BASE_DIR} "
            f"--chunks {b.chunks} --sha256 {shlex.quote(b.sha256)} --out {work}/base.pt; "
            f"then set -- --base-model {work}/base.pt "
            f"--base-name {shlex.quote(published_base(b))}; fi"
        )
    # The job's GPU memory, when the spec gives it: candidate plans then fill ranks as
    # the job's will (calibration times the ranks of such plans).
    memory = spec.planner.gpu_memory_bytes()
    lines += [
        f"shardwise calibrate --tables {PROFILE_TABLES_DIR}/{names.TABLES_KEY} "
        f"--gpus {calibration.world_size} --batch-per-rank {spec.planner.batch_size_per_rank} "
        f'--minutes {minutes} --measure-on {spec.planner.device} "$@" '
        f"--seed {PROFILE_SEED} "
        + (f"--gpu-memory {memory} " if memory is not None else "")
        + f"--work-dir {work}/calibration --out {work}/model.pt",
        # Before the model: once the model is published the operator may plan, and it
        # then finds the refined plans already there.
        *refine_lines(job, spec, gpu_type, calibration),
        f"python -m shardwise.operator.pod.publish_model {work}/model.pt "
        f"--gpu-type {shlex.quote(gpu_type)} --namespace {shlex.quote(job.namespace)} "
        f"--job {shlex.quote(job.name)} --minutes {minutes}",
    ]
    return "\n".join(lines) + "\n"


def refine_lines(
    job: JobMeta, spec: DLRMJobSpec, gpu_type: str, calibration: Calibration
) -> list[str]:
    """The profiling pod's measured refinement (docs/refinement.md): plan the job with
    the calibrated model and refine the plan by timing its kernels on the pod's device,
    for the job's size and its neighbours, then publish the plans
    (:mod:`shardwise.operator.pod.publish_plans`). A failure here only costs the refined
    plans (the operator then plans with the model alone): the model is still published."""
    work = PROFILE_WORK_DIR
    memory = calibration.gpu_memory_bytes or spec.planner.gpu_memory_bytes()
    budget = refined_plans.budget_seconds(spec)
    why = refined_plans.not_refining(spec)
    if why is None and memory is None:
        why = "the GPU memory is unknown"
    if why is None and budget == 0:
        why = "spec.profiling.timeoutSeconds leaves no time after the calibration"
    if why is not None:
        return [f"# no measured refinement: {why}"]
    p = spec.planner
    sizes = refined_plans.world_sizes(spec, calibration.world_size)
    out = f"{work}/refined"
    return [
        f"shardwise refine-plans --tables {PROFILE_TABLES_DIR}/{names.TABLES_KEY} "
        f"--model {work}/model.pt "
        + "".join(f"--gpus {w} " for w in sizes)
        + (f"--gpus-per-host {spec.gpus_per_worker} " if spec.gpus_per_worker > 1 else "")
        + f"--batch-per-rank {p.batch_size_per_rank} --gpu-memory {memory} "
        f"--reserve {p.memory_reserve!r} --target-device {p.device} --measure-on {p.device} "
        f"--seed {p.options.seed} --budget {budget} --out-dir {out} || "
        'echo "warning: measured refinement failed (above); the operator plans with the '
        'model alone" >&2',
        f"python -m shardwise.operator.pod.publish_plans {out} --gpu-type {shlex.quote(gpu_type)} "
        f"--namespace {shlex.quote(job.namespace)} --job {shlex.quote(job.name)} "
        f"--tables-hash {shlex.quote(calibration.tables_hash)} || "
        'echo "warning: the refined plans were not all published (above)" >&2',
    ]


def _profiling_volumes(calibration: Calibration) -> tuple[list[Any], list[Any]]:
    """The pod's volumes and the container's mounts: tables, scratch, base model."""
    volumes: list[Any] = [
        {"name": "tables", "configMap": {"name": calibration.tables_configmap}},
        {"name": "work", "emptyDir": {}},
    ]
    mounts: list[Any] = [
        {"name": "tables", "mountPath": PROFILE_TABLES_DIR, "readOnly": True},
        {"name": "work", "mountPath": PROFILE_WORK_DIR},
    ]
    if calibration.base is not None:
        for i, chunk in enumerate(calibration.base.chunk_names()):
            volumes.append({"name": f"base-{i}", "configMap": {"name": chunk, "optional": True}})
            mounts.append(
                {"name": f"base-{i}", "mountPath": f"{PROFILE_BASE_DIR}/{i}", "readOnly": True}
            )
    return volumes, mounts


def profiling_job(
    job: JobMeta,
    spec: DLRMJobSpec,
    gpu_type: str,
    attempt: int,
    config: OperatorConfig,
    calibration: Calibration,
) -> dict[str, Any]:
    """Attempt ``attempt`` at profiling ``gpu_type``: one pod pinned to that GPU type."""
    t, p = spec.template, spec.profiling
    gpus = spec.gpus_per_worker
    volumes, mounts = _profiling_volumes(calibration)
    container: dict[str, Any] = {
        "name": "profiler",
        "image": p.image or t.image,
        "command": ["sh", "-c", profiling_script(job, spec, gpu_type, calibration)],
        "env": [
            {"name": names.ENV_JOB, "value": job.name},
            {"name": names.ENV_NAMESPACE, "value": job.namespace},
            # the refined plans' owner (publish_plans)
            {"name": refined_plans.ENV_JOB_UID, "value": job.uid},
            # the pod's own model cache (calibrate's default output and its base)
            {"name": ENV_MODEL_CACHE, "value": f"{PROFILE_WORK_DIR}/cache"},
        ],
        "volumeMounts": mounts,
        # A failing step's error (the CLI's one-paragraph message) becomes the pod's
        # termination message, which the DLRMJob's conditions quote.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _gpu_resources(spec, config, gpus)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": p.service_account_name,
        "containers": [container],
        "volumes": volumes,
    }
    selector = _node_selector(spec, gpu_type, config)
    if selector:
        pod["nodeSelector"] = selector
    if t.tolerations:
        pod["tolerations"] = list(t.tolerations)
    lbls = labels(
        job,
        names.COMPONENT_PROFILER,
        **{names.LABEL_GPU_TYPE: gpu_type, names.LABEL_ATTEMPT: str(attempt)},
    )
    template = pods.shape({"metadata": {"labels": dict(lbls)}, "spec": pod}, spec, profiling=True)
    ann = {names.ANN_SETTINGS_HASH: _hash(pod), names.ANN_TABLES_HASH: calibration.tables_hash}
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(job, profiling_job_name(job.name, gpu_type, attempt), lbls, ann),
        "spec": {
            "backoffLimit": 0,
            # Counts from the Job's start: a queued (suspended) attempt is not timed.
            "activeDeadlineSeconds": p.timeout_seconds,
            "template": template,
        },
    }
    return queued(body, config.profiling_queue or job.queue, job.priority_class)


def profiling_settings_hash(
    job: JobMeta, spec: DLRMJobSpec, gpu_type: str, config: OperatorConfig, calibration: Calibration
) -> str:
    """The ``shardwise.dev/settings-hash`` the next profiling attempt would carry: its
    pod template, which a deterministic failure is about."""
    body = profiling_job(job, spec, gpu_type, 1, config, calibration)
    return str(body["metadata"]["annotations"][names.ANN_SETTINGS_HASH])
