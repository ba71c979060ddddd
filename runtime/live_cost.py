"""Live embedding cost per rank, measured during training and exported to Prometheus.

What is measured (docs/design.md §6's four parts, per iteration, per rank), on sampled steps
only (every ``every``-th step after the run's first ``skip``, counted from the step it
started or resumed at: a resumed run warms up too; the hooks return at once on
other steps). Hooks sit on TorchRec's ``ShardedEmbeddingBagCollection`` and on the
FBGEMM kernels it runs; the model's code is untouched:

- ``fwd_compute``: the embedding kernels' forward (forward pre/post hooks on each
  ``SplitTableBatchedEmbeddingBagsCodegen``, the fused kernel of every sharded kind,
  and each ``DenseTableBatchedEmbeddingBagsCodegen``, a data-parallel table's), summed;
- ``bwd_compute``: the same kernels' backward, which includes the fused optimizer
  update (pre/post hooks on the kernel's autograd node; a data-parallel table's
  update is the dense optimizer's, after the step, and not counted);
- ``fwd_comm``: from the first kernel's start until the pooled embeddings are back
  (a callback on TorchRec's output awaitable, run when the model waits on it), less
  ``fwd_compute``: the output all-to-all, including the wait for the slowest rank,
  which is how the evaluator and the cost model count it;
- ``bwd_comm``: from the gradient reaching the collection's output (a tensor hook)
  until the last kernel's backward ends, less ``bwd_compute``: the gradient
  all-to-all and its wait.
- ``input_dist`` (not part of docs/design.md §6's cost, exported beside it): from the
  collection's forward start to the first kernel, i.e. the all-to-all of the sparse
  indices (the KJT) and TorchRec's bucketing.

"Comm" is therefore the time the rank spends in the embedding stage not computing:
what overlap and stragglers actually cost, not the wire time of a collective alone.
On CPU the clock is ``time.perf_counter`` (the kernels are synchronous); on GPU each
mark is a CUDA event, read after one ``torch.cuda.synchronize()`` at the end of a
sampled step. Each gauge is the median of the last ``window`` samples (single steps
spike on shared machines, docs/design.md §6).

Metrics (labels ``namespace``, ``job``, ``rank``; the first also ``phase``):
``shardwise_embedding_cost_seconds`` (phases above and ``total`` = the four parts),
``shardwise_embedding_cost_samples_total``, ``shardwise_worker_steps_total``,
``shardwise_worker_step_seconds`` (median wall time of recent steps),
``shardwise_worker_loss`` and ``shardwise_worker_info`` (=1, with ``plan_hash``,
``planner``, ``world_size``, ``device``, ``batch_size``). Each rank serves its own
registry on ``SHARDWISE_METRICS_PORT`` + local rank (0: off).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shardwise.basics import UserError

#: Design §6's parts of a rank's embedding cost, in the evaluator's order.
PHASES = ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm")
#: Exported beside them: the index all-to-all, which the design's cost leaves out.
INPUT_PHASE = "input_dist"
TOTAL_PHASE = "total"
LABELS = ("namespace", "job", "rank")
#: Steps of a run (or of a resumed run) left unsampled: the allocator, the caches and
#: the first collectives warm up. Counted from the global step instead, a run resumed at
#: step 500 sampled its step 504, and the closed loop judged a reshard on warm-up steps.
WARMUP_STEPS = 10


@dataclass(frozen=True)
class CostSample:
    """One sampled step's embedding cost on this rank, in seconds."""

    fwd_compute: float
    bwd_compute: float
    fwd_comm: float
    bwd_comm: float
    input_dist: float

    @property
    def total(self) -> float:
        return self.fwd_compute + self.bwd_compute + self.fwd_comm + self.bwd_comm

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), TOTAL_PHASE: self.total}


@dataclass
class Marks:
    """Clock stamps of one step, as the hooks record them (floats or CUDA events)."""

    fwd_start: Any = None
    fwd_end: Any = None
    bwd_start: Any = None
    fwd_kernels: list[tuple[Any, Any]] = field(default_factory=list)
    bwd_kernels: list[tuple[Any, Any]] = field(default_factory=list)


