"""``python -m shardwise.operator.publish_model``: the last step of a profiling pod.

Publishes a trained cost model (``shardwise pretrain``'s output) for one GPU type as
the ConfigMaps the operator looks for (:mod:`shardwise.operator.published_models`), through
the pod's service account.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise import names
from shardwise.basics import UserError
from shardwise.names import costmodel_name
from shardwise.operator.observe import format_time
from shardwise.profiler.publish import ConfigMapApi, publish


def model_fingerprint_key(path: Path) -> str:
    """The short key of the hardware the model was trained on (loads the model)."""
    from shardwise.planner.costmodel import CostModel
    from shardwise.profiler.fingerprint import Fingerprint

    return Fingerprint.from_dict(CostModel.load(path).fingerprint).key()


def publish_cost_model(
    model: Path,
    gpu_type: str,
    namespace: str,
    api: ConfigMapApi,
    *,
    job: str,
    fingerprint_key: str | None = None,
    now: datetime.datetime | None = None,
) -> list[str]:
    """Publish ``model`` as the cost model of ``gpu_type``; returns the ConfigMap names."""
    key = fingerprint_key if fingerprint_key is not None else model_fingerprint_key(model)
    when = now or datetime.datetime.now(datetime.UTC)
    return publish(
        model,
        costmodel_name(gpu_type),
        namespace,
        api,
        job=job,
        component="costmodel",
        fingerprint_key=key,
        filename=model.name,
        labels={names.LABEL_GPU_TYPE: gpu_type},
        annotations={names.ANN_PUBLISHED_AT: format_time(when)},
    )


def main(argv: Sequence[str] | None = None, api: Any = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardwise.operator.publish_model", description=__doc__
    )
    p.add_argument("model", type=Path, help="the model file written by `shardwise pretrain`")
    p.add_argument("--gpu-type", required=True, help="the node label value of the GPU type")
    p.add_argument("--namespace", required=True)
    p.add_argument("--job", required=True, help="the DLRMJob that asked for the profiling")
    args = p.parse_args(argv)
    try:
        if api is None:
            from shardwise.profiler.publish import core_v1_api

            api = core_v1_api()
        names = publish_cost_model(args.model, args.gpu_type, args.namespace, api, job=args.job)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"published the {args.gpu_type} cost model as {', '.join(names)} in {args.namespace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
