"""Published cost models as the operator reads them
(:mod:`shardwise.operator.models.cost_models`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from operator_builders import A100, NOW

from shardwise import names
from shardwise.operator.models.cost_models import (
    ANN_CALIBRATION,
    MAX_METRICS,
    calibration_annotation,
    flat_metrics,
    model_info,
    parse_calibration,
)
from shardwise.operator.pod.publish_model import ModelFacts, publish_cost_model
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


CALIBRATION = {
    "fingerprint_key": "0123456789abcdef",
    "tables": ["bbbb", "aaaa", "aaaa"],
    "batch_sizes": [8192, 16384],
    "base": "bundled",
    "speed_factors": {"fwd": 0.31, "bwd": 0.12, "comm": 1.0},
    "phases": ["speed", "finetune"],
    "samples": {"compute": 412, "comm": 0},
    "seconds": 583.25,
    "metrics": {"compute": {"mape": 0.083, "spearman": 0.97}, "note": "text", "nan": math.nan},
    "created_at": "2026-05-01T10:00:00+00:00",
    "job": {"gpus": 8, "batch_per_rank": 1024, "seed": 1},
}


def test_the_calibration_annotation_round_trips_without_torch() -> None:
    text = calibration_annotation(CALIBRATION, machine="NVIDIA A100 (108 SMs)", minutes=10)
    parsed = parse_calibration(text)
    assert parsed is not None and parsed.tables == frozenset({"aaaa", "bbbb"})
    assert parsed.status(1, 3) == {
        "machine": "NVIDIA A100 (108 SMs)",
        "fingerprint": "0123456789abcdef",
        "budgetMinutes": 10,
        "seconds": 583.2,
        "minutes": 9.72,
        "samples": {"compute": 412, "comm": 0},
        "speedFactors": {"fwd": 0.31, "bwd": 0.12, "comm": 1.0},
        "phases": ["speed", "finetune"],
        "base": "bundled",
        "createdAt": "2026-05-01T10:00:00Z",
        "batchSizes": [8192, 16384],
        "gpus": 8,
        "batchPerRank": 1024,
        "metrics": {"compute.mape": 0.083, "compute.spearman": 0.97},
        "tablesCovered": 1,
        "tablesTotal": 3,
    }
    assert parse_calibration(None) is None and parse_calibration("{not json") is None
    assert parse_calibration('{"machine": "x"}') is None, "no tables: not a calibration"


def test_model_info_reads_the_chunk_count_and_the_calibration() -> None:
    bodies = build_configmaps(
        b"y" * 2500, "shardwise-costmodel-a100", "ml", job="dj", component="costmodel",
        chunk_bytes=1000, labels={names.LABEL_GPU_TYPE: A100},
        annotations={ANN_CALIBRATION: calibration_annotation(CALIBRATION)},
    )  # fmt: skip
    info = model_info(bodies[0])
    assert info is not None and info.chunks == 3
    assert info.chunk_names() == [f"shardwise-costmodel-a100-{i}" for i in range(3)]
    assert info.calibration is not None and "aaaa" in info.calibration.tables


def test_flat_metrics_keep_numbers_only_and_at_most_a_few() -> None:
    many = {f"k{i:03d}": {"mape": i / 100} for i in range(100)}
    flat = flat_metrics(many)
    assert len(flat) == MAX_METRICS and flat["k000.mape"] == 0.0
    ranked = {"base": {"mape": 0.9}, "final": {"mape": 0.1}, "test_tables": 3, **many}
    assert list(flat_metrics(ranked))[:3] == ["final.mape", "test_tables", "base.mape"], (
        "the calibrated model's own metrics are never the ones cut"
    )
    assert flat_metrics({"a": True, "b": [1, 2], "c": {"d": 1}}) == {"c.d": 1.0}


class FakeApi:
    """The two CoreV1Api calls publishing makes, recorded."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def create_namespaced_config_map(self, namespace: str, body: Any, **_: Any) -> Any:
        self.bodies.append(body)

    def replace_namespaced_config_map(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        self.bodies.append(body)


def test_publishing_a_calibrated_model_records_what_it_covers(tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    api = FakeApi()
    facts = ModelFacts("0123456789abcdef", "cpu:AMD EPYC (2 cores)", CALIBRATION)
    publish_cost_model(model, A100, "ml", api, job="dj", facts=facts, minutes=10, now=NOW)
    (head,) = api.bodies
    info = model_info(head)
    assert info is not None and info.calibration is not None
    assert info.calibration.tables == {"aaaa", "bbbb"} and info.fingerprint == facts.fingerprint_key
    assert info.calibration.summary["machine"] == "cpu:AMD EPYC (2 cores)"


def test_too_many_signatures_for_an_annotation_still_publish_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    api = FakeApi()
    many = {**CALIBRATION, "tables": [f"{i:016x}" for i in range(20_000)]}
    publish_cost_model(model, A100, "ml", api, job="dj", facts=ModelFacts("k", "m", many), now=NOW)
    info = model_info(api.bodies[0])
    assert info is not None and info.calibration is not None
    assert info.calibration.tables == frozenset(), "covers nothing it can name"
    assert "20000 table signatures do not fit" in capsys.readouterr().err
