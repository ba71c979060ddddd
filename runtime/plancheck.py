"""Read the injected plan and check it against this job, before anything collective.

Every rank reads the same ``plan.json`` (the operator mounts one ConfigMap on every
pod) and runs the same checks, so a plan that does not fit fails *every* rank the same
way with the same message, and no rank is left waiting in a collective for a peer that
gave up. When the first rank fails, ``torchrun`` SIGTERMs the others; a script that
installed :class:`.stop.GracefulStop` first keeps them alive long enough to reach this
check and print their own error. The checks need no process group, so tools other
than a worker can run them too.

Besides plan.json's own rules, a worker refuses what DMP cannot train
(:func:`run_problems`): TorchRec's rules (``torchrec_problems`` of
:mod:`shardwise.planner.torchrec_plan`: uneven row cuts, unequal column widths on one
rank), table-row-wise and grid tables in
a plan made for another number of GPUs per host than the run's ``LOCAL_WORLD_SIZE``
(TorchRec finds a rank's host from it), and data-parallel tables in fp16 (the dense
optimizer, torch's Adagrad, divides 0 by 0 on a row without gradient in fp16, its eps
underflowing, so the table turns NaN; on any device). Every kind runs on both CPU and
CUDA (:mod:`.sharding`), so no kind is refused for the device.

No rank ever re-plans: a plan that does not fit is an error, never a reason to plan
again here (the operator plans once, for the world size it launches).

**Elastic jobs.** Where the world can change while the pods run (Kueue's workload
slices grow the worker Job in place, docs/resharding.md), ``SHARDWISE_PLAN`` names a
directory holding one ``plan-<ranks>.json`` per world size planned, and each rank reads
the one for its ``WORLD_SIZE`` (:func:`world_plan_file`). The operator writes a world's
plan before it grows the job to it, but a running pod's copy of the mount lags the
ConfigMap by up to a couple of minutes, so a rank waits for the file, up to
``SHARDWISE_PLAN_WAIT`` seconds. The ranks then check that they all read the same plan
(the trainer compares hashes before training), since two copies may lag differently.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shardwise import names
from shardwise.basics import UserError
from shardwise.planner.kinds import HOST_KINDS
from shardwise.planner.plan import Plan, load_plan
from shardwise.planner.tables import TableSpec
from shardwise.runtime.env import WorkerEnv


def plan_path(explicit: str | Path | None, env: WorkerEnv) -> Path:
    """The plan file: an explicit path, else ``SHARDWISE_PLAN``."""
    if explicit is not None:
        return Path(explicit)
    if env.plan_path is None:
        raise UserError(
            f"no plan: {names.ENV_PLAN} is not set. In the cluster the operator sets it to the "
            f"mounted plan (/etc/shardwise/plan.json); locally, make one with "
            f"`shardwise plan TABLES --gpus N --target-device cpu --out plan.json` and export "
            f"{names.ENV_PLAN}=plan.json (or pass the path)."
        )
    return Path(env.plan_path)


def world_plan_file(
    directory: Path,
    world_size: int,
    wait: float,
    *,
    note: Callable[[str], None] | None = None,
    poll: float = 1.0,
) -> Path:
    """``directory``'s plan for ``world_size`` ranks, once it is there: waits up to
    ``wait`` seconds (saying so once through ``note``), then a :class:`UserError`
    naming the world sizes the directory holds."""
    want = directory / names.world_plan_key(world_size)
    deadline = time.monotonic() + wait
    said = False
    while not want.is_file():
        if time.monotonic() >= deadline:
            held = sorted(p.name for p in directory.glob("plan-*.json"))
            raise UserError(
                f"no plan for {world_size} ranks in {directory} after {wait:g} s (it holds "
                f"{', '.join(held) or 'none'}): the operator writes {want.name} before it "
                f"grows the job to {world_size}; raise {names.ENV_PLAN_WAIT} if the mount "
                "is slow to follow its ConfigMap."
            )
        if not said:
            (note or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"waiting up to {wait:g} s for {want} (the mount follows its ConfigMap)"
            )
            said = True
        time.sleep(poll)
    return want


def run_problems(plan: Plan, local_world_size: int | None = None) -> list[str]:
    """What DMP cannot train in ``plan`` (the module docstring), as sentences naming
    the tables: TorchRec's rules, host-local kinds on another host size than the run's
    ``local_world_size`` (``None``: not checked), data-parallel tables in fp16."""
    from shardwise.planner.torchrec_plan import torchrec_problems

    out = list(torchrec_problems(plan))
    hosted = [t.name for t in plan.tables if t.kind in HOST_KINDS]
    planned = plan.topology.local_world
    if hosted and local_world_size is not None and planned != local_world_size:
        out.append(
            f"the plan is for {planned} GPUs per host (topology.gpus_per_host) but this run "
            f"has {local_world_size} ranks per host (LOCAL_WORLD_SIZE); its table-row-wise "
            f"and grid tables ({', '.join(map(repr, hosted[:5]))}"
            f"{', …' if len(hosted) > 5 else ''}) keep their row ranges on one host, which "
            f"TorchRec finds by LOCAL_WORLD_SIZE. Re-plan with --gpus-per-host "
            f"{local_world_size}, or launch {planned} ranks per host (torchrun "
            f"--nproc_per_node={planned})"
        )
    for t in plan.tables:
        if t.kind == "data_parallel" and t.dtype == "fp16":
            out.append(
                f"table {t.name!r} is data_parallel in fp16: the dense optimizer (torch's "
                "Adagrad) divides 0 by 0 on each row without a gradient when its eps "
                "underflows in fp16, and the table turns NaN. Make the table fp32 or shard it"
            )
    return out


def plan_problems(
    plan: Plan,
    tables: Sequence[TableSpec],
    world_size: int,
    expected_hash: str | None = None,
    *,
    batch_size_per_rank: int | None = None,
    local_world_size: int | None = None,
) -> list[str]:
    """Why ``plan`` cannot drive this job (empty: it can), as sentences naming the table.

    Memory is the planners' rule (docs/memory.md: weights, optimizer state and I/O
    buffers, with these tables' pooling factors) at the batch this job trains at:
    ``batch_size_per_rank``, or the plan's when ``None``. What DMP cannot train
    (:func:`run_problems`) is checked at ``local_world_size`` ranks per host."""
    out: list[str] = []
    if plan.world_size != world_size:
        out.append(
            f"the plan is for {plan.world_size} ranks but this job runs {world_size} "
            f"(re-plan with --gpus {world_size}, or launch {plan.world_size} ranks)"
        )
    if plan.hash and expected_hash is not None and plan.hash != expected_hash:
        out.append(
            f"the plan's hash is {plan.hash[:12]}… but {names.ENV_PLAN_HASH} expects "
            f"{expected_hash[:12]}… (a stale plan is mounted)"
        )
    # Every rule of plan.json (coverage, widths, memory, a hash that matches: the same
    # rule as `shardwise evaluate`'s) and the table shapes.
    out.extend(plan.problems(tables, require_hash=True, batch_size_per_rank=batch_size_per_rank))
    if not out:  # TorchRec's rules assume a valid plan
        out.extend(run_problems(plan, local_world_size))
    return out


def check_plan(
    plan: Plan,
    tables: Sequence[TableSpec],
    world_size: int,
    *,
    expected_hash: str | None = None,
    source: str = "plan",
    batch_size_per_rank: int | None = None,
    local_world_size: int | None = None,
) -> Plan:
    """Return ``plan`` if it can drive this job, else raise one :class:`UserError` with
    every problem (the model's tables by name, the world size, the hash, memory at
    ``batch_size_per_rank``, by default the plan's; what DMP cannot train at
    ``local_world_size`` ranks per host)."""
    problems = plan_problems(
        plan,
        tables,
        world_size,
        expected_hash,
        batch_size_per_rank=batch_size_per_rank,
        local_world_size=local_world_size,
    )
    if problems:
        raise UserError(
            f"{source} cannot drive this job:\n- "
            + "\n- ".join(problems)
            + "\nThe plan must be made for exactly these tables (names, rows, dims, dtype), "
            "this world size and this many ranks per host; no rank re-plans."
        )
    return plan


def load_worker_plan(
    tables: Sequence[TableSpec],
    env: WorkerEnv,
    path: str | Path | None = None,
    *,
    batch_size_per_rank: int | None = None,
) -> Plan:
    """Read the plan (``path`` or ``SHARDWISE_PLAN``) and :func:`check_plan` it for this
    job's tables, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``SHARDWISE_PLAN_HASH`` (when
    set) and the batch per rank the worker trains at (``None``: the plan's)."""
    where = plan_path(path, env)
    if where.is_dir():
        where = world_plan_file(where, env.world_size, env.plan_wait)
    plan = load_plan(where)
    return check_plan(
        plan,
        tables,
        env.world_size,
        expected_hash=env.plan_hash,
        source=str(where),
        batch_size_per_rank=batch_size_per_rank,
        local_world_size=env.local_world_size,
    )
