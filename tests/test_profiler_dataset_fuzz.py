"""Random, malformed and extreme manifests and records fed to the dataset loader: the
only outcomes allowed are a valid dataset or a UserError naming the file."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from test_profiler_dataset import FP, comm_record, compute_record

from shardwise.basics import UserError
from shardwise.profiler.dataset.store import (
    MANIFEST_FILE,
    RECORDS_FILE,
    SCHEMA_VERSION,
    CostDataset,
)

SETTINGS = {"seed": 0, "batch_size": 512}
EXTREME_NUMBERS = [0, -1, -0.0, 1e-320, 1e308, 2**63, -(2**63), 10**40, 0.5]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from(EXTREME_NUMBERS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "\x00", "\ud800", "\n", "é" * 100])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _valid_record(kind: str, index: int) -> dict[str, Any]:
    body = compute_record(index) if kind == "compute" else comm_record(2 + 2 * (index % 2))
    return {"index": index, "fingerprint": FP.key(), **body}


def _valid_manifest(kind: str) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "fingerprint": FP.to_dict(),
        "fingerprint_key": FP.key(),
        "created_at": "2025-01-01T00:00:00+00:00",
        "settings": dict(SETTINGS),
        "fingerprints": {FP.key(): FP.to_dict()},
        "other_settings": [],
    }


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with a few fields (nested ones too) replaced, removed or added."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(0, 3))):
        target: Any = doc
        while True:  # walk down into a nested object or list now and then
            keys = list(target) if isinstance(target, dict) else list(range(len(target)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if isinstance(target[key], dict | list) and draw(st.booleans()):
                target = target[key]
                continue
            break
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if isinstance(target, dict) and (action == "add" or not target):
            target[draw(st.text(max_size=8))] = draw(json_values)
        elif keys and action == "delete":
            del target[key]
        elif keys:
            target[key] = draw(json_values)
    return doc


def _line(draw: st.DrawFn, kind: str, index: int) -> bytes:
    choice = draw(st.sampled_from(["valid", "valid", "mutated", "json", "bytes"]))
    if choice == "valid":
        return json.dumps(_valid_record(kind, index)).encode()
    if choice == "mutated":
        return json.dumps(draw(mutated(_valid_record(kind, index)))).encode()
    if choice == "json":
        return json.dumps(draw(json_values)).encode()
    return draw(st.binary(max_size=40)).replace(b"\n", b" ")


@st.composite
def records_file(draw: st.DrawFn, kind: str) -> bytes:
    n = draw(st.integers(0, 6))
    lines = [_line(draw, kind, draw(st.integers(0, 8))) + b"\n" for _ in range(n)]
    if draw(st.booleans()):  # a torn last line
        tail = _line(draw, kind, 9)
        lines.append(tail[: draw(st.integers(0, len(tail)))])
    return b"".join(lines)


@st.composite
def manifest_file(draw: st.DrawFn, kind: str) -> bytes:
    choice = draw(st.sampled_from(["valid", "mutated", "mutated", "json", "bytes"]))
    if choice == "valid":
        return json.dumps(_valid_manifest(kind)).encode()
    if choice == "mutated":
        return json.dumps(draw(mutated(_valid_manifest(kind)))).encode()
    if choice == "json":
        return json.dumps(draw(json_values)).encode()
    return draw(st.binary(max_size=60))


def _note(label: str) -> None:
    """Count outcomes in hypothesis' statistics (--hypothesis-show-statistics)."""
    if currently_in_test_context():
        event(label)


def _assert_names_a_file(d: Path, err: UserError) -> None:
    msg = str(err)
    _note("refused: " + ("manifest" if str(d / MANIFEST_FILE) in msg else "records"))
    assert str(d / MANIFEST_FILE) in msg or str(d / RECORDS_FILE) in msg, msg


def _load(d: Path) -> None:
    """Everything a reader does; a UserError must name the manifest or the records."""
    try:
        ds = CostDataset.open(d)
        records = ds.load()
        assert len(ds) == len(records) == len(ds.done_indices())
        assert len(ds.dataset_hash()) == 64
        assert ds.fingerprint.key()
        _note(f"loaded {len(records)} records")
    except UserError as err:
        _assert_names_a_file(d, err)


