"""Where a worker is: its rank and world from ``torchrun``, its job from the operator.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; the
operator sets ``SHARDWISE_PLAN`` (the mounted plan file), ``SHARDWISE_NAMESPACE`` and
``SHARDWISE_JOB`` (metric labels), optionally ``SHARDWISE_PLAN_HASH`` (the hash the
plan ConfigMap was created for), ``SHARDWISE_METRICS_PORT``, ``SHARDWISE_LIVE_CONFIGMAP``
(where rank 0 writes its live summary; unset: nothing is written) and
``SHARDWISE_RDZV_ID`` (the DLRMJob's uid, which owns that ConfigMap),
``SHARDWISE_ELASTIC`` ("1": the world may change in place, ``SHARDWISE_PLAN`` is a
directory of plans by world size, :mod:`.plancheck`) and ``SHARDWISE_PLAN_WAIT``;
``SHARDWISE_*_TIMEOUT`` bound every wait on a peer (:class:`Timeouts`). A script run
without ``torchrun`` is a single rank. Stdlib only: read before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardwise import names
from shardwise.basics import UserError

#: Prometheus port of local rank 0; local rank r serves on this + r. 0 turns it off.
DEFAULT_METRICS_PORT = 9400

#: After SIGTERM, how long a rank may take to reach a step boundary agreed with every
#: peer (one step, normally) before it gives up on its peers and exits. 0: no bound.
DEFAULT_STOP_TIMEOUT = 10.0
#: A training collective (all-to-all, all-reduce) waiting longer than this for a peer
#: fails: many steps' worth, far below torch's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT = 60.0
#: Setup and checkpoint collectives wait for the slowest rank's file I/O: longer.
DEFAULT_CHECKPOINT_TIMEOUT = 300.0
#: torchrun's rendezvous store reads (c10d ``read_timeout``). Torch's 60 s: it also
#: bounds how long a node's torchrun waits for the store host (pod 0) to come up.
DEFAULT_RDZV_TIMEOUT = 60.0
#: How long an elastic worker waits for its world's plan to appear in the mounted
#: ConfigMap: the kubelet refreshes a running pod's copy within about two minutes.
DEFAULT_PLAN_WAIT = 300.0


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer.") from None
    if value < minimum:
        raise UserError(f"environment variable {name}={value} must be at least {minimum}.")
    return value


def _seconds(environ: Mapping[str, str], name: str, default: float, *, zero: bool) -> float:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UserError(
            f"environment variable {name}={raw!r} is not a number of seconds."
        ) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        low = "0 (off) or more" if zero else "above 0"
        raise UserError(f"environment variable {name}={raw} must be {low} seconds.")
    return value


@dataclass(frozen=True)
class Timeouts:
    """How long a worker waits for its peers, in seconds (``SHARDWISE_*_TIMEOUT``).

    A peer that is gone (its node froze or lost power) never answers, so every wait on
    one needs a bound: ``collective`` for the training process group, ``checkpoint``
    for the setup/checkpoint group (file I/O of the slowest rank), ``stop`` for the way
    from SIGTERM to an agreed step boundary, ``rendezvous`` for torchrun's store."""

    stop: float = DEFAULT_STOP_TIMEOUT
    collective: float = DEFAULT_COLLECTIVE_TIMEOUT
    checkpoint: float = DEFAULT_CHECKPOINT_TIMEOUT
    rendezvous: float = DEFAULT_RDZV_TIMEOUT

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Timeouts:
        env = os.environ if environ is None else environ
        return cls(
            stop=_seconds(env, names.ENV_STOP_TIMEOUT, DEFAULT_STOP_TIMEOUT, zero=True),
            collective=_seconds(
                env, names.ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT, zero=False
            ),
            checkpoint=_seconds(
                env, names.ENV_CHECKPOINT_TIMEOUT, DEFAULT_CHECKPOINT_TIMEOUT, zero=False
            ),
            rendezvous=_seconds(env, names.ENV_RDZV_TIMEOUT, DEFAULT_RDZV_TIMEOUT, zero=False),
        )


@dataclass(frozen=True)
class WorkerEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    namespace: str
    job: str
    plan_path: str | None
    plan_hash: str | None
    metrics_port: int
    #: The ConfigMap rank 0 writes the live summary to (``None``: no summary).
    live_configmap: str | None = None
    #: The DLRMJob's uid (the operator passes it as the rendezvous id), to own that
    #: ConfigMap if rank 0 has to create it.
    job_uid: str | None = None
    #: torchrun runs elastic: a stop only a peer asked for is a restart, not an end.
    elastic: bool = False
    #: Seconds to wait for this world's plan in a plans directory.
    plan_wait: float = DEFAULT_PLAN_WAIT

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        world_size = _int(env, "WORLD_SIZE", 1, 1)
        rank = _int(env, "RANK", 0, 0)
        if rank >= world_size:
            raise UserError(f"RANK={rank} is not below WORLD_SIZE={world_size}.")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", 1, 1)
        local_rank = _int(env, "LOCAL_RANK", 0, 0)
        port = _int(env, names.ENV_METRICS_PORT, DEFAULT_METRICS_PORT, 0)
        if port > 65535 - local_world_size:
            raise UserError(
                f"{names.ENV_METRICS_PORT}={port} leaves no room for {local_world_size} local "
                "ranks (each serves on the port + its local rank); use a port below 65000."
            )
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            namespace=env.get(names.ENV_NAMESPACE, ""),
            job=env.get(names.ENV_JOB, ""),
            plan_path=env.get(names.ENV_PLAN) or None,
            plan_hash=env.get(names.ENV_PLAN_HASH) or None,
            metrics_port=port,
            live_configmap=env.get(names.ENV_LIVE_CONFIGMAP) or None,
            job_uid=env.get(names.ENV_RDZV_ID) or None,
            elastic=env.get(names.ENV_ELASTIC, "") == "1",
            plan_wait=_seconds(env, names.ENV_PLAN_WAIT, DEFAULT_PLAN_WAIT, zero=True),
        )

    @property
    def rank_metrics_port(self) -> int:
        """This rank's Prometheus port (0: off): one port per local rank, so a pod with
        several GPUs serves one endpoint per rank."""
        return self.metrics_port + self.local_rank if self.metrics_port else 0

    @property
    def tag(self) -> str:
        """Prefix for messages, so interleaved output from many ranks stays readable."""
        return f"[rank {self.rank}/{self.world_size}]"
