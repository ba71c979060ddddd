"""The compute model's head in NumPy, for searches that price thousands of tiny sets.

A greedy placement asks, for every shard, "what would each rank cost with this shard
added?": the rank's summed table encodings plus the shard's, through the head. That
is a few hundred microseconds per question through torch (dispatch overhead on
``[W, 66]`` inputs) and a few tens through NumPy. The search keeps per-rank sums of
:meth:`CostPredictor.encodings` itself and calls :meth:`ComputeHead.seconds`;
``tests/test_incremental.py`` pins that it agrees with the torch model.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt
from torch import nn

from shardwise.planner.costmodel import SET_FEATURES, ComputeNet

F32 = npt.NDArray[np.float32]


def _linears(seq: nn.Sequential) -> list[tuple[F32, F32]]:
    return [
        (m.weight.detach().numpy().T.astype(np.float32), m.bias.detach().numpy().astype(np.float32))
        for m in seq
        if isinstance(m, nn.Linear)
    ]


class KernelHead(Protocol):
    """What a search asks of a cost model: summed per-shard encodings of kernels and
    their shard counts → (fwd, bwd) seconds. :class:`ComputeHead` is the network's;
    a calibrated model's is :class:`~shardwise.planner.costmodel.rankhead.AnchoredHead`."""

    def seconds(self, summed: F32, counts: npt.NDArray[np.int64]) -> F32: ...


class ComputeHead:
    """``ComputeNet.head_from_sum`` → fwd and bwd seconds, on NumPy arrays."""

    def __init__(
        self, net: ComputeNet, global_batch: int, speed: tuple[float, float] = (1.0, 1.0)
    ) -> None:
        """``speed``: a calibrated model's (fwd, bwd) factors, applied as the predictor
        applies them, so a search and a plan's price agree."""
        self._layers = _linears(net.head)
        self._log_speed = np.log(np.asarray(speed, dtype=np.float32))
        w, b = _linears(nn.Sequential(net.skip))[0]
        self._skip_w, self._skip_b = w, b
        self._log_batch = float(np.log(global_batch))
        self._set_mean = np.asarray(net.set_norm.mean, dtype=np.float32)
        self._set_std = np.asarray(net.set_norm.std, dtype=np.float32)
        if len(self._set_mean) != len(SET_FEATURES):
            raise ValueError("cost model set features do not match this code")

    def seconds(self, summed: F32, counts: npt.NDArray[np.int64]) -> F32:
        """``summed [..., H]`` encodings of kernels of ``counts [...]`` tables → seconds
        ``[..., 2]`` (fwd, bwd). A kernel of 0 tables costs 0."""
        shape = counts.shape
        flat = summed.reshape(-1, summed.shape[-1])
        n = counts.reshape(-1)
        sets = np.empty((flat.shape[0], 2), dtype=np.float32)
        sets[:, 0] = self._log_batch
        sets[:, 1] = np.log(np.maximum(n, 1))
        x = np.concatenate([np.log(flat + 1e-9), (sets - self._set_mean) / self._set_std], axis=1)
        h = x
        for i, (w, b) in enumerate(self._layers):
            h = h @ w + b
            if i < len(self._layers) - 1:
                np.maximum(h, 0.0, out=h)
        out = np.exp(np.clip(h + x @ self._skip_w + self._skip_b, -30.0, 15.0) + self._log_speed)
        out[n == 0] = 0.0
        result: F32 = out.reshape(*shape, 2).astype(np.float32)
        return result