def phases_from_marks(marks: Marks, seconds: Callable[[Any, Any], float]) -> CostSample | None:
    """The step's cost from its marks (``seconds(a, b)``: time from a to b), or None when
    a mark is missing (a rank holding no shard has no kernel to time)."""
    if (
        marks.fwd_start is None
        or marks.fwd_end is None
        or marks.bwd_start is None
        or not marks.fwd_kernels
        or not marks.bwd_kernels
    ):
        return None
    fwd_compute = sum(seconds(a, b) for a, b in marks.fwd_kernels)
    bwd_compute = sum(seconds(a, b) for a, b in marks.bwd_kernels)
    first_kernel = marks.fwd_kernels[0][0]
    fwd_span = seconds(first_kernel, marks.fwd_end)
    bwd_span = seconds(marks.bwd_start, marks.bwd_kernels[-1][1])
    return CostSample(
        fwd_compute=fwd_compute,
        bwd_compute=bwd_compute,
        fwd_comm=max(0.0, fwd_span - fwd_compute),
        bwd_comm=max(0.0, bwd_span - bwd_compute),
        input_dist=max(0.0, seconds(marks.fwd_start, first_kernel)),
    )


class _CpuClock:
    def stamp(self) -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(a: float, b: float) -> float:
        return b - a

    def sync(self) -> None:
        pass


class _CudaClock:
    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3

    def sync(self) -> None:
        torch.cuda.synchronize()


Clock = _CpuClock | _CudaClock


def make_clock(cuda: bool) -> Clock:
    """The step clock: ``perf_counter`` on CPU, CUDA events read after one synchronize
    on GPU (the per-shard probe times its calls the same way)."""
    return _CudaClock() if cuda else _CpuClock()


class EmbeddingTimer:
    """Per-phase timing of a ``ShardedEmbeddingBagCollection`` on sampled steps.

    Usage per step: ``timer.start_step(step)`` before the forward, ``sample =
    timer.finish_step()`` after ``backward()``. Hooks stay installed (``close()``
    removes them) and cost one attribute check per call on steps not sampled.
    """

    def __init__(
        self,
        sharded_collection: Any,
        *,
        every: int = 10,
        skip: int = WARMUP_STEPS,
        start: int = 0,
        cuda: bool = False,
    ) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            DenseTableBatchedEmbeddingBagsCodegen,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        kinds = (SplitTableBatchedEmbeddingBagsCodegen, DenseTableBatchedEmbeddingBagsCodegen)
        self.every = every
        self.skip = skip
        self.start = start
        self._clock = make_clock(cuda)
        self._active = False
        self._marks = Marks()
        # TorchRec keeps the lookups in a plain list, so they are not submodules.
        lookups = list(getattr(sharded_collection, "_lookups", []))
        self.kernels = [m for lookup in lookups for m in lookup.modules() if isinstance(m, kinds)]
        self._handles = [
            sharded_collection.register_forward_pre_hook(self._on_forward_start),
            sharded_collection.register_forward_hook(self._on_forward_output),
        ]
        for kernel in self.kernels:
            self._handles.append(kernel.register_forward_pre_hook(self._on_kernel_start))
            self._handles.append(kernel.register_forward_hook(self._on_kernel_end))
        self._kernel_start: Any = None

    def sampled(self, step: int) -> bool:
        return self.every > 0 and step > self.start + self.skip and step % self.every == 0

    def start_step(self, step: int) -> None:
        self._active = self.sampled(step)
        self._marks = Marks()

    def finish_step(self) -> CostSample | None:
        if not self._active:
            return None
        self._active = False
        self._clock.sync()
        return phases_from_marks(self._marks, self._clock.seconds)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    def _on_forward_start(self, module: Any, args: Any) -> None:
        if self._active:
            self._marks.fwd_start = self._clock.stamp()

    def _on_forward_output(self, module: Any, args: Any, output: Any) -> None:
        if not self._active:
            return
        callbacks = getattr(output, "callbacks", None)
        if isinstance(callbacks, list):  # a LazyAwaitable: the a2a ends when it is waited on
            callbacks.append(self._on_output_ready)
        else:
            self._on_output_ready(output)

    def _on_output_ready(self, result: Any) -> Any:
        if self._active:
            self._marks.fwd_end = self._clock.stamp()
            values = result.values() if hasattr(result, "values") else result
            if isinstance(values, torch.Tensor) and values.requires_grad:
                values.register_hook(self._on_backward_start)  # type: ignore[no-untyped-call]
        return result

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if self._active and self._marks.bwd_start is None:
            self._marks.bwd_start = self._clock.stamp()

    def _on_kernel_start(self, module: Any, args: Any) -> None:
        if self._active:
            self._kernel_start = self._clock.stamp()

    def _on_kernel_end(self, module: Any, args: Any, output: Any) -> None:
        if not self._active:
            return
        self._marks.fwd_kernels.append((self._kernel_start, self._clock.stamp()))
        node = getattr(output, "grad_fn", None)
        if node is None:
            return
        started: list[Any] = []

        def before(grad_outputs: Any) -> None:
            if self._active:
                started.append(self._clock.stamp())

        def after(grad_inputs: Any, grad_outputs: Any) -> None:
            if self._active and started:
                self._marks.bwd_kernels.append((started[0], self._clock.stamp()))

        node.register_prehook(before)
        node.register_hook(after)


