"""The live summary: what a running job's workers measured, as rank 0 reports it.

Rank 0 gathers every rank's measured embedding cost (medians over the recent sampled
steps, :mod:`shardwise.runtime.live_cost`) and the per-shard costs of the bounded
probe window, and writes them as JSON (``live.json``) to the job's live ConfigMap
(``names.live_configmap_name``). The operator reads it to see a straggler, and the
planner re-plans from it (:mod:`shardwise.planner.live.replan`). It lives in ``planner/``
because all three sides speak it and the planner is the lowest layer they share.

Imbalance is judged on a rank's **compute** (fused kernels' forward + backward): the
measured comm of a rank includes its wait for the slowest rank, so every rank's total
is about the straggler's and would hide the imbalance.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

#: The summary's format version.
VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class RankCost(_Model):
    """One rank's measured cost per iteration, in milliseconds (medians)."""

    rank: int = Field(ge=0)
    #: The pod (hostname) the rank runs in, to name it when something is wrong.
    pod: str = ""
    #: Sampled steps behind the medians (0: nothing measured yet).
    samples: int = Field(default=0, ge=0)
    fwd_compute_ms: float = Field(default=0.0, ge=0, alias="fwdComputeMs")
    bwd_compute_ms: float = Field(default=0.0, ge=0, alias="bwdComputeMs")
    fwd_comm_ms: float = Field(default=0.0, ge=0, alias="fwdCommMs")
    bwd_comm_ms: float = Field(default=0.0, ge=0, alias="bwdCommMs")
    #: Median wall time of the rank's recent training steps.
    step_ms: float = Field(default=0.0, ge=0, alias="stepMs")
    #: The shards this rank's probe can time (0: unknown, or no probe).
    probe_shards: int = Field(default=0, ge=0, alias="probeShards")
    #: What the rank's fused kernels cost with every bag empty (forward + backward, the
    #: probe's reference call, summed over the rank's kernels; 0: not measured): the
    #: kernels' own fixed work, which a live fit weighs against the per-shard share.
    probe_empty_ms: float = Field(default=0.0, ge=0, alias="probeEmptyMs")

    @property
    def compute_ms(self) -> float:
        return self.fwd_compute_ms + self.bwd_compute_ms

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.fwd_comm_ms + self.bwd_comm_ms


ShardKey = tuple[str, int, int, int]
"""A shard of a plan: (table, rank, first row, first column). The rank is part of it:
a data-parallel table has the same rows and columns on every rank."""


class ShardCost(_Model):
    """One shard's measured cost (forward + backward) on its rank, in milliseconds.

    A shard is a rectangle of its table on one rank: its columns, and for a row kind
    its row range (``rowOffset``, ``rows``; a data-parallel copy is every row, on every
    rank). :meth:`key` names it within the plan."""

    table: str
    rank: int = Field(ge=0)
    col_offset: int = Field(default=0, ge=0, alias="colOffset")
    cols: int = Field(gt=0)
    row_offset: int = Field(default=0, ge=0, alias="rowOffset")
    #: The rows it holds; ``None`` (summaries before row ranges): every row.
    rows: int | None = Field(default=None, ge=0)
    ms: float = Field(ge=0)
    #: Probe windows behind the figure.
    samples: int = Field(default=1, ge=1)
    #: How far ``ms`` may be off (the standard error of its median over the windows;
    #: 0: not said).
    spread_ms: float = Field(default=0.0, ge=0, alias="spreadMs")

    def key(self) -> ShardKey:
        return (self.table, self.rank, self.row_offset, self.col_offset)


class RankPoint(_Model):
    """One measured rank of a plan the job ran, as a live fit uses it: how many shards
    its kernels held, their probe costs summed, its measured compute and its kernels'
    empty-call cost. Kept across reshards (``status.imbalanceLoop.evidence``), so a
    plan that ran before is evidence for the next re-plan."""

    plan: str = ""
    rank: int = Field(default=0, ge=0)
    shards: int = Field(ge=1)
    probe_ms: float = Field(ge=0, alias="probeMs")
    compute_ms: float = Field(gt=0, alias="computeMs")
    empty_ms: float = Field(default=0.0, ge=0, alias="emptyMs")
    #: How far ``probe_ms`` may be off (its shards' spreads in quadrature).
    probe_spread: float = Field(default=0.0, ge=0, alias="probeSpreadMs")


