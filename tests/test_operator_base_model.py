"""The profiling pod's first step (:mod:`shardwise.operator.pod.base_model`): the published
model, mounted chunk by chunk, becomes the file calibration starts from; anything amiss
leaves the pod on the bundled model instead of failing it."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from shardwise import names
from shardwise.operator.pod.base_model import NO_BASE, main
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
