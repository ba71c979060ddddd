"""Measured refinement for several world sizes within one budget (``shardwise
refine-plans``): what a profiling pod runs after calibrating, so that the operator can
run a plan refined on the job's own GPU type (docs/refinement.md, "In the operator").

Each size is planned and refined exactly as ``shardwise plan --refine measured`` does
it: NeuroShard with the given cost model and the ``--comm`` it declares
(:func:`~shardwise.planner.base.run_planner`), then
:func:`~shardwise.profiler.refine.measured.refine_measured` from that plan and the planner's
runners-up (:attr:`NeuroShardPlanner.last_alternatives`), at the job's batch. The job's
own size comes first and gets half the budget; every later size gets an equal part of
what is left, so time one size did not need goes to the next. Planning counts against
a size's part.

The results go to a directory, one ``plan-<W>.json`` per refined size and a manifest
(:data:`MANIFEST`) saying what was refined, skipped and why, with the settings they
were made with. A run given the same directory and settings resumes: sizes already
done are kept, and the budget left is what the earlier run did not spend.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic.alias_generators import to_camel

from shardwise.basics import UserError, write_atomic
from shardwise.planner.base import PlannerOptions, run_planner
from shardwise.planner.comm.choice import resolve_comm
from shardwise.planner.plan import InvalidPlanError, save_plan
from shardwise.planner.registry import get_planner
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

MANIFEST = "refined.json"
MANIFEST_VERSION = 1
#: The planner whose plan (and runners-up) refinement starts from.
PLANNER = "neuroshard"
#: The job's own size gets this share of the budget when other sizes follow.
OWN_SHARE = 0.5
#: A size left with less than this after planning is skipped: no round would fit.
MIN_REFINE_SECONDS = 2.0
#: refine_measured's line for a runner-up it timed (the objective, in ms).
_TIMED = re.compile(r"^refine: torchrec's plan measured ([0-9.]+) ms against")

State = Literal["refined", "skipped"]


@dataclass(frozen=True)
class RefineJob:
    """What to refine: the job's tables, its world sizes (its own first), its GPUs and
    batch, the planner's seed and the budget for all sizes together."""

    tables: tuple[TableSpec, ...]
    worlds: tuple[int, ...]
    gpu_memory_bytes: int
    memory_reserve: float
    batch_size_per_rank: int
    target_device: Literal["cuda", "cpu"]
    seed: int
    budget_s: float
    comm: str = "auto"
    #: GPUs per host (a DLRMJob's gpusPerWorker); ``None``: each world is one host.
    gpus_per_host: int | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_host is not None:
            odd = [w for w in self.worlds if w % self.gpus_per_host]
            if self.gpus_per_host < 1 or odd:
                raise UserError(
                    f"--gpus {odd[0] if odd else ''} is not a whole number of hosts of "
                    f"--gpus-per-host {self.gpus_per_host}; give world sizes that are."
                )
        if not self.worlds or any(w < 1 for w in self.worlds):
            raise UserError(f"--gpus: give each world size as 1 or more, not {list(self.worlds)}.")
        repeated = sorted({w for w in self.worlds if self.worlds.count(w) > 1})
        if repeated:
            raise UserError(
                f"--gpus {repeated[0]} is given twice; give each world size once (the job's "
                "own first)."
            )
        if not self.budget_s > 0:
            raise UserError(f"--budget must be above 0 seconds, not {self.budget_s:g}.")

    def topology(self, world: int) -> Topology:
        """The GPUs of one world size, on its hosts (one host: no ``gpus_per_host``, as
        every planner writes it)."""
        per_host = self.gpus_per_host
        return Topology(
            gpus=world,
            gpu_memory_bytes=self.gpu_memory_bytes,
            device=self.target_device,
            batch_size_per_rank=self.batch_size_per_rank,
            memory_reserve=self.memory_reserve,
            gpus_per_host=per_host if per_host is not None and per_host < world else None,
        )

    def settings(self, model_id: str) -> dict[str, Any]:
        """What a resumed run must share with the one before it."""
        tables = json.dumps([t.model_dump(mode="json") for t in self.tables], sort_keys=True)
        return {
            "tables": hashlib.sha256(tables.encode()).hexdigest()[:16],
            "worlds": list(self.worlds),
            "gpuMemoryBytes": self.gpu_memory_bytes,
            "memoryReserve": self.memory_reserve,
            "batchSizePerRank": self.batch_size_per_rank,
            "targetDevice": self.target_device,
            "seed": self.seed,
            "budgetSeconds": self.budget_s,
            "comm": self.comm,
            "model": model_id,
            **({"gpusPerHost": self.gpus_per_host} if self.gpus_per_host else {}),
        }


def share(remaining_s: float, index: int, count: int) -> float:
    """The seconds size ``index`` of ``count`` may take of ``remaining_s``: the job's
    own (index 0) half when other sizes follow, each later one an equal part of the
    rest, the last all of it."""
    if count - index <= 1:
        return remaining_s
    if index == 0:
        return remaining_s * OWN_SHARE
    return remaining_s / (count - index)


