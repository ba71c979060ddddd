"""Planning off the event loop: the planner run in a process.

:func:`compute_plan` runs the planner for a job's
:class:`~shardwise.operator.models.plan_inputs.PlanInputs`; the operator runs it in a
``spawn`` process pool (:func:`process_pool`), so the search never holds the event
loop's GIL, a crash or out-of-memory in the planner cannot take the operator down,
and the operator process itself never imports torch. Workers cache cost predictors
by model hash, so jobs on one GPU type share the inference caches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shardwise.basics import UserError
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.models.plan_kinds import kind_fields
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

if TYPE_CHECKING:
    from shardwise.planner.costmodel import CostPredictor

T = TypeVar("T")

#: How often a planner process checks that the operator that started it is alive.
PARENT_CHECK_SECONDS = 0.5
#: A planner process's exit status when its operator was gone.
PARENT_GONE_EXIT = 3


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner process needs (plain, picklable data)."""

    tables_json: str
    topology_json: str
    planner: str
    seed: int
    model_bytes: bytes | None = None
    model_sha256: str | None = None


@dataclass(frozen=True)
class PlanResult:
    plan_json: str | None
    error: str | None
    fingerprint: str
    seconds: float

    def plan(self) -> Plan:
        assert self.plan_json is not None
        return Plan.model_validate_json(self.plan_json)


#: The planner speaks the CLI's language; a DLRMJob's user edits the spec instead.
_CLI_TO_SPEC = (
    ("(--gpu-memory)", "(spec.planner.gpuMemory)"),
    ("(--gpus)", "(spec.workers.max × spec.gpusPerWorker, on nodes that have them)"),
    ("(--batch-per-rank)", "(spec.planner.batchSizePerRank)"),
    ("--gpu-memory", "spec.planner.gpuMemory"),
    ("--gpus", "spec.workers.max"),
    ("--batch-per-rank", "spec.planner.batchSizePerRank"),
)


def in_spec_terms(message: str) -> str:
    """A planner error with its CLI flags replaced by the DLRMJob fields to change."""
    for flag, field in _CLI_TO_SPEC:
        message = message.replace(flag, field)
    return message


def make_request(
    inputs: PlanInputs, tables: list[TableSpec], model: tuple[bytes, str] | None
) -> PlanRequest:
    return PlanRequest(
        tables_json=json.dumps([t.model_dump(mode="json") for t in tables]),
        topology_json=inputs.topology().model_dump_json(),
        planner=inputs.planner,
        seed=inputs.seed,
        model_bytes=model[0] if model else None,
        model_sha256=model[1] if model else None,
    )


# --------------------------------------------------------------------------- worker side

_PREDICTORS: dict[str, tuple[CostPredictor, str]] = {}


def _predictor(model_bytes: bytes | None, sha: str | None) -> tuple[CostPredictor, str]:
    """A cached predictor for the model (the bundled one when ``model_bytes`` is None)."""
    from shardwise.planner.costmodel import CostModel, CostPredictor, load_bundled
    from shardwise.profiler.fingerprint import Fingerprint

    key = sha or "bundled"
    if key not in _PREDICTORS:
        if model_bytes is None:
            model = load_bundled()
        else:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "model.pt"
                path.write_bytes(model_bytes)
                model = CostModel.load(path)
        fingerprint = Fingerprint.from_dict(model.fingerprint).key() if model.fingerprint else ""
        while len(_PREDICTORS) >= 4:
            _PREDICTORS.pop(next(iter(_PREDICTORS)))
        _PREDICTORS[key] = (CostPredictor(model), fingerprint)
    return _PREDICTORS[key]


def compute_plan(request: PlanRequest) -> PlanResult:
    """Plan, validate and price; a :class:`UserError` (infeasible, bad model) becomes
    ``error`` so the operator can show it. Runs in the planner process."""
    from shardwise.planner.base import PlannerOptions, run_planner
    from shardwise.planner.comm.choice import planning_comm
    from shardwise.planner.registry import get_planner

    start = time.perf_counter()
    fingerprint = ""
    try:
        tables = [TableSpec.model_validate(t) for t in json.loads(request.tables_json)]
        topology = Topology.model_validate_json(request.topology_json)
        predictor, fingerprint = _predictor(request.model_bytes, request.model_sha256)
        # The planner process never measures all-to-alls: `auto` declares the preset
        # for the job's size (docs/comm.md), the same for the search and the price.
        predictor.comm_model = planning_comm(predictor, topology)
        options = PlannerOptions(seed=request.seed, predictor=predictor)
        planner = get_planner(request.planner, options)
        plan = run_planner(planner, tables, topology, predictor).plan
    except UserError as err:
        return PlanResult(None, in_spec_terms(str(err)), fingerprint, time.perf_counter() - start)
    return PlanResult(plan.model_dump_json(), None, fingerprint, time.perf_counter() - start)


