"""The spec's problems name their fields (:mod:`shardwise.operator.crd`)."""

from __future__ import annotations

import pytest
from k8s.helpers import dlrmjob

from shardwise.operator.crd import SpecError, parse_spec


def test_spec_problems_name_their_fields() -> None:
    raw = dlrmjob(
        "dj",
        "ml",
        [{"name": "t0", "rows": 10, "dim": 8, "poolingFactor": 1, "accessHist": [0.2] * 17}],
    )
    raw["spec"]["workers"] = {"min": 3, "max": 2}
    with pytest.raises(SpecError) as err:
        parse_spec(raw["spec"])
    assert err.value.problems == ["spec.workers: workers.min (3) must not exceed workers.max (2)"]
    raw["spec"]["workers"] = {"min": 1, "max": 2}
    raw["spec"]["planner"]["gpuMemory"] = "lots"
    raw["spec"]["template"]["volumeMounts"] = [{"name": "ckpt", "mountPath": "/etc/shardwise"}]
    with pytest.raises(SpecError) as err:
        parse_spec(raw["spec"])
    text = "\n".join(err.value.problems)
    assert "spec.tables.inline[0].accessHist (table 't0'): access_hist must sum to 1" in text
    assert "spec.planner.gpuMemory: cannot read 'lots'" in text
    assert "spec.template.volumeMounts[0].name: no volume 'ckpt'" in text
    assert "spec.template.volumeMounts[0].mountPath: /etc/shardwise holds the plan" in text
