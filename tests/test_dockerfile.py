"""The Dockerfile, checked without a Docker engine (none runs on this project's machines;
`make image` builds it for real with buildah and smoke-tests the image, in CI).

What can be checked here: its syntax (parsed by dockerfile-parse, each RUN through
``sh -n``), multi-stage with a non-root final stage and no build tools in it, the
default base image pinned by tag and digest and the default package sources the
official ones, every pip install pinned (``==``) and in step with pyproject.toml and
the Makefile, every COPY source present and let through by .dockerignore, a wheel
built from exactly what it copies, and the command it runs (``shardwise --help``)
working in this venv.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
KNOWN = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip
BUILD_TOOLS = re.compile(
    r"\b(build-essential|gcc|g\+\+|clang|make|cmake|ninja-build|cargo|rustc|"
    r"python3?-dev|libpython3[.0-9]*-dev|[a-z0-9.+-]+-dev)\b"
)
PINNED_FROM = re.compile(r"^[a-z0-9./_-]+:[0-9][0-9A-Za-z._-]*@sha256:[0-9a-f]{64}$")
OFFICIAL_BASE = "python:3.11.14-slim-bookworm@sha256:"


@dataclass
class Stage:
    name: str
    image: str  # as written in FROM, e.g. ${BASE}
    instructions: list[tuple[str, str]] = field(default_factory=list)


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM (what FROM lines may use), with their defaults."""
    parser = DockerfileParser(path=str(DOCKERFILE), cache_content=True)
    out: dict[str, str] = {}
    for item in parser.structure:
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG":
            name, sep, default = item["value"].partition("=")
            assert sep, f"ARG {name} before FROM needs a default"
            out[name] = default
    return out


def default_image(stage: Stage) -> str:
    """The stage's base image with the build arguments' defaults."""
    args = global_args()
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], stage.image)


def stages() -> list[Stage]:
    parser = DockerfileParser(path=str(DOCKERFILE), cache_content=True)
    out: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        assert instruction in KNOWN, (
            f"line {item['startline'] + 1}: unknown instruction {instruction}"
        )
        if instruction == "FROM":
            parts = value.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", (
                f"FROM without a stage name: {value}"
            )
            out.append(Stage(parts[2], parts[0]))
        elif not out:
            assert instruction == "ARG", f"{instruction} before the first FROM"
        else:
            out[-1].instructions.append((instruction, value))
    return out


def runs(stage: Stage) -> list[str]:
    return [v for i, v in stage.instructions if i == "RUN"]


def pip_installs(command: str) -> list[list[str]]:
    """The argument lists of every ``pip install`` in a shell command."""
    out = []
    for part in re.split(r"&&|;|\|\||\n|\)", command):
        words = shlex.split(part, posix=True) if part.strip() else []
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                out.append(words[i + 2 :])
    return out


def requirements(args: list[str]) -> list[str]:
    """The package arguments of ``pip install`` (options and their values dropped)."""
    with_value = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r"}
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in with_value:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def pins() -> dict[str, str]:
    """Every package the Dockerfile installs by name, with its pinned version."""
    out: dict[str, str] = {}
    for stage in stages():
        for command in runs(stage):
            for args in pip_installs(command):
                for req in requirements(args):
                    if req == ".":
                        continue
                    name, _, version = req.partition("==")
                    key = canonicalize_name(name)
                    # torch==2.13.0+cpu (the CPU build) and torch==2.13.0 are one pin.
                    public = Version(version).public
                    assert out.setdefault(key, public) == public, (
                        f"{key} pinned twice: {out[key]}, {version}"
                    )
    return out


def test_multi_stage_with_pinned_bases() -> None:
    s = stages()
    assert [x.name for x in s] == ["build", "runtime"]
    for stage in s:
        image = default_image(stage)
        assert PINNED_FROM.match(image), (
            f"{stage.name}: {image} is not pinned by version and digest"
        )
        # By default the official Python image (BASE swaps it, e.g. for `make image`).
        assert image.startswith(OFFICIAL_BASE), image
    # The venv built in the first stage runs on the same Python in the last: both
    # stages name the same image, whatever BASE is.
    assert len({x.image for x in s}) == 1
    assert set(global_args()) == {"BASE"}