@dataclass(frozen=True)
class LivePlanRequest:
    """Re-plan a running plan from its workers' live costs (plain, picklable data)."""

    plan_json: str
    tables_json: str
    topology_json: str
    live_json: str
    #: Measured ranks of plans the job ran before (JSON list of ``RankPoint``): evidence.
    history_json: str = "[]"
    #: The job's calibrated model (bytes, sha256), for its rank head; None: none.
    model: tuple[bytes, str] | None = None


@dataclass(frozen=True)
class LivePlanResult:
    """The re-plan, or why there is none; ``live``: what status and Events quote."""

    plan_json: str | None
    error: str | None
    seconds: float
    live: Mapping[str, Any]

    def plan(self) -> Plan:
        assert self.plan_json is not None
        return Plan.model_validate_json(self.plan_json)


def compute_live_plan(request: LivePlanRequest) -> LivePlanResult:
    """``planner.live.replan`` in the planner process: measurements, and the job's cost
    model: the calibrated one when the job has one (its rank head, and its prices for
    what a table's row ranges cost against it whole), else the bundled one's prices. A
    calibrated model that cannot be read is left out, and the result says so; the
    re-plan then goes on with the bundled model."""
    from shardwise.planner.live.replan import replan
    from shardwise.planner.live.summary import LiveSummary, RankPoint, imbalance

    start = time.perf_counter()
    predictor, head_note = None, ""
    if request.model is not None:
        try:
            predictor = _predictor(*request.model)[0]
        except Exception as err:  # the re-plan goes on with the bundled model
            head_note = f"the calibrated model could not be read ({err})"
    if predictor is None:
        try:
            predictor = _predictor(None, None)[0]
        except Exception as err:  # from the measurements alone: no kind changes
            head_note += f"{'; ' if head_note else ''}no cost model for row ranges ({err})"
    head = predictor.rank_head if predictor is not None else None
    try:
        plan = Plan.model_validate_json(request.plan_json)
        tables = [TableSpec.model_validate(t) for t in json.loads(request.tables_json)]
        topology = Topology.model_validate_json(request.topology_json)
        live = LiveSummary.model_validate_json(request.live_json)
        history = [RankPoint.model_validate(p) for p in json.loads(request.history_json)]
        out = replan(plan, tables, topology, live, history=history, head=head, predictor=predictor)
    except UserError as err:
        return LivePlanResult(None, str(err), time.perf_counter() - start, {})
    fit = out.fit
    info = {
        "fromMaxMs": round(out.current_max_ms, 4),
        "predictedMaxMs": round(out.predicted_max_ms, 4),
        "gain": round(out.gain, 4),
        "riskMaxMs": round(out.risk_max_ms, 4),
        "riskGain": round(out.risk_gain, 4),
        "uncertainty": round(out.uncertainty, 4),
        "fromImbalance": round(imbalance(out.current_rank_ms) or 1.0, 4),
        "predictedImbalance": round(imbalance(out.predicted_rank_ms) or 1.0, 4),
        "pricedRankMs": [round(x, 4) for x in out.priced_rank_ms],
        "predictedRankMs": [round(x, 4) for x in out.predicted_rank_ms],
        "moves": len(out.moves),
        "movedBytes": out.moved_bytes,
        "describe": out.describe(),
        "fit": fit.describe() + (f"; {head_note}" if head_note else ""),
        "checked": fit.checked,
        "overheadMs": round(fit.best.overhead, 4),
        "shareMs": round(fit.best.share, 4),
        "factor": round(fit.best.factor, 4),
        "evidence": fit.points + fit.history,
        "step": live.step,
    }
    plan_json = out.plan.model_dump_json() if out.changed else None
    return LivePlanResult(plan_json, None, time.perf_counter() - start, info)