def _resume(d: Path, kind: str, allow_mismatch: bool) -> None:
    """What a resumed run does: open to write, cut a torn tail, append a sample. It
    never deletes a complete line: only an unterminated last one is a torn write."""
    records = d / RECORDS_FILE
    before = records.read_bytes() if records.exists() else b""
    try:
        with CostDataset.create_or_open(
            d,
            kind,
            FP,
            SETTINGS,
            allow_mismatch=allow_mismatch,  # type: ignore[arg-type]
        ) as ds:
            record = _valid_record(kind, 0)
            del record["index"], record["fingerprint"]  # append fills both in
            ds.append(max(ds.done_indices(), default=-1) + 1, record)
    except UserError as err:
        _assert_names_a_file(d, err)
        return
    assert records.read_bytes().startswith(before[: before.rfind(b"\n") + 1])
    assert CostDataset.open(d).load()[-1]  # what was appended reads back
    _note("resumed")


def _fill(manifest: bytes | None, records: bytes) -> Path:
    d = Path(tempfile.mkdtemp(prefix="fuzz-ds-"))
    if manifest is not None:
        (d / MANIFEST_FILE).write_bytes(manifest)
    (d / RECORDS_FILE).write_bytes(records)
    return d


KINDS = st.sampled_from(["compute", "comm"])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(manifest: bytes | None, records: bytes, kind: str, allow_mismatch: bool) -> None:
    d = _fill(manifest, records)
    try:
        _load(d)
        _resume(d, kind, allow_mismatch)
        _load(d)
    finally:
        shutil.rmtree(d)


@FUZZ
@given(data=st.data(), kind=KINDS, allow_mismatch=st.booleans())
def test_random_datasets_load_or_name_the_file(
    data: st.DataObject, kind: str, allow_mismatch: bool
) -> None:
    manifest = data.draw(st.none() | manifest_file(kind))
    _check(manifest, data.draw(records_file(kind)), kind, allow_mismatch)


def _manifest_with(**fields: Any) -> bytes:
    return json.dumps({**_valid_manifest("compute"), **fields}).encode()


def _deep(depth: int) -> bytes:
    """A manifest whose settings nest ``depth`` lists deep (json.dumps cannot write it)."""
    deep = b"[" * depth + b"0" + b"]" * depth
    return _manifest_with(settings={"seed": "DEEP"}).replace(b'"DEEP"', deep)


OTHER_FP = {**FP.to_dict(), "cores": 64}
GOOD_RECORD = json.dumps(_valid_record("compute", 0)).encode() + b"\n"


@pytest.mark.parametrize(
    ("manifest", "records"),
    [
        (b"[" * 100_000 + b"]" * 100_000, b""),  # deeper than json can read
        (_deep(985), b""),  # json reads it, then recurses
        (_manifest_with(settings={"note": "\ud800"}, fingerprint=OTHER_FP), b""),
        (_manifest_with(created_at=2**64), b""),
        (None, b'{"extra": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"),
        (None, GOOD_RECORD.replace(b'"repeats": 10', b'"repeats": 10, "extra": {"x": NaN}')),
        (None, GOOD_RECORD.replace(b'"access_hist": [1.0', b'"access_hist": [NaN')),
        (None, GOOD_RECORD.replace(b'"fwd_s": 0.001', b'"fwd_s": 1e999')),
        (None, GOOD_RECORD.replace(b'"index": 0', b'"index": 18446744073709551616')),
        (None, GOOD_RECORD.replace(b'"rows": 1000', b'"rows": 1e400')),
        (None, GOOD_RECORD.replace(b'"repeats": 10', b'"repeats": 10, "extra": {"x": "\\ud800"}')),
        (None, GOOD_RECORD + b"\xff\xfe\n"),
        (None, GOOD_RECORD + GOOD_RECORD[:-30]),
    ],
)
@pytest.mark.parametrize("allow_mismatch", [False, True])
def test_extreme_datasets_load_or_name_the_file(
    manifest: bytes | None, records: bytes, allow_mismatch: bool
) -> None:
    if manifest is None:
        manifest = _manifest_with()
    _check(manifest, records, "compute", allow_mismatch)


@FUZZ
@given(kind=KINDS, records=st.data())
def test_random_records_under_a_valid_manifest(kind: str, records: st.DataObject) -> None:
    """The records alone, so that most examples get past the manifest."""
    _check(
        json.dumps(_valid_manifest(kind)).encode(), records.draw(records_file(kind)), kind, False
    )
