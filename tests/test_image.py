"""`make image`: scripts/build-image.sh and scripts/image-smoke.sh, checked statically.

The build and the smoke test themselves need root, buildah and a few minutes; CI runs
them (`make image` in .ci/run). These checks keep the scripts in step with the
Dockerfile, the Makefile, CI and the chart.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_dockerfile import global_args, stages

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BUILD = SCRIPTS / "build-image.sh"
SMOKE = SCRIPTS / "image-smoke.sh"


@pytest.mark.parametrize("script", [BUILD, SMOKE], ids=lambda p: p.name)
def test_scripts_are_strict_valid_bash(script: Path) -> None:
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_build_args_are_the_dockerfiles() -> None:
    declared = set(global_args())
    for stage in stages():
        declared |= {v.partition("=")[0] for i, v in stage.instructions if i == "ARG"}
    passed = set(re.findall(r'--build-arg "([A-Z_]+)=', BUILD.read_text()))
    assert passed == {"BASE", "CPU_INDEX", "PIP_INDEX_URL"}
    assert passed <= declared, passed - declared


def test_smoke_runs_as_the_images_user() -> None:
    final = stages()[-1]
    (user,) = [v for i, v in final.instructions if i == "USER"]
    text = SMOKE.read_text()
    assert f'[[ "$user" == {user} ]]' in text
    chart = (ROOT / "charts" / "shardwise" / "templates" / "deployment.yaml").read_text()
    uid, gid = user.split(":")
    assert f"runAsUser: {uid}" in chart and f"runAsGroup: {gid}" in chart
    assert "readOnlyRootFilesystem: true" in chart and "mountPath: /tmp" in chart


def test_smoke_launcher_compiles() -> None:
    """The Python that drops to the image's user (a shell string in the script)."""
    text = SMOKE.read_text()
    code = text.split("DROP_TO_USER='", 1)[1].split("\n'\n", 1)[0]
    assert "'" not in code  # it sits in single quotes
    compile(code, "DROP_TO_USER", "exec")
    assert "os.setgroups([])" in code and "PR_SET_NO_NEW_PRIVS" in code


def test_smoke_trains_through_the_operators_default_command() -> None:
    """The worker run is what the operator starts: the launcher, then `-m` the default
    entry (a module of the installed package, not a file under /app)."""
    from shardwise.operator.render.container import DEFAULT_ENTRY, LAUNCHER

    text = " ".join(SMOKE.read_text().replace("\\\n", " ").split())
    assert f"{' '.join(LAUNCHER)} --standalone --nproc_per_node=2 -m {DEFAULT_ENTRY} " in text
    assert "/app/examples/train_dlrm.py" not in text


def test_make_image_and_ci() -> None:
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^image:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert target is not None, "the Makefile has no image target"
    recipe = target.group(1)
    assert "scripts/build-image.sh" in recipe and "scripts/image-smoke.sh" in recipe
    assert recipe.index("build-image.sh") < recipe.index("image-smoke.sh")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make image$", ci, re.MULTILINE), ".ci/run does not run make image"
