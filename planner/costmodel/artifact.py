"""The cost-model file: both networks, their normalization and metadata in one torch
file that loads with ``weights_only=True`` (plain dicts, lists and tensors only, so
no class path is pickled); and the pre-trained CPU model bundled with the package.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.costmodel.features import Normalizer
from shardwise.planner.costmodel.networks import CommNet, ComputeNet

#: Bump when the file layout or a feature's meaning changes; loaders refuse others.
FORMAT_VERSION = 1
FORMAT_NAME = "shardwise-costmodel"
BUNDLED_MODEL = Path(__file__).parents[1] / "data" / "costmodel-cpu.pt"


@dataclass
class CostModel:
    """Both networks, their normalization and where they came from (one torch file)."""

    compute: ComputeNet
    comm: CommNet | None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> dict[str, Any]:
        fp: dict[str, Any] = self.metadata.get("fingerprint", {})
        return fp

    def to_payload(self) -> dict[str, Any]:
        def net(n: nn.Module, norms: dict[str, Normalizer], config: dict[str, int]) -> Any:
            return {
                "config": config,
                "norm": {k: v.to_dict() for k, v in norms.items()},
                "state_dict": {k: v.detach().clone() for k, v in n.state_dict().items()},
            }

        c = self.compute
        payload: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "compute": net(
                c,
                {"table": c.table_norm, "set": c.set_norm},
                {"hidden": c.hidden, "layers": c.layers},
            ),
            "comm": None,
        }
        if self.comm is not None:
            payload["comm"] = net(
                self.comm, {"rank": self.comm.rank_norm}, {"hidden": self.comm.hidden}
            )
        return payload

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        torch.save(self.to_payload(), tmp)
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model file; any damage or foreign file is a :class:`UserError`."""
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{p}: no such cost model file.")
        try:
            payload = torch.load(p, map_location="cpu", weights_only=True)
        except (
            RuntimeError,
            EOFError,
            OSError,
            ValueError,
            pickle.UnpicklingError,
            zipfile.BadZipFile,
            AttributeError,
            KeyError,
            TypeError,
        ) as err:
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err)
            raise UserError(
                f"{p} is not a readable cost model file (truncated or corrupt?): {first}. "
                "Re-create it with `shardwise pretrain` (or `make pretrain`)."
            ) from None
        return cls.from_payload(payload, str(p))

    @classmethod
    def from_payload(cls, payload: Any, source: str = "<model>") -> CostModel:
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise UserError(
                f"{source} is a torch file but not a Shardwise cost model "
                f"(no format {FORMAT_NAME!r})."
            )
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise UserError(
                f"{source} is a cost model of format version {version!r}; this Shardwise "
                f"reads version {FORMAT_VERSION}. Re-train it with this version "
                "(`shardwise pretrain`) or use the Shardwise that wrote it."
            )
        try:
            cp = payload["compute"]
            compute = ComputeNet(int(cp["config"]["hidden"]), int(cp["config"]["layers"]))
            compute.load_state_dict(cp["state_dict"])
            compute.table_norm = Normalizer.from_dict(cp["norm"]["table"])
            compute.set_norm = Normalizer.from_dict(cp["norm"]["set"])
            comm: CommNet | None = None
            if payload.get("comm") is not None:
                mp = payload["comm"]
                comm = CommNet(int(mp["config"]["hidden"]))
                comm.load_state_dict(mp["state_dict"])
                comm.rank_norm = Normalizer.from_dict(mp["norm"]["rank"])
            metadata = dict(payload.get("metadata") or {})
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise UserError(
                f"{source} is a damaged cost model ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else ''})."
            ) from None
        compute.eval()
        if comm is not None:
            comm.eval()
        return cls(compute, comm, metadata)


def load_bundled() -> CostModel:
    """The pre-trained CPU model shipped in the package (works offline)."""
    if not BUNDLED_MODEL.is_file():
        raise UserError(
            f"the bundled cost model {BUNDLED_MODEL} is missing from this installation. "
            "Re-create it with `make pretrain` (or pass a model file trained with "
            "`shardwise pretrain`)."
        )
    return CostModel.load(BUNDLED_MODEL)
