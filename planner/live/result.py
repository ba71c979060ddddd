"""What a live re-plan found (:class:`LiveReplan`): the plan to run, its moves and kind
changes, and the figures that judge it, down to one line an Event quotes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shardwise.basics import format_bytes
from shardwise.planner.live.fit import NOISE, LiveFit
from shardwise.planner.plan import Plan

#: The planner name of a re-planned plan: ``"<old planner>+live"``.
LIVE_SUFFIX = "+live"
#: Candidates within this share of the lowest predicted max are a tie: fewest moves wins.
NEAR_TIE = 0.01


class Move(NamedTuple):
    """One shard moved: ``(table, col_offset, from_rank, to_rank)``."""

    table: str
    col_offset: int
    from_rank: int
    to_rank: int


@dataclass(frozen=True)
class LiveReplan:
    """What :func:`replan` found: the plan to run and the figures that judge it."""

    plan: Plan
    #: Measured compute (fwd + bwd) per rank, as the workers report it.
    current_rank_ms: list[float]
    #: The plan as it runs, priced by the live costs (the search's own baseline).
    priced_rank_ms: list[float]
    #: The chosen plan, priced by the live costs.
    predicted_rank_ms: list[float]
    current_max_ms: float
    predicted_max_ms: float
    #: ``current_max / predicted_max - 1``; 0 when no plan predicts better.
    gain: float
    moves: list[Move]
    #: Weights and optimizer state of the moved shards: what a reshard carries.
    moved_bytes: int
    estimated_shards: int
    seconds: float
    #: The fitted prices, their plausible alternatives and what could be checked.
    fit: LiveFit
    #: Each rank of the chosen plan at its worst plausible price, and the worst max.
    risk_rank_ms: list[float]
    risk_max_ms: float
    #: ``current_max / risk_max - 1``: the gain if the evidence is as unkind as it may be.
    risk_gain: float
    #: Tables whose kind the plan changes, each said as ``"t3: table-wise → row-wise
    #: over 4 ranks"`` (:mod:`.kinds`); the plan carries them whether shards move or not.
    kind_changes: list[str] = field(default_factory=list)
    #: The kind changes priced and not chosen, each with its figures (why not).
    kind_notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the plan differs from the running one: shards moved or a kind changed
        (a kind change alone is a new plan to write)."""
        return bool(self.moves or self.kind_changes)

    @property
    def factor(self) -> float:
        return self.fit.best.factor

    @property
    def uncertainty(self) -> float:
        """How far the gain may be off: the plausible prices' spread (``gain -
        risk_gain``) plus a rank's measurement noise, for the plan measured after as
        for the one measured before."""
        return (self.gain - self.risk_gain) + (1 + self.gain) * NOISE

    def describe(self) -> str:
        """One line for an Event: what changes and what it predicts (what no change
        does: why not, with the kind change that came closest)."""
        if not self.changed:
            worst = " at its worst plausible price" if self.fit.alternatives else ""
            text = (
                f"no placement of the live costs predicts a max-rank compute below "
                f"{self.current_max_ms:.1f} ms by more than {NEAR_TIE:.0%}{worst}"
            )
            text += f" ({self.fit.note})" if self.fit.note else ""
            return text + (f"; {self.kind_notes[0]}" if self.kind_notes else "")
        n = len(self.moves)
        what = f"moving {n} shard{'s' if n != 1 else ''}" if n else ""
        if self.kind_changes:
            what += (" and " if what else "") + "turning " + "; ".join(self.kind_changes)
        return (
            f"{what} ({format_bytes(self.moved_bytes)}) predicts max-rank compute "
            f"{self.current_max_ms:.1f} → "
            f"{self.predicted_max_ms:.1f} ms ({100 * self.gain:+.0f} % ± "
            f"{100 * self.uncertainty:.0f} %)"
        )