class WorkerMetrics:
    """This rank's Prometheus metrics, in a registry of its own (tests scrape it)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        namespace: str,
        job: str,
        rank: int,
        window: int = 20,
    ) -> None:
        self.registry = registry
        self._labels = {"namespace": namespace, "job": job, "rank": str(rank)}
        self.cost = Gauge(
            "shardwise_embedding_cost_seconds",
            "Measured embedding cost per iteration on this rank, by phase (median of the "
            "recent sampled steps; total = fwd/bwd compute + fwd/bwd comm).",
            [*LABELS, "phase"],
            registry=registry,
        )
        self.samples = Counter(
            "shardwise_embedding_cost_samples",
            "Steps whose embedding cost was sampled on this rank.",
            LABELS,
            registry=registry,
        )
        self.steps = Counter(
            "shardwise_worker_steps", "Training steps done by this rank.", LABELS, registry=registry
        )
        self.step_seconds = Gauge(
            "shardwise_worker_step_seconds",
            "Median wall time of this rank's recent training steps.",
            LABELS,
            registry=registry,
        )
        self.loss = Gauge(
            "shardwise_worker_loss", "This rank's loss at its last step.", LABELS, registry=registry
        )
        self.info = Gauge(
            "shardwise_worker_info",
            "The plan and setting this rank trains with (value 1).",
            [*LABELS, "plan_hash", "planner", "world_size", "device", "batch_size"],
            registry=registry,
        )
        self._window = window
        self._recent: dict[str, deque[float]] = {}
        self._step_times: deque[float] = deque(maxlen=window)

    def set_info(
        self, *, plan_hash: str, planner: str, world_size: int, device: str, batch_size: int
    ) -> None:
        self.info.labels(
            **self._labels,
            plan_hash=plan_hash,
            planner=planner,
            world_size=str(world_size),
            device=device,
            batch_size=str(batch_size),
        ).set(1)

    def observe_step(self, seconds: float, loss: float | None = None) -> None:
        self.steps.labels(**self._labels).inc()
        self._step_times.append(seconds)
        self.step_seconds.labels(**self._labels).set(statistics.median(self._step_times))
        if loss is not None:
            self.loss.labels(**self._labels).set(loss)

    def observe_cost(self, sample: CostSample) -> None:
        self.samples.labels(**self._labels).inc()
        for phase, value in sample.as_dict().items():
            recent = self._recent.setdefault(phase, deque(maxlen=self._window))
            recent.append(value)
            self.cost.labels(**self._labels, phase=phase).set(statistics.median(recent))

    def medians(self) -> dict[str, float]:
        """The exported per-phase medians (for logs and summaries)."""
        return {phase: statistics.median(v) for phase, v in self._recent.items() if v}

    def window_samples(self) -> int:
        """Sampled steps behind :meth:`medians` (at most the window)."""
        return len(self._recent.get("fwd_compute", ()))

    def step_median(self) -> float:
        """Median wall time of the recent steps in seconds (0.0 before the first)."""
        return statistics.median(self._step_times) if self._step_times else 0.0

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``port`` in a daemon thread (0: do nothing)."""
        if port <= 0:
            return None
        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:
            raise UserError(
                f"cannot serve metrics on port {port} ({err}); set SHARDWISE_METRICS_PORT to "
                "a free port (each local rank uses the port + its local rank) or 0 to turn "
                "the endpoint off."
            ) from None
        return server