def warm_up() -> None:
    """Process-pool initializer: import the planner stack and load the bundled model."""
    _predictor(None, None)
    from shardwise.planner import neuroshard  # noqa: F401


# --------------------------------------------------------------------------- operator side


def exit_with_parent(parent: int, every: float = PARENT_CHECK_SECONDS) -> threading.Thread:
    """Exit this process as soon as ``parent`` is no longer its parent.

    A planner process outlives an operator killed with SIGKILL (or out of memory): it is
    re-parented and would finish a plan nobody reads, holding hundreds of MB, while the
    restarted operator plans the same job again. Linux's parent-death signal is no
    answer here: it fires when the *thread* that started the child exits, and the pool
    starts its processes from whichever thread submits. So a daemon thread checks
    ``getppid()``, which changes the moment the parent is gone; it needs the GIL for a
    moment every ``every`` seconds, which the planner's numpy and torch calls release.
    Once the pool's processes are gone, multiprocessing's ``resource_tracker`` reads
    the end of its pipe and exits too.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(PARENT_GONE_EXIT)

    thread = threading.Thread(target=watch, name="shardwise-parent-watch", daemon=True)
    thread.start()
    return thread


def _start_planner(parent: int, warm: bool) -> None:
    """Process-pool initializer: die with the operator, then warm up when asked.

    The search runs on one torch thread: its inference is small batches, where intra-op
    threads only spin beside the operator and the other planner processes."""
    exit_with_parent(parent)
    import torch

    torch.set_num_threads(1)
    if warm:
        warm_up()


def process_pool(workers: int = 1, warm: bool = True) -> concurrent.futures.ProcessPoolExecutor:
    """``spawn`` processes: no fork of a multi-threaded operator, no torch in the operator.
    Each exits when the operator that started it dies (:func:`exit_with_parent`)."""
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_planner,
        initargs=(os.getpid(), warm),
    )


class PlanExecutor:
    """Runs :func:`compute_plan` on an executor without blocking the event loop.

    An owned process pool that broke (a worker killed, e.g. out of memory) is replaced,
    and the request fails with a retryable error rather than poisoning every later one.
    """

    def __init__(
        self, executor: concurrent.futures.Executor | None = None, workers: int = 1
    ) -> None:
        self._owned = executor is None
        self._workers = workers
        self._executor = executor if executor is not None else process_pool(workers)

    async def run(self, request: PlanRequest) -> PlanResult:
        return await self._call(compute_plan, request)

    async def run_live(self, request: LivePlanRequest) -> LivePlanResult:
        return await self._call(compute_live_plan, request)

    async def _call(self, fn: Callable[[Any], T], request: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, request)
        except BrokenProcessPool:
            if self._owned:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = process_pool(self._workers)
            raise

    def shutdown(self) -> None:
        if self._owned:
            self._executor.shutdown(wait=False, cancel_futures=True)


def plan_summary(
    plan: Plan,
    inputs: PlanInputs,
    result: PlanResult,
    model: Mapping[str, Any],
    *,
    kind: str = "ModelOnly",
    why: str = "",
    refinement: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the plan ConfigMap's annotation records (and status shows): ``kind``
    ``Refined`` with what the profiling pod measured (``refinement``), or ``ModelOnly``
    with ``why`` no refined plan was used (``operator.refined_plans``); the tables per
    sharding kind when not all are table-wise (``operator.models.plan_kinds``)."""
    predicted = plan.predicted
    extra: dict[str, Any] = {"kind": kind}
    if why:
        extra["why"] = why
    if refinement is not None:
        extra["refinement"] = dict(refinement)
    return {
        **extra,
        "hash": plan.hash,
        "planner": plan.planner,
        "tables": len(plan.tables),
        "worldSize": plan.world_size,
        "workers": inputs.workers,
        "gpuType": inputs.gpu_type,
        "predictedMaxSeconds": predicted.max_seconds if predicted else None,
        "imbalance": predicted.imbalance if predicted else None,
        "planningSeconds": round(result.seconds, 3),
        "model": {**model, "fingerprint": result.fingerprint or model.get("fingerprint", "")},
        **kind_fields(plan),
    }