def test_run_commands_are_valid_shell() -> None:
    for stage in stages():
        for command in runs(stage):
            proc = subprocess.run(
                ["sh", "-n", "-c", command], capture_output=True, text=True, check=False
            )
            assert proc.returncode == 0, f"{stage.name}: {proc.stderr}\n{command}"
        for instruction, value in stage.instructions:
            if instruction in ("ENTRYPOINT", "CMD"):
                assert isinstance(json.loads(value), list), f"{instruction} must be exec form"


def test_every_pip_install_is_pinned() -> None:
    seen = 0
    for stage in stages():
        for command in runs(stage):
            for args in pip_installs(command):
                assert "--extra-index-url" not in args, (
                    "mixing indexes invites dependency confusion"
                )
                for req in requirements(args):
                    seen += 1
                    if req == ".":
                        assert "--no-deps" in args, "the project installs without resolving again"
                        continue
                    assert re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][0-9A-Za-z.+!-]*", req), (
                        f"{req} is not pinned"
                    )
    assert seen > 60


def test_pins_follow_pyproject_and_makefile() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins()
    for dep in project["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in pinned, f"pyproject.toml needs {dep}; the Dockerfile does not pin it"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"the Dockerfile pins {name}=={pinned[name]}, pyproject.toml asks for {dep}"
        )
    makefile = (ROOT / "Makefile").read_text()
    torchrec = re.search(r"^TORCHREC := torchrec==(\S+)$", makefile, re.MULTILINE)
    assert torchrec is not None
    assert pinned["torchrec"] == torchrec.group(1)
    # The GPU variant's kernels are the same release as the CPU build's.
    assert pinned["fbgemm-gpu"] == pinned["fbgemm-gpu-cpu"]


