"""``python -m shardwise.operator.pod.base_model``: the first step of a profiling pod.

Calibration fine-tunes the best model there is for the GPU type (docs/design.md §7):
the one published for it. The operator mounts that model's ConfigMaps into the pod
(chunk ``i`` at ``<dir>/<i>/payload.tar.gz``; optional volumes, so a model deleted
meanwhile does not keep the pod from starting), which needs no API access, and names
the archive's sha256. This reassembles and checks them and writes the model file.
Anything amiss (a chunk missing, a model republished since: another sha256) exits 1
with one line on stderr, and the pod calibrates from the bundled model instead.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

from shardwise import names
from shardwise.basics import UserError
from shardwise.profiler.publish import read_members

#: Exit code when there is no usable base model (the pod goes on without one).
NO_BASE = 1


def assemble(directory: Path, chunks: int, sha256: str) -> bytes:
    """The model file from the mounted chunks; :class:`UserError` says what is amiss."""
    parts = []
    for i in range(chunks):
        path = directory / str(i) / names.PAYLOAD_KEY
        if not path.is_file():
            raise UserError(f"chunk {i} of the published model is not mounted at {path}")
        parts.append(path.read_bytes())
    archive = b"".join(parts)
    if hashlib.sha256(archive).hexdigest() != sha256:
        raise UserError(
            "the published model changed since this pod was created (its sha256 differs)"
        )
    models = {k: v for k, v in read_members(archive).items() if k.endswith(".pt")}
    if len(models) != 1:
        raise UserError(f"the published archive holds {len(models)} model files, not one")
    return next(iter(models.values()))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardwise.operator.pod.base_model", description=__doc__
    )
    p.add_argument("directory", type=Path, help="where the chunks are mounted")
    p.add_argument("--chunks", type=int, required=True, help="how many chunks")
    p.add_argument("--sha256", required=True, help="the published archive's sha256")
    p.add_argument("--out", type=Path, required=True, help="the model file to write")
    args = p.parse_args(argv)
    try:
        data = assemble(args.directory, args.chunks, args.sha256)
    except UserError as err:
        print(f"no published base model ({err}): calibrating from the bundled one", file=sys.stderr)
        return NO_BASE
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)  # the pod's own scratch volume: one writer
    print(f"base model: the published one ({len(data)} bytes, archive sha256 {args.sha256[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
