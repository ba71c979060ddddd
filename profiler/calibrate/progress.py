"""A calibration's clock and what it tells the caller as it goes (the CLI's bar)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.profiler.pretrain.training import EpochProgress

if TYPE_CHECKING:
    from shardwise.profiler.calibrate.tasks import Task


@dataclass(frozen=True)
class PhaseProgress:
    """Passed to ``on_progress`` after every sample and epoch (the CLI's bar)."""

    phase: str  # "anchors", "ranks", "fit"
    elapsed_s: float
    budget_s: float
    text: str


class Run:
    """The clock and the progress callbacks of one calibration."""

    def __init__(
        self,
        start: float,
        budget_s: float,
        on_progress: Callable[[PhaseProgress], None] | None,
    ) -> None:
        self.start, self.budget_s, self.on_progress = start, budget_s, on_progress
        self.samples: dict[str, int] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, phase: str, text: str) -> None:
        if self.on_progress:
            self.on_progress(PhaseProgress(phase, self.elapsed(), self.budget_s, text))

    def sampled(self, phase: str) -> Callable[[Task], None]:
        def on_sample(task: Task) -> None:
            self.samples[phase] = self.samples.get(phase, 0) + 1
            what = (
                f"{task.kind} {task.extra.get('table')} ({task.extra.get('cols')} columns)"
                if task.kind == "anchor"
                else f"{task.kind} of plan {task.extra.get('plan')}, {task.shard_count} shards"
            )
            self.say(phase, f"{phase}: {self.samples[phase]} kernels (last: {what})")

        return on_sample

    def epoch(self, p: EpochProgress) -> None:
        self.say(
            "fit",
            f"fine-tune: epoch {p.epoch}, validation loss {p.val_loss:.4f} "
            f"(best {p.best_val_loss:.4f})",
        )
