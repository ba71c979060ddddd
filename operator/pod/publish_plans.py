"""``python -m shardwise.operator.pod.publish_plans``: the profiling pod's step that hands its
refined plans (``shardwise refine-plans``' directory) to the operator.

Each refined plan becomes the ConfigMap ``names.refined_plan_name(job, W, key)``:
``plan.json`` in its data, the job's and the component's labels and the GPU type's, an
owner reference to the DLRMJob (its uid comes in the ``SHARDWISE_JOB_UID`` environment
variable: the plans go with the job), and the ``shardwise.dev/refined`` annotation: the
key of the inputs it was made for and what was measured
(:mod:`shardwise.operator.models.refined_plans` reads it). A plan too large for a ConfigMap is
refused with the reason (the operator then plans with the model alone for that size);
the others are still published. Needs create/update on ConfigMaps (the profiler's Role).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardwise import names
from shardwise.basics import UserError, format_bytes
from shardwise.operator.cluster.summaries import format_time
from shardwise.operator.models import refined_plans as rp
from shardwise.planner.plan import Plan, load_plan
from shardwise.profiler.publish import CONFIGMAP_LIMIT_BYTES, ConfigMapApi
from shardwise.profiler.refine.worlds import read_manifest

#: Room left in a ConfigMap for its key and what the API server counts beside the data.
HEADROOM_BYTES = 16 * 1024


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 4)


def figures(
    plan: Plan,
    entry: Mapping[str, Any],
    manifest: Mapping[str, Any],
    published_at: datetime.datetime,
) -> dict[str, Any]:
    """What was measured, for the annotation: the fresh re-measurement's max-rank cost
    (compute plus the declared all-to-all) of the model's plan and the refined one,
    compute alone, TorchRec's plan when refinement timed it, moves, kernels, seconds."""
    rec = plan.refinement
    if rec is None:
        raise UserError(f"{entry.get('file')}: the plan carries no refinement record")
    start = rec.start_objective_seconds or rec.start_max_compute_seconds
    final = rec.final_objective_seconds or rec.final_max_compute_seconds
    torchrec = entry.get("torchrecObjectiveSeconds")
    return {
        "measuredOn": str(manifest.get("measuredOn", "")),
        "measureDevice": rec.device,
        "startMaxMs": _ms(start),
        "finalMaxMs": _ms(final),
        "startMaxComputeMs": _ms(rec.start_max_compute_seconds),
        "finalMaxComputeMs": _ms(rec.final_max_compute_seconds),
        "torchrecMaxMs": _ms(float(torchrec)) if isinstance(torchrec, int | float) else None,
        "startedFrom": rec.started_from,
        "moves": rec.moves,
        "kernels": rec.kernels_measured,
        "seconds": round(rec.seconds, 2),
        "modelFingerprint": str(manifest.get("modelFingerprint", "")),
        "publishedAt": format_time(published_at),
    }


def refined_configmap(
    plan: Plan,
    *,
    job: str,
    job_uid: str,
    namespace: str,
    gpu_type: str,
    tables_hash: str,
    seed: int,
    figures: Mapping[str, Any],
) -> dict[str, Any]:
    """The ConfigMap of one refined plan (pure); a :class:`UserError` when the plan is
    too large for one."""
    topo = plan.topology
    made_for = rp.Wanted(
        tables_hash,
        plan.world_size,
        topo.batch_size_per_rank,
        topo.gpu_memory_bytes,
        topo.memory_reserve,
        topo.device,
        gpu_type,
        seed,
    )
    key = made_for.key()
    name = names.refined_plan_name(job, plan.world_size, key)
    text = plan.model_dump_json() + "\n"
    size = len(text.encode())
    if size > CONFIGMAP_LIMIT_BYTES - HEADROOM_BYTES:
        raise UserError(
            f"the refined plan for {plan.world_size} GPUs is {format_bytes(size)}, more than "
            f"a ConfigMap holds ({format_bytes(CONFIGMAP_LIMIT_BYTES)}); not published: the "
            f"operator plans {plan.world_size} GPUs with the model alone"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                names.LABEL_JOB: job,
                names.LABEL_COMPONENT: names.COMPONENT_REFINED_PLAN,
                names.LABEL_GPU_TYPE: gpu_type,
            },
            "annotations": {rp.ANN_REFINED: rp.annotation(made_for, plan.hash, figures)},
            # Not blockOwnerDeletion: that would need update on the DLRMJob's finalizers,
            # which the profiler's account has no business with.
            "ownerReferences": [
                {
                    "apiVersion": names.API_VERSION,
                    "kind": names.KIND,
                    "name": job,
                    "uid": job_uid,
                    "controller": True,
                }
            ],
        },
        "data": {names.PLAN_KEY: text},
    }


