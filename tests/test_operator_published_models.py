"""Published cost models as the operator reads them
(:mod:`shardwise.operator.published_models`)."""

from __future__ import annotations

from operator_builders import A100, NOW

from shardwise import names
from shardwise.operator.published_models import model_info
from shardwise.profiler.publish import build_configmaps


def test_model_info_reads_only_chunk_zero() -> None:
    bodies = build_configmaps(
        b"x" * 3000,
        "shardwise-costmodel-a100",
        "ml",
        job="dj",
        component="costmodel",
        chunk_bytes=1000,
        labels={names.LABEL_GPU_TYPE: A100},
        annotations={names.ANN_PUBLISHED_AT: "2026-05-01T10:00:00Z"},
    )
    infos = [model_info(b) for b in bodies]
    assert infos[1:] == [None, None]
    assert infos[0] is not None and infos[0].gpu_type == A100
    assert infos[0].is_fresh(NOW, 3 * 3600) and not infos[0].is_fresh(NOW, 3600)
