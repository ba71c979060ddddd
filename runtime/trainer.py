"""Train a model of your own, sharded by the plan Shardwise injected.

The runtime's side of a worker: every rank reads the same ``plan.json``
(``SHARDWISE_PLAN`` or :attr:`TrainOptions.plan`) and checks it against the tables and
the world size before anything collective (a mismatch stops every rank with the same
message, status 2); it builds TorchRec's ``DistributedModelParallel`` from the plan,
resumes from the latest checkpoint (any world size, any plan for the same tables),
checkpoints every :attr:`TrainOptions.checkpoint_every` steps, stops at a step
boundary agreed with every peer on SIGTERM (checkpoint, status 0), exports its
measured embedding cost to Prometheus and, when the operator names a live ConfigMap,
reports every rank's cost and its shards' probed costs there through rank 0
(:mod:`.live_report`). The caller brings the model and the data::

    from shardwise.runtime.stop import GracefulStop
    STOP = GracefulStop().install()          # first, before torch is imported

    from shardwise.runtime.trainer import TrainOptions, run

    def model(worker, embedding_device, dense_device):   # EBC at options.module_path
        return MyModel(worker.tables, embedding_device, dense_device)

    def data(worker):                         # step -> (dense, KJT, labels) of this rank
        return lambda step: my_batch(step, worker.env.rank, worker.batch_size)

    run(load_tables("tables.yaml"), model, data, TrainOptions(steps=1000,
        checkpoint_dir=Path("/ckpt")), stop=STOP)

Run it with ``torchrun`` (in a pod: ``python -m shardwise.runtime.launch``), one
process per GPU or CPU rank; without torchrun it trains as a single rank.
``python -m shardwise.runtime.train`` is the same with TorchRec's DLRM on synthetic
data (:mod:`.dlrm`), the worker image's default entry.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec, load_tables
from shardwise.runtime import checkpoint as ckpt
from shardwise.runtime.env import Timeouts, WorkerEnv
from shardwise.runtime.live_cost import EmbeddingTimer, WorkerMetrics
from shardwise.runtime.live_report import RunFacts, live_reporter
from shardwise.runtime.options import (
    Batch,
    Batches,
    DataFactory,
    Loss,
    ModelFactory,
    Tables,
    TrainOptions,
    Worker,
)
from shardwise.runtime.plancheck import load_worker_plan
from shardwise.runtime.sharding import (
    backend_for,
    dense_optimizer,
    shard_model,
    sharded_collection,
    worker_device,
)
from shardwise.runtime.stop import (
    PEER_STOP_EXIT,
    GracefulStop,
    clear_markers,
    write_stop_marker,
)
from shardwise.runtime.weights import (
    gather_fused_optimizer_state,
    gather_state_dict,
    load_full_state_dict,
)

__all__ = [  # the trainer API: the loop here, and the caller's types from .options
    "Batch",
    "Batches",
    "DataFactory",
    "Loss",
    "ModelFactory",
    "Tables",
    "TrainOptions",
    "Worker",
    "agree_on_plan",
    "run",
    "say",
    "train",
]

# TorchRec 1.8 hands out a sharded EmbeddingBagCollection's tables as ShardedTensors,
# which torch marks deprecated on every access; the warning is not ours to act on.
warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
# A data-parallel table's backward on CPU goes through FBGEMM's dense lookup, which has
# no autograd kernel registered; torch warns that gradients may be wrong, but they are
# right (tests/test_runtime_kinds.py trains one against an unsharded model).
warnings.filterwarnings(
    "ignore", "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel", UserWarning
)


def say(env: WorkerEnv, message: str, *, err: bool = False) -> None:
    """Print a line tagged with the rank (``[rank r/n]``)."""
    print(f"{env.tag} {message}", file=sys.stderr if err else sys.stdout, flush=True)


def run(
    tables: Tables,
    model: ModelFactory,
    data: DataFactory,
    options: TrainOptions | None = None,
    *,
    stop: GracefulStop | None = None,
    loss: Loss | None = None,
) -> NoReturn:
    """:func:`train`, then end the process with its status. A plain interpreter exit
    sometimes aborts in gloo/fbgemm teardown, so it leaves through ``os._exit``."""
    code = train(tables, model, data, options, stop=stop, loss=loss)
    os._exit(code)


def train(
    tables: Tables,
    model: ModelFactory,
    data: DataFactory,
    options: TrainOptions | None = None,
    *,
    stop: GracefulStop | None = None,
    loss: Loss | None = None,
) -> int:
    """Train on every rank; returns the exit status: 0 (done, or stopped by a signal
    after a checkpoint), 2 (a :class:`UserError`, e.g. a plan that does not fit: every
    rank alike), :data:`~.stop.PEER_STOP_EXIT` (elastic, and only a peer was signalled:
    torchrun restarts the rank into the new world) or 1 (anything else, with its
    traceback).

    ``stop``: the handler the script installed first thing (one is installed here if
    not, which leaves a rank that a failing peer's torchrun terminates during start-up
    without its own message). ``loss``: ``(logits, labels) -> loss``, default
    ``BCEWithLogitsLoss``. The default process group stays initialised after a failure
    (the peers may be gone): end the process with ``os._exit`` (:func:`run` does)."""
    options = options or TrainOptions()
    if stop is None:
        stop = GracefulStop().install()
    try:
        env = WorkerEnv.from_environ()
        timeouts = Timeouts.from_environ()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        specs = _read_tables(tables)
        # Before any collective: every rank reads the same plan and fails alike.
        # Memory is checked at the batch this worker trains at (docs/memory.md), and
        # what DMP cannot train at this run's ranks per host is refused.
        plan = load_worker_plan(specs, env, options.plan, batch_size_per_rank=options.batch_size)
    except UserError as e:
        say(env, f"error: {e}", err=True)
        return 2
    device = worker_device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Without torchrun: one rank, and an in-process store. A free port picked and bound
    # later could be taken in between (it was, twice, in full test runs: EADDRINUSE).
    store = dist.HashStore() if "MASTER_ADDR" not in os.environ else None  # type: ignore[attr-defined]
    if env.local_rank == 0:
        # An elastic restart's last round left its markers (torchrun's restart count
        # does not move on a change of members): they would tell the launcher we stopped.
        clear_markers()
    # Two groups of every rank: the default one for setup and checkpoints (waits on the
    # slowest rank's file I/O), and one for training collectives, whose timeout is many
    # steps, not torch's 30 minutes: a rank never sits for long on a peer that is gone.
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeouts.checkpoint),
    )
    try:
        training = dist.new_group(timeout=datetime.timedelta(seconds=timeouts.collective))
        if env.elastic:
            agree_on_plan(plan, env)
        worker = Worker(
            env=env,
            tables=specs,
            plan=plan,
            device=device,
            batch_size=options.batch_size or plan.topology.batch_size_per_rank,
        )
        code = _Loop(worker, model, data, options, stop, loss, training).run()
    except UserError as e:  # e.g. the model does not match the plan: every rank alike
        say(env, f"error: {e}", err=True)
        code = 2
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (0, PEER_STOP_EXIT):
        dist.destroy_process_group()
    return code


def agree_on_plan(plan: Plan, env: WorkerEnv) -> None:
    """Every rank read the same plan: an elastic rank reads its world's plan from its
    own pod's mount, and two mounts may lag their ConfigMap differently. A
    :class:`UserError` otherwise (torchrun restarts the ranks, by then the mounts agree)."""
    hashes: list[Any] = [None] * env.world_size
    dist.all_gather_object(hashes, plan.hash)
    if len(set(hashes)) > 1:
        seen = ", ".join(f"rank {r}: {str(h)[:12]}" for r, h in enumerate(hashes))
        raise UserError(
            f"the ranks read different plans for {env.world_size} ranks ({seen}): a pod's "
            "mount has not caught up with the plans ConfigMap yet"
        )


def _read_tables(tables: Tables) -> list[TableSpec]:
    if isinstance(tables, str | Path):
        return load_tables(tables)
    if callable(tables):
        return list(tables())
    return list(tables)


class _Loop:
    """One rank's run: shard, resume, train, checkpoint, stop."""

    def __init__(
        self,
        worker: Worker,
        model: ModelFactory,
        data: DataFactory,
        options: TrainOptions,
        stop: GracefulStop,
        loss: Loss | None,
        group: Any,
    ) -> None:
        self.worker, self.env, self.plan = worker, worker.env, worker.plan
        self.model_factory, self.data_factory = model, data
        self.options, self.stop, self.group = options, stop, group
        self.loss_fn: Loss = loss or nn.BCEWithLogitsLoss()

    def run(self) -> int:
        o, env, plan, device = self.options, self.env, self.plan, self.worker.device
        torch.manual_seed(o.seed)
        model = self.model_factory(self.worker, torch.device("meta"), device)
        # The runtime checks the model against the plan, builds TorchRec's ShardingPlan
        # for this device and wraps the model in DistributedModelParallel.
        dmp = shard_model(
            model,
            plan,
            device,
            optimizer=o.embedding_optimizer,
            module_path=o.module_path,
            local_world_size=env.local_world_size,
            group=self.group,
        )
        optimizer = dense_optimizer(dmp, o.lr)
        batches = self.data_factory(self.worker)
        summary: dict[str, Any] = {
            "world_size": env.world_size,
            "plan_hash": plan.hash,
            "batch_size": self.worker.batch_size,
            "device": str(device),
        }

        start = 0
        root = o.checkpoint_dir
        latest = ckpt.latest_checkpoint(root) if root and o.resume else None
        if latest is not None and o.check_unsharded:
            raise UserError(
                f"--check-unsharded would overwrite the weights resumed from {latest}; "
                "use it on a fresh start (or with --no-resume)."
            )
        if latest is not None:
            t0 = time.perf_counter()
            meta, notes = ckpt.load_checkpoint(
                latest, dmp, optimizer, plan, module_path=o.module_path
            )
            start = meta.step
            self.stop.last_checkpoint = str(latest)
            summary |= {
                "resumed_from": str(latest),
                "resumed_world_size": meta.world_size,
                "load_seconds": time.perf_counter() - t0,
                "optimizer_notes": notes,
            }
            if env.rank == 0:
                say(env, f"resumed {ckpt.describe(meta)} in {summary['load_seconds']:.2f} s")
                for note in notes:
                    say(env, f"note: {note}")
        if o.check_unsharded:
            summary["unsharded_max_abs_err"] = self.check_unsharded(dmp, batches)
        if o.export_start:
            self.export(dmp, optimizer, o.export_start, start)

        metrics = WorkerMetrics(
            CollectorRegistry(), namespace=env.namespace, job=env.job, rank=env.rank
        )
        metrics.set_info(
            plan_hash=plan.hash,
            planner=plan.planner,
            world_size=env.world_size,
            device=device.type,
            batch_size=self.worker.batch_size,
        )
        metrics.serve(env.rank_metrics_port)
        timer = EmbeddingTimer(
            sharded_collection(dmp, o.module_path),
            every=o.measure_every,
            start=start,
            cuda=device.type == "cuda",
        )
        if not timer.kernels:
            say(env, "note: this rank holds no embedding kernel; it samples no embedding cost")
        facts = RunFacts(
            plan_hash=plan.hash,
            world_size=env.world_size,
            batch_size_per_rank=self.worker.batch_size,
            device=device.type,
            steps=o.steps,
            start_step=start,
            resume_seconds=float(summary.get("load_seconds", 0.0)),
        )
        live = live_reporter(  # None unless the operator named a live ConfigMap
            env,
            facts,
            metrics,
            sharded_collection(dmp, o.module_path),
            group=self.group,
            report_every=o.report_every,
            probe=o.probe,
            min_interval=o.report_min_interval,
        )
        losses: list[tuple[int, float]] = []
        saved: list[str] = []
        last_saved = start
        stopped: str | None = None
        step = start
        train_seconds = 0.0
        # Everything built so far lives as long as the run: collect once and freeze it,
        # so the collector's full passes (0.2-0.5 s each on CPU, measured) never land in
        # a step, and later ones scan only what training creates.
        gc.collect()
        gc.freeze()
        loop_start = time.perf_counter()
        for step in range(start + 1, o.steps + 1):
            dense, kjt, labels = batches(step)
            dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
            t0 = time.perf_counter()
            timer.start_step(step)
            if live is not None:
                live.start_step(step)
            logits = dmp(dense, kjt).squeeze(-1)
            loss: Any = self.loss_fn(logits, labels)  # (torch's backward is untyped)
            loss.backward()  # the embeddings' optimizer runs inside backward (fused)
            optimizer.step()
            optimizer.zero_grad()
            sample = timer.finish_step()
            seconds = time.perf_counter() - t0
            train_seconds += seconds
            value = float(loss.item())
            losses.append((step, value))
            metrics.observe_step(seconds, value)
            if sample is not None:
                metrics.observe_cost(sample)
            if env.rank == 0 and o.log_every and step % o.log_every == 0:
                say(env, f"step {step} loss {value:.4f} {1e3 * seconds:.1f} ms/step")
            if live is not None:  # after the step's time: the probe is not training time
                live.after_step(step, train_seconds)
            # A collective: every rank stops at the same step.
            stop_now = self.stop.should_stop(self.group)
            if stop_now and live is not None:  # the last figures, before the checkpoint
                live.final(step, train_seconds)
            due = o.checkpoint_every > 0 and step % o.checkpoint_every == 0
            if root is not None and (stop_now or due):
                reason = "stop" if stop_now else "interval"
                saved.append(str(self.save(dmp, optimizer, root, step, reason)))
                last_saved = step
            if stop_now:
                stopped = self.stop.signal_name
                break
        loop_seconds = time.perf_counter() - loop_start  # everything a step costs
        if live is not None:
            live.final(step, train_seconds)
        if root is not None and step > last_saved:
            saved.append(str(self.save(dmp, optimizer, root, step, "final")))
        if stopped is not None or self.stop.requested:  # a signal, even during the last step
            reason = stopped or self.stop.signal_name or "signal"
            write_stop_marker(
                env.rank, env.local_world_size, step, saved[-1] if saved else None, reason
            )
            if env.rank == 0:
                say(env, f"stopped by {reason} after step {step}; checkpoint {saved[-1:]}")
        if o.export_end:
            self.export(dmp, optimizer, o.export_end, step)
        timer.close()
        if live is not None:
            live.close()
            summary["live"] = live.figures()
        summary |= {
            "start_step": start,
            "end_step": step,
            "losses": losses,
            "checkpoints": saved,
            "stopped": stopped,
            "steps_per_second": (step - start) / train_seconds if train_seconds > 0 else None,
            "loop_seconds": loop_seconds,
            "cost_medians": metrics.medians(),
        }
        dist.barrier()
        if o.summary and env.rank == 0:
            o.summary.write_text(json.dumps(summary, indent=1))
        if env.elastic and stopped == "peer":
            # A world change this node's torchrun has not seen yet: it must restart
            # the rank, not take the run as done (docs/resharding.md, in place).
            # Every such rank says so: its torchrun logs the exit as a failure.
            say(
                env,
                f"stopped after step {step} for a peer's stop, not this node's: exit "
                f"{PEER_STOP_EXIT}, so torchrun restarts this rank into the new world",
            )
            return PEER_STOP_EXIT
        return 0

    def save(self, dmp: Any, optimizer: Any, root: Path, step: int, reason: str) -> Path:
        t0 = time.perf_counter()
        with self.stop.checkpointing():  # a signal meanwhile waits for this save, then stops
            path = ckpt.save_checkpoint(
                root,
                step,
                dmp,
                optimizer,
                self.plan,
                reason=reason,
                module_path=self.options.module_path,
                keep=self.options.keep,
                extra=dict(self.options.checkpoint_extra),
            )
        self.stop.last_checkpoint = str(path)
        if self.env.rank == 0:
            say(self.env, f"checkpoint {path} ({reason}) in {time.perf_counter() - t0:.2f} s")
        return path

    def check_unsharded(self, dmp: Any, batches: Batches) -> float:
        """Give the sharded model an unsharded one's weights and compare their outputs on
        each rank's batch: the largest difference over all ranks."""
        torch.manual_seed(self.options.seed + 1)  # the same full weights on every rank
        cpu = torch.device("cpu")
        reference = self.model_factory(self.worker, cpu, cpu)
        load_full_state_dict(dmp, reference.state_dict())
        dense, kjt, _ = batches(0)
        device = self.worker.device
        with torch.no_grad():
            got = dmp(dense.to(device), kjt.to(device)).cpu()
            want = reference(dense, kjt)
        err = torch.tensor([float((got - want).abs().max())], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if self.env.rank == 0:
            say(self.env, f"sharded vs unsharded forward: max |difference| {float(err):.3g}")
        return float(err)

    def export(self, dmp: Any, optimizer: Any, path: Path, step: int) -> None:
        """Rank 0 writes the full model and both optimizers' state (a collective)."""
        state = gather_state_dict(dmp)
        embedding_state = gather_fused_optimizer_state(dmp)
        if self.env.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "step": step,
                    "plan_hash": self.plan.hash,
                    "model": state,
                    "embedding_optimizer": embedding_state,
                    "dense_optimizer": optimizer.state_dict()["state"],  # replicated
                },
                path,
            )
