"""The cost-model file: both networks, their normalization and metadata in one torch
file that loads with ``weights_only=True`` (plain dicts, lists and tensors only, so
no class path is pickled); and the pre-trained CPU model bundled with the package.

A file is checked whole when it loads (docs/design.md §7: loaded weights-only and
validated): every tensor's shape against the network its config describes, every
weight and normalizer finite, each normalizer as long as its feature list. A model
that passes cannot silently predict NaN or mis-scaled costs; one that fails is a
:class:`UserError` naming the file, the field and what to do.

A model calibrated on a machine (``shardwise calibrate``, docs/calibration.md) carries
``metadata["calibration"]["speed_factors"]``: the machine's speed relative to the
networks, one factor for forward compute, backward compute and the all-to-all. The
predictor multiplies its seconds by them; a model without them has factors 1. They
are checked like weights: a factor that is not a finite number > 0 would scale every
prediction to nonsense, so such a file is refused.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.comm.learned import learned_collectives
from shardwise.planner.costmodel.features import (
    RANK_FEATURES,
    SET_FEATURES,
    TABLE_FEATURES,
    Normalizer,
)
from shardwise.planner.costmodel.networks import CommNet, ComputeNet

#: Bump when the file layout or a feature's meaning changes; loaders refuse others.
FORMAT_VERSION = 1
FORMAT_NAME = "shardwise-costmodel"
BUNDLED_MODEL = Path(__file__).parents[1] / "data" / "costmodel-cpu.pt"
#: Bounds on a network's config: far above any trained model, low enough that a
#: damaged number cannot ask for terabytes.
MAX_HIDDEN = 4096
MAX_LAYERS = 16
RETRAIN = "Re-create it with `shardwise pretrain` (or `make pretrain` for the bundled one)."
SPEED_KEYS: tuple[str, ...] = ("fwd", "bwd", "comm")


@dataclass(frozen=True)
class SpeedFactors:
    """This machine's seconds over the networks' seconds, per part of the cost."""

    fwd: float = 1.0
    bwd: float = 1.0
    comm: float = 1.0

    def to_dict(self) -> dict[str, float]:
        return {"fwd": self.fwd, "bwd": self.bwd, "comm": self.comm}

    @property
    def identity(self) -> bool:
        return self.fwd == self.bwd == self.comm == 1.0


def speed_factors_of(metadata: Mapping[str, Any], source: str = "the cost model") -> SpeedFactors:
    """The factors in ``metadata["calibration"]["speed_factors"]`` (1 where absent);
    a :class:`UserError` naming the field when one is not a finite number > 0."""
    check = _Checker(source)
    calibration = metadata.get("calibration")
    if calibration is None:
        return SpeedFactors()
    calibration = check.mapping(calibration, "metadata.calibration")
    factors = calibration.get("speed_factors")
    if factors is None:
        return SpeedFactors()
    where = "metadata.calibration.speed_factors"
    factors = check.mapping(factors, where)
    unknown = sorted(str(k) for k in factors if k not in SPEED_KEYS)
    if unknown:
        check.fail(where, f"has unknown keys {unknown} (it holds {', '.join(SPEED_KEYS)})")
    values: dict[str, float] = {}
    for key in SPEED_KEYS:
        value = factors.get(key, 1.0)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            check.fail(
                f"{where}.{key}",
                f"is {value!r}, not a finite number > 0 (predictions are multiplied by it)",
            )
        values[key] = float(value)
    return SpeedFactors(**values)


@dataclass
class CostModel:
    """Both networks, their normalization and where they came from (one torch file)."""

    compute: ComputeNet
    comm: CommNet | None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Where it was read from, for messages about it ("the cost model" if built here).
    source: str = "the cost model"

    @property
    def fingerprint(self) -> dict[str, Any]:
        fp: dict[str, Any] = self.metadata.get("fingerprint", {})
        return fp

    @property
    def speed_factors(self) -> SpeedFactors:
        """What the predictor multiplies fwd, bwd and comm seconds by (1 if uncalibrated)."""
        return speed_factors_of(self.metadata, self.source)

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
        """Write the model file whole or not at all (a temporary file renamed over it)."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.to_payload(), tmp)
            tmp.replace(p)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise UserError(f"{p}: cannot write the cost model there ({err}).") from None

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model file; any damage or foreign file is a :class:`UserError`."""
        p = Path(path)
        if p.is_dir():
            inside = sorted(p.glob("*.pt"))
            example = inside[0] if len(inside) == 1 else p / "model.pt"
            raise UserError(
                f"{p} is a directory, not a cost model file: give the model file inside it, "
                f"e.g. --model {example}."
            )
        if not p.is_file():
            raise UserError(
                f"{p}: no such cost model file. Give the file `shardwise pretrain --out` "
                "wrote, or leave out --model for the bundled CPU model."
            )
        try:
            if p.stat().st_size == 0:
                raise EOFError
            with warnings.catch_warnings():  # torch warns about foreign pickles
                warnings.simplefilter("ignore")
                payload = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as err:  # a foreign file can make torch.load raise anything
            raise UserError(_unreadable(p, err)) from None
        return cls.from_payload(payload, str(p))

    @classmethod
    def from_payload(cls, payload: Any, source: str = "<model>") -> CostModel:
        """The model a loaded file describes, checked whole (see the module docstring)."""
        fmt = payload.get("format") if isinstance(payload, Mapping) else None
        if not isinstance(payload, Mapping) or not isinstance(fmt, str) or fmt != FORMAT_NAME:
            raise UserError(
                f"{source} is a torch file but not a Shardwise cost model "
                f"(no format {FORMAT_NAME!r}). {RETRAIN}"
            )
        version = payload.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:  # a tensor compares oddly
            raise UserError(
                f"{source} is a cost model of format version {repr(version)[:40]}; this Shardwise "
                f"reads version {FORMAT_VERSION}. Re-train it with this version "
                "(`shardwise pretrain`) or use the Shardwise that wrote it."
            )
        check = _Checker(source)
        metadata = payload.get("metadata")
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, Mapping):
            check.fail("metadata", f"is a {type(metadata).__name__}, not a mapping")
        fp = metadata.get("fingerprint")
        if fp is not None and not isinstance(fp, Mapping):
            check.fail("metadata.fingerprint", f"is a {type(fp).__name__}, not a mapping")
        speed_factors_of(metadata, source)
        learned_collectives(metadata, source)  # a damaged fit is refused as the file loads
        cp = check.mapping(payload.get("compute"), "compute")
        hidden = check.integer(cp, "compute.config", "hidden", 1, MAX_HIDDEN)
        layers = check.integer(cp, "compute.config", "layers", 0, MAX_LAYERS)
        compute = check.network(ComputeNet, cp, "compute", hidden, layers)
        norms = check.mapping(cp.get("norm"), "compute.norm")
        compute.table_norm = check.normalizer(norms, "compute.norm", "table", len(TABLE_FEATURES))
        compute.set_norm = check.normalizer(norms, "compute.norm", "set", len(SET_FEATURES))
        comm: CommNet | None = None
        if payload.get("comm") is not None:
            mp = check.mapping(payload["comm"], "comm")
            comm = check.network(
                CommNet, mp, "comm", check.integer(mp, "comm.config", "hidden", 1, MAX_HIDDEN)
            )
            comm.rank_norm = check.normalizer(
                check.mapping(mp.get("norm"), "comm.norm"), "comm.norm", "rank", len(RANK_FEATURES)
            )
            comm.eval()
        compute.eval()
        return cls(compute, comm, dict(metadata), source)


def _unreadable(path: Path, err: BaseException) -> str:
    """What a file torch cannot load is, in words, and what to do about it (never
    torch's advice to load without ``weights_only``, which Shardwise does not do)."""
    text = str(err)
    try:
        with open(path, "rb") as f:
            archive = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    except OSError:
        archive = False
    python_object = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if isinstance(err, EOFError) or "central directory" in text:
        what = "the file is empty or truncated"
    elif python_object:
        what = (
            "it is not a Shardwise cost model: it holds Python objects (such as "
            f"{python_object[1]}) that a weights-only load refuses, and Shardwise loads "
            "models no other way (a cost model holds only tensors, numbers and strings)"
        )
    elif archive:
        what = "the file is truncated or corrupt (a torch archive that cannot be read)"
    else:
        what = "it is not a torch file, nor anything `shardwise pretrain` writes"
    return f"{path}: {what}. {RETRAIN}"


class _Checker:
    """Field-by-field checks of a loaded payload; each failure names the file and field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> NoReturn:
        raise UserError(f"{self.source} is a damaged cost model: {where} {what}. {RETRAIN}")

    def mapping(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            self.fail(where, f"is a {type(value).__name__}, not a mapping")
        return value

    def integer(self, part: Mapping[str, Any], where: str, key: str, lo: int, hi: int) -> int:
        value = self.mapping(part.get("config"), where).get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(f"{where}.{key}", f"is {value!r}, not a whole number in {lo}..{hi}")
        return int(value)

    def network(self, cls: type[Any], part: Mapping[str, Any], where: str, *config: int) -> Any:
        """``cls(*config)`` holding the file's weights, once every name, shape and value
        is right (the shapes are compared on the meta device: nothing is allocated)."""
        state = self.mapping(part.get("state_dict"), f"{where}.state_dict")
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in cls(*config).state_dict().items()}
        missing = sorted(set(want) - set(state))
        extra = sorted(set(state) - set(want))
        if missing or extra:
            self.fail(
                f"{where}.state_dict",
                f"does not match its config {list(config)} (missing {missing[:4]}, "
                f"unexpected {extra[:4]})",
            )
        for key, shape in want.items():
            tensor = state[key]
            name = f"{where}.state_dict[{key!r}]"
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                self.fail(name, "is not a tensor of floats")
            if tuple(tensor.shape) != shape:
                self.fail(name, f"has shape {list(tensor.shape)}; its config needs {list(shape)}")
            if not bool(torch.isfinite(tensor).all()):
                self.fail(name, "holds NaN or infinite weights")
        net = cls(*config)
        net.load_state_dict({k: state[k].to(torch.float32) for k in want})
        return net

    def normalizer(self, norms: Mapping[str, Any], where: str, key: str, n: int) -> Normalizer:
        """A normalizer of ``n`` features: finite means, finite positive stds."""
        part = self.mapping(norms.get(key), f"{where}.{key}")
        out: dict[str, list[float]] = {}
        for name in ("mean", "std"):
            values = part.get(name)
            field_name = f"{where}.{key}.{name}"
            if not isinstance(values, list | tuple) or len(values) != n:
                got = len(values) if isinstance(values, list | tuple) else type(values).__name__
                self.fail(field_name, f"has {got} values; the model has {n} features")
            if not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in values
            ):
                self.fail(field_name, "holds a value that is not a finite number")
            out[name] = [float(v) for v in values]
        if any(v <= 0 for v in out["std"]):
            self.fail(f"{where}.{key}.std", "holds a value <= 0 (features are divided by it)")
        return Normalizer(out["mean"], out["std"])


def load_bundled() -> CostModel:
    """The pre-trained CPU model shipped in the package (works offline)."""
    if not BUNDLED_MODEL.is_file():
        raise UserError(
            f"the bundled cost model {BUNDLED_MODEL} is missing from this installation. "
            "Re-create it with `make pretrain` (or pass a model file trained with "
            "`shardwise pretrain`)."
        )
    return CostModel.load(BUNDLED_MODEL)