class ProbeStats(_Model):
    """The per-shard probe's own cost: how the ≤ 1 % overhead bound held."""

    seconds: float = Field(default=0.0, ge=0)
    train_seconds: float = Field(default=0.0, ge=0, alias="trainSeconds")
    windows: int = Field(default=0, ge=0)

    @property
    def overhead(self) -> float:
        return self.seconds / self.train_seconds if self.train_seconds > 0 else 0.0


class LiveSummary(_Model):
    """``live.json``: the running job as its workers measure it."""

    version: int = VERSION
    plan_hash: str = Field(alias="planHash")
    world_size: int = Field(ge=1, alias="worldSize")
    batch_size_per_rank: int = Field(ge=1, alias="batchSizePerRank")
    device: str = "cpu"
    #: The last step done, and the step the run trains to.
    step: int = Field(ge=0)
    steps: int = Field(ge=0)
    #: The step the run started (or resumed) at, and its resume's load time.
    start_step: int = Field(default=0, ge=0, alias="startStep")
    resume_seconds: float = Field(default=0.0, ge=0, alias="resumeSeconds")
    #: RFC 3339 times: the first step of this run ended, and this summary was written.
    first_step_at: str = Field(default="", alias="firstStepAt")
    written_at: str = Field(alias="writtenAt")
    ranks: list[RankCost] = Field(default_factory=list)
    shards: list[ShardCost] = Field(default_factory=list)
    probe: ProbeStats = Field(default_factory=ProbeStats)

    def measured(self) -> list[RankCost]:
        """The ranks with at least one sampled step."""
        return [r for r in self.ranks if r.samples > 0]

    def complete(self) -> bool:
        """Every rank of the world has reported a measurement."""
        return len({r.rank for r in self.measured()}) == self.world_size

    def probed(self, min_samples: int = 1) -> tuple[int, int]:
        """(shards measured at least ``min_samples`` times, shards the probes can time)
        over the ranks that say how many they hold."""
        want = sum(r.probe_shards for r in self.ranks)
        counted = {r.rank for r in self.ranks if r.probe_shards > 0}
        got = sum(1 for s in self.shards if s.rank in counted and s.samples >= min_samples)
        return got, want

    def max_compute_ms(self) -> float:
        ranks = self.measured()
        return max(r.compute_ms for r in ranks) if ranks else 0.0

    def imbalance(self) -> float | None:
        """Max over mean of the ranks' measured compute; None until every rank reported."""
        return imbalance([r.compute_ms for r in self.measured()]) if self.complete() else None

    def straggler(self) -> RankCost | None:
        ranks = self.measured()
        return max(ranks, key=lambda r: r.compute_ms) if ranks else None

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)

    def points(self, min_samples: int = 1) -> list[RankPoint]:
        """Every rank whose probe timed all its shards (at least ``min_samples`` windows
        each) as a :class:`RankPoint` of this summary's plan; a rank that does not say
        how many shards its probe holds counts the shards it reported."""
        by_rank: dict[int, list[ShardCost]] = {}
        for s in self.shards:
            by_rank.setdefault(s.rank, []).append(s)
        out = []
        for r in self.measured():
            got = by_rank.get(r.rank, [])
            want = r.probe_shards or len(got)
            if not got or len(got) != want or min(s.samples for s in got) < min_samples:
                continue
            if r.compute_ms <= 0:
                continue
            out.append(
                RankPoint(
                    plan=self.plan_hash[:12],
                    rank=r.rank,
                    shards=len(got),
                    probe_ms=sum(s.ms for s in got),
                    compute_ms=r.compute_ms,
                    empty_ms=r.probe_empty_ms,
                    probe_spread=sum(s.spread_ms**2 for s in got) ** 0.5,
                )
            )
        return out


def imbalance(values: Sequence[float]) -> float | None:
    """Max over mean (1.0: perfectly balanced); None when there is nothing to compare."""
    if not values:
        return None
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else None
