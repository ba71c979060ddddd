"""The profiling pod's first step (:mod:`shardwise.operator.pod.base_model`): the published
model, mounted chunk by chunk, becomes the file calibration starts from; anything amiss
leaves the pod on the bundled model instead of failing it."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from operator_builders import A100, JOB, NOW, spec

from shardwise import names
from shardwise.operator.cluster.summaries import format_time
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.pod.base_model import NO_BASE, main
from shardwise.operator.render import children as render
from shardwise.profiler.publish import build_configmaps, pack

#: Incompressible, so the archive takes several chunks.
MODEL = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(100))


def mount(bodies: list[dict[str, Any]], root: Path) -> Path:
    """What the kubelet does with the pod's optional configMap volumes."""
    for i, body in enumerate(bodies):
        (root / str(i)).mkdir(parents=True)
        data = base64.b64decode(body["binaryData"][names.PAYLOAD_KEY])
        (root / str(i) / names.PAYLOAD_KEY).write_bytes(data)
    return root


def published(chunk_bytes: int = 1000) -> tuple[list[dict[str, Any]], str]:
    archive = pack(MODEL, "model.pt")
    bodies = build_configmaps(
        archive, "shardwise-costmodel-a100", "ml", job="dj", component="costmodel",
        chunk_bytes=chunk_bytes,
    )  # fmt: skip
    return bodies, hashlib.sha256(archive).hexdigest()


def test_the_mounted_chunks_become_the_base_model(tmp_path: Path) -> None:
    bodies, sha = published(chunk_bytes=200)
    assert len(bodies) > 1
    root = mount(bodies, tmp_path / "base")
    out = tmp_path / "work" / "base.pt"
    args = [str(root), "--chunks", str(len(bodies)), "--sha256", sha, "--out", str(out)]
    assert main(args) == 0
    assert out.read_bytes() == MODEL


@pytest.mark.parametrize("problem", ["republished", "chunk missing"])
def test_anything_amiss_means_the_bundled_model(
    tmp_path: Path, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bodies, sha = published(chunk_bytes=200)
    root = mount(bodies[:-1] if problem == "chunk missing" else bodies, tmp_path / "base")
    if problem == "republished":
        sha = "0" * 64
    out = tmp_path / "base.pt"
    args = [str(root), "--chunks", str(len(bodies)), "--sha256", sha, "--out", str(out)]
    assert main(args) == NO_BASE and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("no published base model (") and "from the bundled one" in err
    assert ("changed since" in err) == (problem == "republished")
    assert ("is not mounted" in err) == (problem == "chunk missing")


@pytest.mark.parametrize("problem", [None, "chunk missing"])
def test_the_pod_names_the_published_model_it_started_from(
    tmp_path: Path, problem: str | None
) -> None:
    """The pod's script as ``sh`` runs it, up to ``shardwise calibrate``: with the chunks
    mounted, calibrate starts from the pod's copy and names the published model (one
    argument, spaces and all) as its base, not the copy's path; without them, the
    bundled model. (``shardwise`` here only records its arguments: the flag's effect
    on the calibrated model is pinned by tests/test_operator_calibration.py.)"""
    bodies, sha = published(chunk_bytes=200)
    mount(bodies[:-1] if problem else bodies, tmp_path / "base")
    info = CostModelInfo(A100, "shardwise-costmodel-a100", NOW, "fp", sha, "ml", len(bodies))
    how = render.Calibration("dj-tables-0123abcd", "t" * 16, 4, info)
    script = render.profiling_script(JOB, spec(policy="IfStale"), A100, how)
    lines = script.splitlines()
    upto = next(i for i, line in enumerate(lines) if line.startswith("shardwise calibrate"))
    text = "\n".join(lines[: upto + 1])
    for mount_dir, local in (
        (render.PROFILE_BASE_DIR, tmp_path / "base"),
        (render.PROFILE_WORK_DIR, tmp_path / "work"),
    ):
        text = text.replace(mount_dir, str(local))
    record = 'shardwise() { printf \'%s\\n\' "$@" > "$ARGS"; }\n'
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ARGS": str(tmp_path / "args"),
    }
    done = subprocess.run(
        ["sh", "-c", record + text], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().splitlines()
    name = args[args.index("--base-name") + 1]
    if problem:
        assert name == "the bundled CPU model" and "--base-model" not in args
        assert "no published base model" in done.stderr
    else:
        assert (
            name == f"the published model shardwise-costmodel-a100 (published {format_time(NOW)})"
        )
        copy = Path(args[args.index("--base-model") + 1])
        assert copy == tmp_path / "work" / "base.pt" and copy.read_bytes() == MODEL