@dataclass
class SizeResult:
    """One world size: refined (its plan in ``file``) or skipped (``why``)."""

    world_size: int
    state: State
    file: str = ""
    why: str = ""
    plan_hash: str = ""
    budget_seconds: float = 0.0
    planning_seconds: float = 0.0
    seconds: float = 0.0
    #: TorchRec's plan measured as refinement measured the others (its objective).
    torchrec_objective_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {to_camel(k): v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SizeResult:
        return cls(
            **{k: data[to_camel(k)] for k in cls.__dataclass_fields__ if to_camel(k) in data}
        )


@dataclass
class RefinedSet:
    """What a run left in its directory."""

    out_dir: Path
    sizes: list[SizeResult]
    measured_on: str
    model_fingerprint: str
    spent_seconds: float
    #: Sizes a resumed run kept from the run before it.
    resumed: list[int] = field(default_factory=list)

    def manifest(self, settings: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "settings": settings,
            "measuredOn": self.measured_on,
            "modelFingerprint": self.model_fingerprint,
            "spentSeconds": round(self.spent_seconds, 3),
            "sizes": [s.to_json() for s in self.sizes],
        }


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The directory's manifest, or None when there is none (or it is unreadable: the
    run then starts over)."""
    path = out_dir / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        return None
    return data


def _earlier(
    out_dir: Path, settings: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[int, SizeResult], float]:
    """Sizes an earlier run with these settings finished, and the seconds it spent."""
    data = read_manifest(out_dir)
    if data is None:
        return {}, 0.0
    sizes = [SizeResult.from_json(s) for s in data.get("sizes") or []]
    if data.get("settings") != settings:
        say(f"{out_dir} holds plans refined with other settings: starting over")
        for s in sizes:
            if s.file:
                (out_dir / s.file).unlink(missing_ok=True)
        return {}, 0.0
    kept = {s.world_size: s for s in sizes if s.state == "skipped" or (out_dir / s.file).is_file()}
    return kept, float(data.get("spentSeconds") or 0.0)


def refine_plans(
    job: RefineJob,
    predictor: CostPredictor,
    out_dir: Path,
    *,
    model_id: str,
    model_fingerprint: str,
    measured_on: str,
    device: str | None = None,
    say: Callable[[str], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> RefinedSet:
    """Plan and refine every size of ``job`` into ``out_dir`` (see the module
    docstring). ``device`` measures (None: cuda if present); ``measured_on`` describes
    it. ``say`` gets one line per size, ``on_step`` refinement's progress. Interrupted
    (Ctrl-C), the manifest keeps what was done and the time spent."""
    tell = say or (lambda _line: None)
    settings = job.settings(model_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    done, spent = _earlier(out_dir, settings, tell)
    result = RefinedSet(out_dir, [], measured_on, model_fingerprint, spent, sorted(done))
    started = time.perf_counter()

    def save() -> None:
        result.spent_seconds = spent + time.perf_counter() - started
        write_atomic(out_dir / MANIFEST, json.dumps(result.manifest(settings), indent=1) + "\n")

    try:
        for i, world in enumerate(job.worlds):
            if world in done:
                tell(f"{world} GPUs: kept from the earlier run ({done[world].state})")
                result.sizes.append(done[world])
                continue
            left = job.budget_s - (spent + time.perf_counter() - started)
            allot = share(left, i, len(job.worlds))
            size = _one(job, world, allot, predictor, out_dir, device, on_step)
            tell(_line(size))
            result.sizes.append(size)
            save()
    finally:
        save()
    return result


def _line(s: SizeResult) -> str:
    if s.state == "skipped":
        return f"{s.world_size} GPUs: not refined: {s.why}"
    return (
        f"{s.world_size} GPUs: refined in {s.seconds:.1f} s of {s.budget_seconds:.0f} "
        f"(planning {s.planning_seconds:.1f} s): {s.file}"
    )


def _one(
    job: RefineJob,
    world: int,
    allot: float,
    predictor: CostPredictor,
    out_dir: Path,
    device: str | None,
    on_step: Callable[[str], None] | None,
) -> SizeResult:
    """One size: plan as `shardwise plan` does, then refine as `--refine measured` does."""
    # Here, not at the top: reading a manifest (the publisher) needs no torch.
    from shardwise.profiler.refine.measured import RefinementSkipped, refine_measured

    started = time.perf_counter()
    tables = list(job.tables)
    out = SizeResult(world, "skipped", budget_seconds=round(allot, 3))
    # One declared comm for the search, the prices and the refinement (docs/comm.md).
    comm = resolve_comm(
        job.comm, world=world, device=job.target_device, predictor=predictor, measuring=False
    )
    predictor.comm_model = comm
    planner = get_planner(PLANNER, PlannerOptions(seed=job.seed, predictor=predictor))
    try:
        run = run_planner(planner, tables, job.topology(world), predictor)
    except InvalidPlanError:
        raise
    except UserError as err:
        out.why = f"planning failed: {err}"
        return out
    out.planning_seconds = round(time.perf_counter() - started, 3)
    budget = allot - out.planning_seconds
    if budget < MIN_REFINE_SECONDS:
        out.why = (
            f"{max(0.0, budget):.1f} s of its {allot:.0f} s were left after planning; give a "
            "larger --budget"
        )
        return out
    timed: list[float] = []

    def step(line: str) -> None:
        if (m := _TIMED.match(line)) is not None:
            timed.append(float(m[1]) / 1e3)
        if on_step is not None:
            on_step(f"{world} GPUs: {line}")

    alternatives = getattr(planner, "last_alternatives", {})
    try:
        refined = refine_measured(
            run.plan,
            tables,
            comm=comm,
            predictor=predictor,
            budget_s=budget,
            device=device,
            on_step=step,
            alternatives=alternatives,
            kinds=True,
        )
    except RefinementSkipped as skipped:
        out.why = str(skipped).removeprefix("refinement skipped: ")
        return out
    rec = refined.refinement
    torchrec = alternatives.get("torchrec")
    if timed:
        out.torchrec_objective_seconds = timed[0]
    elif torchrec is not None and rec is not None and torchrec.hash == run.plan.hash:
        out.torchrec_objective_seconds = rec.start_objective_seconds  # the same plan
    out.file = f"plan-{world}.json"
    save_plan(refined, out_dir / out.file)
    out.state, out.plan_hash = "refined", refined.hash
    out.seconds = round(time.perf_counter() - started, 3)
    return out
