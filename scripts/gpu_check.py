"""``make gpu-check``: every GPU path of Shardwise, run once, with its figures.

The project's CI and most of its machines have no GPU, so the CUDA paths (the fused
kernels on cuda, NCCL all-to-alls, refinement and calibration on cuda, the runtime on
NCCL with CUDA-event live costs) are checked here, the day a GPU is at hand. It is the
first thing to run on such a machine (docs/gpu-check.md):

    make gpu-check                  # sets up .venv-gpu from the package indexes, then runs
    python scripts/gpu_check.py --python /path/to/python   # an interpreter that has them

Without a GPU (no ``nvidia-smi`` listing one) it prints what it would run and exits 0
with "no GPU: skipped", importing nothing heavy. With one, it installs what it needs
(torch and fbgemm-gpu built for CUDA, from ``--cuda-index``; the rest from the default
index; TorchRec without its dependencies, as the image does), then runs each step in
its own time budget and prints a table: the step, ok or FAILED, its seconds, and the
figure it measured. It exits 1 when a step failed; the logs are in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_INDEX = "https://download.pytorch.org/whl/cu130"  # the Dockerfile's, for VARIANT=gpu
#: What the CPU setup gets elsewhere, built for CUDA here (the Dockerfile's gpu variant).
CUDA_PINS = ("torch==2.13.0", "fbgemm-gpu==1.8.0")
TORCHREC = "torchrec==1.8.0"
#: Small enough to finish in minutes on one GPU, large enough to time something real.
TABLES, BATCH, MEMORY = 16, 4096, "16GiB"

#: A one-rank NCCL group: what one GPU can show of NCCL (an all-to-all needs two).
ONE_RANK_NCCL = """
import os, time, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
x = torch.randn(4096, 256, device="cuda"); y = torch.empty_like(x)
for _ in range(5): dist.all_to_all_single(y, x)
torch.cuda.synchronize(); start = torch.cuda.Event(enable_timing=True)
end = torch.cuda.Event(enable_timing=True); start.record()
for _ in range(50): dist.all_to_all_single(y, x)
end.record(); torch.cuda.synchronize()
print(f"1-rank NCCL all_to_all_single of 4 MiB: {start.elapsed_time(end) / 50 * 1e3:.1f} us")
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Step:
    """One GPU path: the command, its time budget, and how to find its figure."""

    name: str
    argv: list[str]
    budget_s: int
    figure: str  # a regex over the output; its last match is the figure shown
    env: dict[str, str] | None = None


def gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none without the driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")]


def steps(py: str, work: Path, n_gpus: int) -> list[Step]:
    """The GPU paths, in order; ``py`` is an interpreter with the CUDA stack."""
    sw = [py, "-m", "shardwise"]
    t = str(work / "tables.yaml")
    ranks = max(2, min(n_gpus, 8))
    job = ["--gpus", str(ranks), "--gpu-memory", MEMORY, "--batch-per-rank", str(BATCH)]
    out: list[Step] = [
        Step(
            "tables",
            [*sw, "tables", "generate", "--count", str(TABLES), "--seed", "3", "--out", t],
            120,
            r"wrote .*",
        ),
        Step(
            "profile compute (cuda)",
            [
                *sw,
                "profile",
                "compute",
                "--tables",
                t,
                "--samples",
                "30",
                "--global-batch",
                str(BATCH * 2),
                "--measure-on",
                "cuda",
                "--out",
                str(work / "compute"),
            ],
            240,
            r"\d+ compute samples in .*",
        ),
    ]
    if n_gpus >= 2:
        out.append(
            Step(
                "profile comm (NCCL)",
                [
                    *sw,
                    "profile",
                    "comm",
                    "--world-size",
                    str(ranks),
                    "--samples",
                    "10",
                    "--out",
                    str(work / "comm"),
                ],
                240,
                r"\d+ comm samples in .*",
            )
        )
    else:
        out.append(
            Step(
                "NCCL, 1 rank (comm needs >= 2 GPUs)",
                [py, "-c", ONE_RANK_NCCL],
                120,
                r"1-rank NCCL .*",
            )
        )
    out += [
        Step(
            "plan (model only)",
            [
                *sw,
                "plan",
                t,
                *job,
                "--target-device",
                "cuda",
                "--refine",
                "none",
                "--out",
                str(work / "plan.json"),
            ],
            180,
            r"wrote .*plan\.json.*",
        ),
        Step(
            "evaluate (cuda, CUDA events)",
            [
                *sw,
                "evaluate",
                str(work / "plan.json"),
                "--tables",
                t,
                "--measure-on",
                "cuda",
                "--repeats",
                "3",
            ],
            240,
            r"(?i)max.*ms.*|imbalance.*",
        ),
        Step(
            "calibrate (cuda, 1 min)",
            [
                *sw,
                "calibrate",
                "--tables",
                t,
                *job,
                "--minutes",
                "1",
                "--measure-on",
                "cuda",
                "--work-dir",
                str(work / "calibrate"),
            ],
            300,
            r"(?i)ranks priced within.*|verdict.*",
        ),
        Step(
            "plan --refine measured (cuda)",
            [
                *sw,
                "plan",
                t,
                *job,
                "--target-device",
                "cuda",
                "--refine",
                "measured",
                "--refine-budget",
                "60",
                "--out",
                str(work / "refined.json"),
            ],
            300,
            r"(?i)refine.*ms.*",
        ),
        Step(
            "trainer plan",
            [
                *sw,
                "plan",
                t,
                "--gpus",
                str(min(n_gpus, 2)),
                "--gpu-memory",
                MEMORY,
                "--batch-per-rank",
                "512",
                "--target-device",
                "cuda",
                "--refine",
                "none",
                "--out",
                str(work / "train-plan.json"),
            ],
            180,
            r"wrote .*",
        ),
        Step(
            "trainer on NCCL (shardwise-launch, live costs)",
            [
                py,
                "-m",
                "shardwise.runtime.launch",
                "--standalone",
                f"--nproc_per_node={min(n_gpus, 2)}",
                "-m",
                "shardwise.runtime.train",
                "--tables",
                t,
                "--steps",
                "60",
                "--log-every",
                "20",
                "--probe",
                "--summary",
                str(work / "train.json"),
            ],
            300,
            r"(?i)step \d+ loss .*",
            env={"SHARDWISE_PLAN": str(work / "train-plan.json")},
        ),
    ]
    return out


