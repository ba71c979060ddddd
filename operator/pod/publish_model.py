"""``python -m shardwise.operator.pod.publish_model``: the last step of a profiling pod.

Publishes a cost model (``shardwise calibrate``'s output, or ``shardwise pretrain``'s)
for one GPU type as the ConfigMaps the operator looks for
(:mod:`shardwise.operator.models.cost_models`), through the pod's service account. A
calibrated model's covered table signatures and calibration summary go on the
ConfigMaps as the ``shardwise.dev/calibration`` annotation, so the operator can judge
coverage without loading the model.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise import names
from shardwise.basics import UserError
from shardwise.names import costmodel_name
from shardwise.operator.cluster.summaries import format_time
from shardwise.operator.models.cost_models import ANN_CALIBRATION, calibration_annotation
from shardwise.profiler.publish import ConfigMapApi, publish

#: The API server's limit on all of an object's annotations together (bytes).
ANNOTATIONS_LIMIT = 256 * 1024


@dataclass(frozen=True)
class ModelFacts:
    """What the ConfigMaps say about the model: its hardware key and description, and
    ``metadata["calibration"]`` (empty for a model that was not calibrated)."""

    fingerprint_key: str
    machine: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict)


def model_facts(path: Path) -> ModelFacts:
    """Read them from the model file (loads the model: torch, in the pod only)."""
    from shardwise.planner.costmodel import CostModel
    from shardwise.profiler.fingerprint import Fingerprint

    model = CostModel.load(path)
    fp = Fingerprint.from_dict(model.fingerprint)
    calibration = model.metadata.get("calibration")
    return ModelFacts(
        fp.key(), fp.describe(), dict(calibration) if isinstance(calibration, Mapping) else {}
    )


def publish_cost_model(
    model: Path,
    gpu_type: str,
    namespace: str,
    api: ConfigMapApi,
    *,
    job: str,
    fingerprint_key: str | None = None,
    facts: ModelFacts | None = None,
    minutes: float | None = None,
    now: datetime.datetime | None = None,
) -> list[str]:
    """Publish ``model`` as the cost model of ``gpu_type``; returns the ConfigMap names.

    ``facts`` default to what the file says; ``fingerprint_key`` alone (tests) skips
    reading the file and publishes it as uncalibrated. ``minutes``: the calibration's
    budget, for the summary."""
    if facts is None:
        facts = ModelFacts(fingerprint_key) if fingerprint_key is not None else model_facts(model)
    when = now or datetime.datetime.now(datetime.UTC)
    annotations = {names.ANN_PUBLISHED_AT: format_time(when)}
    if facts.calibration:
        text = calibration_annotation(facts.calibration, machine=facts.machine, minutes=minutes)
        if len(text) > ANNOTATIONS_LIMIT // 2:
            # The model is still worth publishing: only the coverage goes unrecorded.
            covered = len(facts.calibration.get("tables") or [])
            print(
                f"warning: {covered} table signatures do not fit in an annotation; the "
                "published model records none (jobs with IfStale calibrate again)",
                file=sys.stderr,
            )
            text = calibration_annotation(
                {**facts.calibration, "tables": []}, machine=facts.machine, minutes=minutes
            )
        annotations[ANN_CALIBRATION] = text
    return publish(
        model,
        costmodel_name(gpu_type),
        namespace,
        api,
        job=job,
        component="costmodel",
        fingerprint_key=facts.fingerprint_key,
        filename=model.name,
        labels={names.LABEL_GPU_TYPE: gpu_type},
        annotations=annotations,
    )


def main(argv: Sequence[str] | None = None, api: Any = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardwise.operator.pod.publish_model", description=__doc__
    )
    p.add_argument("model", type=Path, help="the model file `shardwise calibrate` wrote")
    p.add_argument("--gpu-type", required=True, help="the node label value of the GPU type")
    p.add_argument("--namespace", required=True)
    p.add_argument("--job", required=True, help="the DLRMJob that asked for the profiling")
    p.add_argument("--minutes", type=float, help="the calibration's budget, for the record")
    args = p.parse_args(argv)
    try:
        if api is None:
            from shardwise.profiler.publish import core_v1_api

            api = core_v1_api()
        published = publish_cost_model(
            args.model, args.gpu_type, args.namespace, api, job=args.job, minutes=args.minutes
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"published the {args.gpu_type} cost model as {', '.join(published)} in {args.namespace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