def test_variants() -> None:
    build = stages()[0]
    args = dict(v.split("=", 1) for i, v in build.instructions if i == "ARG")
    assert args["VARIANT"] == "cpu"
    (variant_run,) = [c for c in runs(build) if 'case "$VARIANT"' in c]
    cpu = variant_run.split("cpu)", 1)[1].split(";;", 1)[0]
    gpu = variant_run.split("gpu)", 1)[1].split(";;", 1)[0]
    # The CPU build by its local version: whatever index CPU_INDEX names, a CUDA torch
    # cannot match.
    assert '--index-url "$CPU_INDEX" torch==' in cpu
    (torch_cpu,) = [w for w in cpu.split() if w.startswith("torch==")]
    assert Version(torch_cpu.removeprefix("torch==")).local == "cpu", torch_cpu
    assert "fbgemm-gpu-cpu==" in cpu and "fbgemm-gpu==" not in cpu
    assert '--index-url "$CUDA_INDEX" torch==' in gpu and "fbgemm-gpu==" in gpu
    # The default sources are the official ones.
    assert args["CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["CUDA_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    assert args["PIP_INDEX_URL"] == "https://pypi.org/simple"
    assert "exit 1" in variant_run.split("*)", 1)[1]  # anything else stops the build
    # torchrec without its dependencies, after the kernels, as the Makefile does.
    assert any("pip install --no-deps torchrec==" in c for c in runs(build))


def test_final_stage_is_non_root_without_build_tools() -> None:
    final = stages()[-1]
    users = [v for i, v in final.instructions if i == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root"), users[-1]
    assert uid.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    # The chart's pods run as this uid.
    chart = (ROOT / "charts" / "shardwise" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {uid}" in chart
    instructions = [i for i, _ in final.instructions]
    assert instructions.index("USER") > max(i for i, x in enumerate(instructions) if x == "RUN")
    for command in runs(final):
        assert "apt-get install" not in command and "pip install" not in command, command
        assert not BUILD_TOOLS.search(command), command
    copies = [v for i, v in final.instructions if i == "COPY"]
    assert "--from=build /opt/shardwise /opt/shardwise" in copies
    assert json.loads(dict(final.instructions)["ENTRYPOINT"]) == ["shardwise"]


def test_the_default_entry_is_a_module_of_the_package() -> None:
    """The operator runs `torchrun -m DEFAULT_ENTRY`: a module the build installs (from
    the COPYed runtime/), not a file the image must carry; the examples stay for users."""
    from shardwise.operator.render.container import DEFAULT_ENTRY

    assert DEFAULT_ENTRY == "shardwise.runtime.train"
    spec = importlib.util.find_spec(DEFAULT_ENTRY)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == ROOT / "runtime" / "train.py"
    build = [v for i, v in stages()[0].instructions if i == "COPY"]
    assert "runtime ./runtime" in build
    copies = [v for i, v in stages()[-1].instructions if i == "COPY"]
    assert "examples /app/examples" in copies
    assert (ROOT / "examples" / "train_dlrm.py").is_file()


def _context_sources() -> list[str]:
    out = []
    for stage in stages():
        for instruction, value in stage.instructions:
            if instruction in ("COPY", "ADD") and not value.startswith("--from="):
                words = [w for w in shlex.split(value) if not w.startswith("--")]
                out += words[:-1]
    return out


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.removeprefix("!").strip("/")
        regex = (
            re.escape(pat)
            .replace(r"\*\*/", "(.*/)?")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_copy_sources_exist_and_reach_the_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = _context_sources()
    assert {
        "pyproject.toml",
        "README.md",
        "src",
        "planner",
        "profiler",
        "runtime",
        "operator",
        "examples",
    } <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert not _dockerignore_excludes(source, patterns), f".dockerignore drops {source}"
    # Files inside the copied folders get through too, caches do not.
    assert not _dockerignore_excludes("planner/data/costmodel-cpu.pt", patterns)
    assert _dockerignore_excludes("planner/__pycache__/plan.cpython-311.pyc", patterns)
    assert _dockerignore_excludes(".venv/bin/python", patterns)
    assert _dockerignore_excludes("tests/test_chart_render.py", patterns)
    assert fnmatch.fnmatch("x", "*")  # (the matcher's `*` is fnmatch's within a segment)


@pytest.mark.slow
def test_wheel_from_exactly_the_copied_files(tmp_path: Path) -> None:
    """What the build stage installs (`pip install .` over the COPYed files) holds every
    package, the bundled cost model and both console scripts."""
    context = tmp_path / "context"
    context.mkdir()
    for source in _context_sources():
        if source == "examples":
            continue  # copied to the final stage, not part of the package
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(
                src, context / source, symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
            )  # fmt: skip
        else:
            shutil.copy2(src, context / source)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("shardwise-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for expected in (
        "shardwise/cli/__init__.py",
        "shardwise/planner/plan.py",
        "shardwise/runtime/launch.py",
        "shardwise/runtime/train.py",
        "shardwise/runtime/trainer.py",
        "shardwise/planner/data/costmodel-cpu.pt",
        "shardwise/profiler/publish.py",
        "shardwise/operator/crd.py",
    ):
        assert expected in names, expected
    assert "shardwise = shardwise.cli:main" in entry_points
    assert "shardwise-launch = shardwise.runtime.launch:main" in entry_points


def test_the_entrypoint_runs() -> None:
    """`shardwise --help` (the image's CMD) and the worker launcher work in this venv."""
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run(
        [str(bin_dir / "shardwise"), "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan" in proc.stdout and "profile" in proc.stdout
    proc = subprocess.run(
        [str(bin_dir / "shardwise-launch"), "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("pip install a==1 && pip install --no-deps b==2", [["a==1"], ["--no-deps", "b==2"]]),
        (
            'case "$V" in cpu) pip install --index-url U t==1 ;; esac',
            [["--index-url", "U", "t==1"]],
        ),
    ],
)
def test_pip_install_extraction(command: str, expected: list[list[str]]) -> None:
    assert pip_installs(command) == expected
    assert requirements(["--index-url", "U", "t==1", "-c", "c.txt", "x==2"]) == ["t==1", "x==2"]
