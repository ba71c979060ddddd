"""The communication benchmark: a real all-to-all of embedding outputs (docs/design.md §6).

TorchRec's table-wise and column-wise sharding ends the embedding forward with an
all-to-all: rank ``r`` has pooled ``dims[r]`` columns (the sum of its shards' widths)
for the *global* batch and sends each rank ``j`` the rows of ``j``'s slice of the
batch, ``batch × dims[r]`` values; it receives ``batch × dims[j]`` from every ``j``.
The backward sends the gradients the other way (the same sizes, transposed).

We time that exchange with ``torch.distributed`` across W local processes (nccl when
each rank can have its own GPU, gloo otherwise; the same code path either way) so
the cost models learn from measurements, never from a bandwidth formula.

Per-rank *start delays* stand in for the compute imbalance in front of the forward
all-to-all: after a barrier, rank ``r`` sleeps ``delays[r]`` seconds (its modelled
forward compute) and only then enters the collective. Each rank's forward time runs
from its own arrival at the collective to the end of it, so an early rank's forward
includes its wait for the straggler, as docs/design.md §6 asks, and no rank counts its own
delay, which is compute, not communication. Then ``delay[r] + fwd[r]`` is about the
same for every rank (the slowest start plus the transfer), so the design's cost
``max_r(compute + comm)`` counts the straggler once. NeuroShard's benchmark does the
same (it subtracts each rank's own sleep). The backward is timed separately, without
delays.

Processes and isolation:

- workers are fresh interpreters (``subprocess``), so the allocator variables of
  docs/design.md §6 are in their environment before glibc starts, and nothing of the
  caller's state (threads, CUDA context) leaks into them;
- the caller hosts the rendezvous ``TCPStore`` on ``127.0.0.1`` with a port the OS
  picks, so there is no race for a free port and nothing listens beyond loopback;
- gloo and NCCL are told to use the loopback interface;
- a worker that fails, a timeout or a Ctrl-C kills every worker and waits for it,
  so no process outlives the call; a worker's failure is raised as a
  :class:`CommError` carrying the tail of its stderr.

Besides the all-to-all, a case may time the other kinds' collectives
(:mod:`shardwise.planner.comm.collectives`), each as TorchRec's calls run it: a
row-wise output's ``reduce_scatter_tensor`` (forward) and ``all_gather_into_tensor``
(its backward) of ``[W·B, D]`` fp32 a rank, and a data-parallel gradient
``all_reduce``. They run after the all-to-alls of the case, without delays. Pre-training
fits them one α–β line per world size, which the cost model keeps
(:mod:`shardwise.planner.comm.learned`); ``--comm fitted:DIR`` fits them too.

On a CPU-only machine the figures are CPU figures: W processes share the host's
cores (W = 8 on 2 cores is 4× oversubscribed), so they measure memory copies and
scheduling through loopback gloo, not NVLink or InfiniBand. Results record the
backend so nobody mistakes one for the other.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shardwise.basics import UserError
from shardwise.profiler import allocator
from shardwise.profiler.allocator import allocator_env

if TYPE_CHECKING:
    from shardwise.planner.plan import Plan

Dtype = Literal["fp32", "fp16"]
Backend = Literal["auto", "gloo", "nccl"]

#: Rendezvous host: loopback only, the benchmark never listens on a real interface.
HOST = "127.0.0.1"
#: Warm-ups and timed repeats per case. Gloo on a 2-core host shows 5-20 % CV per
#: rank, so the median of 10 is what docs/design.md §6 asks for and what keeps it stable.
DEFAULT_WARMUPS = 3
DEFAULT_ITERS = 10
#: Seconds a whole launch may take before every worker is killed.
DEFAULT_TIMEOUT_S = 300.0
#: How many bytes of a failed worker's stderr the exception quotes.
_STDERR_TAIL = 4000


class CommError(RuntimeError):
    """A benchmark worker failed or the launch timed out (the workers are gone)."""


@dataclass(frozen=True)
class CommCase:
    """One all-to-all to time: each rank's output width and its start delay; and the
    widths ``D`` of reduce-scatters (each ``[W·B, D]`` fp32 a rank, with its
    all-gather) and the fp32 element counts of all-reduces to time after it."""

    dims: list[int]
    delays: list[float]
    reduce_scatter: list[int] = field(default_factory=list)
    all_reduce: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CollectiveResult:
    """One collective of a case: ``reduce_scatter`` (``fwd_s``; its all-gather in
    ``bwd_s``) or ``all_reduce`` (``bwd_s``; ``fwd_s`` zero), per-rank medians, and its
    size in bytes (a reduce-scatter's input a rank, an all-reduce's buffer)."""

    name: str
    bytes: int
    fwd_s: list[float]
    bwd_s: list[float]


@dataclass(frozen=True)
class CommResult:
    """Per-rank medians (seconds) and coefficients of variation for one case.

    ``fwd_s[r]`` runs from rank ``r``'s arrival (after its own delay) to the end of
    the collective: the transfer plus its wait for a later starter. ``bwd_s[r]`` is
    the gradient all-to-all alone.
    """

    world_size: int
    batch_size: int
    dims: list[int]
    delays: list[float]
    fwd_s: list[float]
    bwd_s: list[float]
    fwd_cv: list[float]
    bwd_cv: list[float]
    backend: str
    dtype: str = "fp32"
    iters: int = DEFAULT_ITERS
    #: Whether glibc's mmap of large buffers was off in every worker (docs/design.md §6).
    allocator_active: bool = False
    #: The case's other collectives, reduce-scatters first (:class:`CollectiveResult`).
    collectives: list[CollectiveResult] = field(default_factory=list)

    @property
    def total_s(self) -> list[float]:
        """Forward plus backward per rank: the communication part of the design's cost."""
        return [f + b for f, b in zip(self.fwd_s, self.bwd_s, strict=True)]