def publish_refined_plans(
    directory: Path,
    api: ConfigMapApi,
    *,
    job: str,
    job_uid: str,
    namespace: str,
    gpu_type: str,
    tables_hash: str,
    now: datetime.datetime | None = None,
    say: Any = print,
) -> tuple[list[str], list[str]]:
    """Publish every refined plan of ``directory``; the ConfigMap names, and the sizes
    refused with why (too large). A missing directory or manifest publishes nothing."""
    from kubernetes.client.exceptions import ApiException

    manifest = read_manifest(directory)
    if manifest is None:
        say(f"no refined plans in {directory} (no readable refined.json): nothing to publish")
        return [], []
    when = now or datetime.datetime.now(datetime.UTC)
    seed = int((manifest.get("settings") or {}).get("seed", 0))
    published: list[str] = []
    refused: list[str] = []
    for entry in manifest.get("sizes") or []:
        if entry.get("state") != "refined":
            say(f"{entry.get('worldSize')} GPUs: not refined ({entry.get('why', '')})")
            continue
        plan = load_plan(directory / str(entry["file"]))
        try:
            body = refined_configmap(
                plan, job=job, job_uid=job_uid, namespace=namespace, gpu_type=gpu_type,
                tables_hash=tables_hash, seed=seed,
                figures=figures(plan, entry, manifest, when),
            )  # fmt: skip
        except UserError as err:
            refused.append(f"{plan.world_size} GPUs: {err}")
            continue
        name = body["metadata"]["name"]
        try:
            api.create_namespaced_config_map(namespace, body)
        except ApiException as err:
            if err.status != 409:
                raise
            api.replace_namespaced_config_map(name, namespace, body)
        published.append(name)
        f = json.loads(body["metadata"]["annotations"][rp.ANN_REFINED])
        say(
            f"published the refined plan for {plan.world_size} GPUs as {name}: measured "
            f"{f['startMaxMs']:.2f} -> {f['finalMaxMs']:.2f} ms, {f['moves']} move(s)"
        )
    return published, refused


def main(argv: Sequence[str] | None = None, api: Any = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardwise.operator.pod.publish_plans", description=__doc__
    )
    p.add_argument("directory", type=Path, help="`shardwise refine-plans --out-dir`")
    p.add_argument("--gpu-type", required=True, help="the node label value of the GPU type")
    p.add_argument("--namespace", required=True)
    p.add_argument("--job", required=True, help="the DLRMJob the plans are for")
    p.add_argument("--tables-hash", required=True, help="the profiling attempt's tables hash")
    p.add_argument(
        "--job-uid",
        default=os.environ.get(rp.ENV_JOB_UID, ""),
        help=f"the DLRMJob's uid (default: ${rp.ENV_JOB_UID})",
    )
    args = p.parse_args(argv)
    try:
        if not args.job_uid:
            raise UserError(
                f"the DLRMJob's uid is unknown: give --job-uid or set {rp.ENV_JOB_UID} (the "
                "refined plans are owned by the job)"
            )
        if api is None:
            from shardwise.profiler.publish import core_v1_api

            api = core_v1_api()
        _, refused = publish_refined_plans(
            args.directory, api, job=args.job, job_uid=args.job_uid,
            namespace=args.namespace, gpu_type=args.gpu_type, tables_hash=args.tables_hash,
        )  # fmt: skip
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for why in refused:
        print(f"error: {why}", file=sys.stderr)
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
