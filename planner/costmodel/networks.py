"""The two cost networks, both predicting log-seconds so that microsecond and
100-millisecond kernels weigh alike in training.

``ComputeNet`` (NeuroShard's architecture)
    A shared MLP encodes each table (or column shard) of a rank's fused kernel into
    positive values; the encodings are *summed* over the kernel's tables (padding +
    mask for batching) and a head, reading their log and the global batch size, gives
    forward and backward seconds. Table features: the 17 access bins, log2 width, log
    pooling, log rows, fp16, log lookups and values pooled at the batch, and the
    unique rows read (derived from the histogram as the stream generator does).
    The sum makes the model indifferent to table order and lets it price any number
    of tables; the head can still learn that a fused kernel is not additive.
``CommNet`` (one model for every world size)
    A per-rank encoder sees the rank's own width, its start delay and its relation to
    the others (share of all widths, wait for the straggler); a pooled context (mean
    and max over ranks, sums, log W) describes the whole collective. A per-rank head
    predicts the backward all-to-all and the forward all-to-all *after* the straggler
    wait, which is added explicitly (``max delay - own delay``): the wait is known
    exactly, only the collective must be learnt. Nothing in it is sized by W, so it
    runs on world sizes it never saw.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from shardwise.planner.costmodel.features import (
    RANK_FEATURES,
    SET_FEATURES,
    TABLE_FEATURES,
    Normalizer,
)


def _mlp(sizes: Sequence[int], final_act: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if final_act or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ComputeNet(nn.Module):
    """Shared table MLP, summed over the kernel's tables, then a head: log (fwd, bwd) s.

    The head has a linear skip next to its MLP, so "cost = sum of table costs" is
    the easy solution and the MLP learns the deviation (fused-kernel effects).
    """

    def __init__(self, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.hidden, self.layers = hidden, layers
        self.table_norm = Normalizer.identity(len(TABLE_FEATURES))
        self.set_norm = Normalizer.identity(len(SET_FEATURES))
        self.encoder = _mlp([len(TABLE_FEATURES)] + [hidden] * (layers + 1), final_act=False)
        self.head = _mlp([hidden + len(SET_FEATURES), hidden, hidden, 2], final_act=False)
        self.skip = nn.Linear(hidden + len(SET_FEATURES), 2)

    def encode(self, tables: torch.Tensor) -> torch.Tensor:
        """Raw table features ``[..., F]`` → positive encodings ``[..., H]``.

        Encodings are exponentials, so one channel can carry a table's own cost (the
        exponential of a linear function of log-features like the values it pools);
        their sum is then a fused kernel's additive part, and the head reads its log.
        """
        out: torch.Tensor = torch.exp(self.encoder(self.table_norm.apply(tables)).clamp(-30, 30))
        return out

    def head_from_sum(self, summed: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
        """Summed encodings ``[N, H]`` and raw set features ``[N, S]`` → log s ``[N, 2]``."""
        x = torch.cat([torch.log(summed + 1e-9), self.set_norm.apply(sets)], dim=1)
        out: torch.Tensor = self.head(x) + self.skip(x)
        return out

    def forward(self, tables: torch.Tensor, mask: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
        """``tables [N, T, F]``, ``mask [N, T]`` (1 = real table), ``sets [N, S]``."""
        enc = self.encode(tables) * mask.unsqueeze(-1)
        return self.head_from_sum(enc.sum(dim=1), sets)


class CommNet(nn.Module):
    """Per-rank encoder + pooled context → per-rank log (fwd after the wait, bwd) s."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = hidden
        self.rank_norm = Normalizer.identity(len(RANK_FEATURES))
        f = len(RANK_FEATURES)
        self.encoder = _mlp([f, hidden, hidden], final_act=True)
        self.head = _mlp([f + 3 * hidden, hidden, hidden, 2], final_act=False)
        # Linear in the (log) features: extrapolates to more ranks and wider
        # collectives as a power law; the MLP adds what is not.
        self.skip = nn.Linear(f, 2)

    def forward(self, ranks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ranks [N, W, F]`` raw, ``mask [N, W]`` → log-seconds ``[N, W, 2]``
        (channel 0 is the forward all-to-all *without* the straggler wait)."""
        x = self.rank_norm.apply(ranks)
        h = self.encoder(x) * mask.unsqueeze(-1)
        count = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        mean = h.sum(dim=1) / count
        top = h.masked_fill(mask.unsqueeze(-1) == 0, -1e9).max(dim=1).values
        own_vs_mean = h - mean.unsqueeze(1)
        ctx = torch.cat([mean, top], dim=1).unsqueeze(1).expand(-1, h.shape[1], -1)
        out: torch.Tensor = self.head(torch.cat([x, own_vs_mean, ctx], dim=-1)) + self.skip(x)
        return out


def comm_seconds(log_out: torch.Tensor, wait_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`CommNet` output → (fwd incl. the straggler wait, bwd) seconds."""
    out = log_out.clamp(-30.0, 15.0)  # an untrained net must not overflow
    return wait_s + torch.exp(out[..., 0]), torch.exp(out[..., 1])