def run_step(step: Step, log: Path) -> tuple[bool, float, str]:
    """Run one step within its budget; (ok, seconds, its figure or why it failed)."""
    start = time.monotonic()
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", **(step.env or {})}
    try:
        proc = subprocess.run(
            step.argv, capture_output=True, text=True, timeout=step.budget_s, env=env
        )
        text, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as err:
        text = f"{err.output or ''}{err.stderr or ''}\nran past its {step.budget_s} s budget"
        ok = False
    log.write_text(text)
    found = re.findall(step.figure, text)
    tail = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
    figure = str(found[-1]).strip() if found and ok else tail[0].strip()
    return ok, time.monotonic() - start, figure[:150]


def pip_install(py: str, *args: str) -> None:
    subprocess.run([py, "-m", "pip", "install", "--quiet", *args], check=True)


def cuda_python(venv: Path, cuda_index: str) -> str:
    """``venv``'s interpreter with torch and fbgemm-gpu for CUDA, TorchRec and this
    project; made once, kept for the next run."""
    py = venv / "bin" / "python"
    stamp = venv / ".shardwise-gpu-stamp"
    if stamp.exists():
        return str(py)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cpu_only = ("torch", "fbgemm-gpu-cpu")
    rest = [d for d in project["dependencies"] if re.split(r"[=<>!~ ]", d)[0] not in cpu_only]
    print(f"setting up {venv}: {', '.join(CUDA_PINS)} from {cuda_index}, then the rest")
    pip_install(str(py), "--index-url", cuda_index, *CUDA_PINS)
    pip_install(str(py), *rest)
    pip_install(str(py), "--no-deps", TORCHREC)
    pip_install(str(py), "--no-deps", "-e", str(ROOT))
    stamp.touch()
    return str(py)


def table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows
    )


def main(argv: Sequence[str] | None = None, found: Callable[[], list[str]] = gpus) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", help="an interpreter with the CUDA stack (default: make .venv-gpu)")
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu", help="where to set it up")
    p.add_argument("--cuda-index", default=CUDA_INDEX, help="index of the CUDA wheels")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check", help="logs, data")
    args = p.parse_args(argv)
    listed = found()
    if not listed:
        print("The GPU paths gpu-check runs where CUDA is present:")
        for s in steps("python", args.out, 2):
            env = "".join(f"{k}={v} " for k, v in (s.env or {}).items())
            command = env + " ".join(a if "\n" not in a else "'…'" for a in s.argv)
            print(f"  - {s.name}:\n      {command.replace(str(ROOT) + '/', '')}")
        print("no GPU: skipped")
        return 0
    print("\n".join(listed))
    py = args.python or cuda_python(args.venv, args.cuda_index)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [("step", "result", "seconds", "figure")]
    failed = 0
    for i, step in enumerate(steps(py, args.out, len(listed))):
        print(f"[{i + 1}] {step.name} …", flush=True)
        ok, seconds, figure = run_step(step, args.out / f"{i + 1:02d}.log")
        failed += not ok
        rows.append((step.name, "ok" if ok else "FAILED", f"{seconds:.0f}", figure))
    print(table(rows))
    print(f"logs in {args.out}; these are GPU figures ({listed[0]})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