@dataclass
class _Spec:
    """What every worker is told, written as JSON next to their result files."""

    world_size: int
    batch_size: int
    cases: list[CommCase]
    warmups: int
    iters: int
    dtype: Dtype
    backend: str
    port: int
    timeout_s: float
    out_dir: str
    #: Fault injection for the tests: this rank raises after joining the group.
    crash_rank: int | None = None


# ------------------------------------------------------------------ public helpers


def rank_dims(plan: Plan) -> list[int]:
    """Each rank's all-to-all width: the summed columns of its table-wise and
    column-wise shards (the other kinds have their own collectives)."""
    from shardwise.planner.comm.collectives import fused_dims

    return fused_dims(plan)


def measure_comm(
    dims: Sequence[int],
    batch_size: int,
    *,
    delays: Sequence[float] | None = None,
    warmups: int = DEFAULT_WARMUPS,
    iters: int = DEFAULT_ITERS,
    dtype: Dtype = "fp32",
    backend: Backend = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CommResult:
    """Time the forward and backward embedding all-to-all across ``len(dims)`` processes.

    ``batch_size`` is the per-rank batch (a topology's ``batch_size_per_rank``);
    ``delays`` are per-rank start delays in seconds (default: none).
    """
    world = len(dims)
    case = _check_case(dims, delays, world)
    return measure_comm_many(
        [case],
        batch_size,
        warmups=warmups,
        iters=iters,
        dtype=dtype,
        backend=backend,
        timeout_s=timeout_s,
    )[0]


def measure_comm_many(
    cases: Sequence[CommCase],
    batch_size: int,
    *,
    warmups: int = DEFAULT_WARMUPS,
    iters: int = DEFAULT_ITERS,
    dtype: Dtype = "fp32",
    backend: Backend = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    crash_rank: int | None = None,
) -> list[CommResult]:
    """Time several cases of one world size with a single launch of the workers.

    Starting W interpreters with torch costs seconds on a small host, far more than
    one case; a profiling run of many random cases should pay it once.
    ``crash_rank`` is fault injection for the tests (that rank raises after joining).
    """
    if not cases:
        raise UserError("measure_comm_many needs at least one case.")
    world = len(cases[0].dims)
    checked = [_check_collectives(_check_case(c.dims, c.delays, world), c) for c in cases]
    _check_int("batch_size", batch_size, 1)
    _check_int("warmups", warmups, 0)
    _check_int("iters", iters, 1)
    if dtype not in ("fp32", "fp16"):
        raise UserError(f"dtype must be 'fp32' or 'fp16', not {dtype!r}.")
    if not timeout_s > 0:
        raise UserError(f"timeout_s must be positive, got {timeout_s}.")
    chosen = _pick_backend(backend, world)

    import torch.distributed as dist

    # The caller hosts the rendezvous store: the OS picks a free loopback port and
    # keeps it bound for the whole launch, so no other process can take it.
    # (TCPStore is public API; torch's stubs just do not re-export it.)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, 0, is_master=True, wait_for_workers=False, timeout=_timedelta(timeout_s)
    )
    with tempfile.TemporaryDirectory(prefix="shardwise-comm-") as tmp:
        spec = _Spec(
            world_size=world,
            batch_size=batch_size,
            cases=checked,
            warmups=warmups,
            iters=iters,
            dtype=dtype,
            backend=chosen,
            port=store.port,
            timeout_s=float(timeout_s),
            out_dir=tmp,
            crash_rank=crash_rank,
        )
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)), encoding="utf-8")
        _launch(spec, spec_path, timeout_s)
        per_rank = [
            json.loads((Path(tmp) / f"rank{r}.json").read_text(encoding="utf-8"))
            for r in range(world)
        ]
    del store
    return [
        CommResult(
            world_size=world,
            batch_size=batch_size,
            dims=list(case.dims),
            delays=list(case.delays),
            fwd_s=[per_rank[r][i]["fwd_s"] for r in range(world)],
            bwd_s=[per_rank[r][i]["bwd_s"] for r in range(world)],
            fwd_cv=[per_rank[r][i]["fwd_cv"] for r in range(world)],
            bwd_cv=[per_rank[r][i]["bwd_cv"] for r in range(world)],
            backend=chosen,
            dtype=dtype,
            iters=iters,
            allocator_active=all(per_rank[r][i]["allocator_active"] for r in range(world)),
            collectives=[
                CollectiveResult(
                    name=c["name"],
                    bytes=c["bytes"],
                    fwd_s=[per_rank[r][i]["collectives"][k]["fwd_s"] for r in range(world)],
                    bwd_s=[per_rank[r][i]["collectives"][k]["bwd_s"] for r in range(world)],
                )
                for k, c in enumerate(per_rank[0][i]["collectives"])
            ],
        )
        for i, case in enumerate(checked)
    ]


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's whole environment: ``base`` (default: ours) with the allocator
    mitigation of docs/design.md §6, loopback-only sockets and one intra-op thread."""
    env = allocator_env(base)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
        # The all-to-all is a copy; intra-op threads would only fight over the cores.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    return env


# ------------------------------------------------------------------ validation


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{name} must be an integer ≥ {low}, got {value!r}.")


def _check_case(dims: Sequence[int], delays: Sequence[float] | None, world: int) -> CommCase:
    if len(dims) < 1:
        raise UserError("dims is empty: give one output width per rank (world size ≥ 1).")
    if len(dims) != world:
        raise UserError(f"every case needs {world} dims (one per rank), got {len(dims)}.")
    for r, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise UserError(f"dims[{r}] is {d!r}: a rank's output width is an integer ≥ 0.")
    if delays is None:
        delays = [0.0] * world
    if len(delays) != world:
        raise UserError(
            f"delays has {len(delays)} entries for {world} ranks: give one start delay "
            "(seconds) per rank."
        )
    for r, x in enumerate(delays):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= x < math.inf:
            raise UserError(f"delays[{r}] is {x!r}: a start delay is a finite number ≥ 0 s.")
    return CommCase(dims=[int(d) for d in dims], delays=[float(x) for x in delays])


def _check_collectives(case: CommCase, given: CommCase) -> CommCase:
    for what, sizes in (("reduce_scatter", given.reduce_scatter), ("all_reduce", given.all_reduce)):
        for k, n in enumerate(sizes):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
                raise UserError(f"{what}[{k}] is {n!r}: a collective's size is an integer ≥ 1.")
    return CommCase(
        case.dims,
        case.delays,
        [int(n) for n in given.reduce_scatter],
        [int(n) for n in given.all_reduce],
    )


def _pick_backend(backend: str, world: int) -> str:
    """nccl needs one GPU per rank; without that, gloo (the CPU path) is the honest one."""
    if backend not in ("auto", "gloo", "nccl"):
        raise UserError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}.")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < world:
        raise UserError(f"nccl needs one GPU per rank: {world} ranks but {gpus} GPU(s) here.")
    if backend == "auto":
        return "nccl" if gpus >= world else "gloo"
    return backend


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


# ------------------------------------------------------------------ launching

#: How workers are started; a seam the tests use to see every process.
_popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen


@contextmanager
def _workers(spec: _Spec, spec_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], Any]]]:
    """Start one interpreter per rank; on leaving, for any reason, none is left alive."""
    env = worker_env()
    started: list[tuple[subprocess.Popen[bytes], Any]] = []
    try:
        for rank in range(spec.world_size):
            err = open(Path(spec.out_dir) / f"rank{rank}.err", "w+b")  # noqa: SIM115
            cmd = [sys.executable, "-c", _WORKER_CMD, str(spec_path), str(rank)]
            started.append(
                (
                    _popen(
                        cmd,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                    ),
                    err,
                )
            )
        yield started
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
        for proc, err in started:
            proc.wait()
            err.close()


def _launch(spec: _Spec, spec_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with _workers(spec, spec_path) as procs:
        while True:
            codes = [p.poll() for p, _ in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Usually one rank fails and the others wait for it in a collective;
                # they are killed on the way out. Quote every rank already dead.
                raise CommError(
                    "\n".join(
                        f"comm benchmark worker rank {r} of {spec.world_size} exited with "
                        f"code {codes[r]}:\n{_tail(procs[r][1])}"
                        for r in failed
                    )
                )
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise CommError(
                    f"comm benchmark timed out after {timeout_s:g} s "
                    f"({spec.world_size} ranks, {len(spec.cases)} case(s)); workers killed."
                )
            time.sleep(0.05)


def _tail(err: Any) -> str:
    err.flush()
    err.seek(0)
    text: str = err.read().decode("utf-8", "replace")
    return text[-_STDERR_TAIL:].strip() or "(no stderr)"


# ------------------------------------------------------------------ the worker

_WORKER_CMD = (
    "import sys; from shardwise.profiler.comm import _worker_main; _worker_main(sys.argv[1:])"
)


def _cv(xs: Sequence[float]) -> float:
    mean = statistics.fmean(xs)
    return statistics.stdev(xs) / mean if len(xs) > 1 and mean > 0 else 0.0


def _worker_main(argv: Sequence[str]) -> None:
    """Entry point of one rank: join the group, time every case, write rank<r>.json."""
    spec_path, rank = Path(argv[0]), int(argv[1])
    raw = json.loads(spec_path.read_text(encoding="utf-8"))
    raw["cases"] = [CommCase(**c) for c in raw["cases"]]
    spec = _Spec(**raw)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if spec.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, spec.port, spec.world_size, is_master=False, timeout=_timedelta(spec.timeout_s)
    )
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=_timedelta(spec.timeout_s),
        device_id=device if spec.backend == "nccl" else None,
    )
    if spec.crash_rank == rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    # Checked where the timing happens, not assumed from the environment we passed.
    active = allocator.is_active()
    results = [
        {**_time_case(spec, case, rank, device), "allocator_active": active} for case in spec.cases
    ]
    out = Path(spec.out_dir) / f"rank{rank}.json"
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps(results), encoding="utf-8")
    tmp.replace(out)
    dist.barrier()
    dist.destroy_process_group()
    # Exit at once: interpreter teardown after gloo sometimes aborts here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _time_case(spec: _Spec, case: CommCase, rank: int, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    w, b = spec.world_size, spec.batch_size
    dtype = torch.float16 if spec.dtype == "fp16" else torch.float32
    mine = b * case.dims[rank]
    theirs = [b * d for d in case.dims]
    # Forward: my outputs for every rank's slice of the batch go out; every rank's
    # outputs for my slice come in. Backward: the same with the roles swapped.
    fwd_in = torch.randn(w * mine, dtype=dtype, device=device)
    fwd_out = torch.empty(sum(theirs), dtype=dtype, device=device)
    bwd_in = torch.randn(sum(theirs), dtype=dtype, device=device)
    bwd_out = torch.empty(w * mine, dtype=dtype, device=device)
    on_gpu = device.type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    delay = case.delays[rank]

    def step() -> tuple[float, float]:
        dist.barrier()
        sync()
        if delay > 0:
            # The modelled compute of this rank. Sleeping, not spinning: on a small
            # host a spinning straggler would steal the core the others need.
            time.sleep(delay)
        t0 = time.perf_counter()  # this rank arrives at the all-to-all
        dist.all_to_all_single(
            fwd_out, fwd_in, output_split_sizes=theirs, input_split_sizes=[mine] * w
        )
        sync()
        t1 = time.perf_counter()
        dist.barrier()
        sync()
        t2 = time.perf_counter()
        dist.all_to_all_single(
            bwd_out, bwd_in, output_split_sizes=[mine] * w, input_split_sizes=theirs
        )
        sync()
        return t1 - t0, time.perf_counter() - t2

    for _ in range(spec.warmups):
        step()
    fwd, bwd = zip(*(step() for _ in range(spec.iters)), strict=True)
    collectives = [
        _time_reduce_scatter(spec, width, device, dtype, sync) for width in case.reduce_scatter
    ] + [_time_all_reduce(spec, n, device, sync) for n in case.all_reduce]
    return {
        "fwd_s": statistics.median(fwd),
        "bwd_s": statistics.median(bwd),
        "fwd_cv": _cv(fwd),
        "bwd_cv": _cv(bwd),
        "collectives": collectives,
    }


def _time_reduce_scatter(
    spec: _Spec, width: int, device: Any, dtype: Any, sync: Callable[[], None]
) -> dict[str, Any]:
    """A row-wise output's reduce-scatter of ``[W·B, width]`` to ``[B, width]`` a rank,
    then the all-gather of its gradient (TorchRec's ``ReduceScatterBase_Req``)."""
    import torch
    import torch.distributed as dist

    w, b = spec.world_size, spec.batch_size
    full = torch.randn(w * b * width, dtype=dtype, device=device)
    mine = torch.empty(b * width, dtype=dtype, device=device)

    def step() -> tuple[float, float]:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(mine, full)
        sync()
        t1 = time.perf_counter()
        dist.barrier()
        sync()
        t2 = time.perf_counter()
        dist.all_gather_into_tensor(full, mine)
        sync()
        return t1 - t0, time.perf_counter() - t2

    for _ in range(spec.warmups):
        step()
    fwd, bwd = zip(*(step() for _ in range(spec.iters)), strict=True)
    return {
        "name": "reduce_scatter",
        "bytes": full.numel() * full.element_size(),
        "fwd_s": statistics.median(fwd),
        "bwd_s": statistics.median(bwd),
    }


def _time_all_reduce(
    spec: _Spec, elements: int, device: Any, sync: Callable[[], None]
) -> dict[str, Any]:
    """A data-parallel gradient all-reduce of ``elements`` fp32 values (backward)."""
    import torch
    import torch.distributed as dist

    grads = torch.randn(elements, dtype=torch.float32, device=device)

    def step() -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        sync()
        return time.perf_counter() - t0

    for _ in range(spec.warmups):
        step()
    times = [step() for _ in range(spec.iters)]
    return {
        "name": "all_reduce",
        "bytes": elements * 4,
        "fwd_s": 0.0,
        "bwd_s": statistics.median(times),
    }
