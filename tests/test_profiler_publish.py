"""Publishing through ConfigMaps: format, chunking, verification, and the API calls."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import V1ConfigMap, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from shardwise import names
from shardwise.basics import UserError
from shardwise.profiler.dataset.store import CostDataset
from shardwise.profiler.fingerprint import Fingerprint
from shardwise.profiler.publish import (
    CONFIGMAP_LIMIT_BYTES,
    build_configmaps,
    check_name,
    pack,
    publish,
    read_members,
    unpack,
    unpack_archive,
)

DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
KW: dict[str, Any] = {"job": "ads-ranker", "component": "profiler", "fingerprint_key": "abc123"}


def big_payload(size: int = 2_500_000) -> bytes:
    return os.urandom(size)  # incompressible: forces several chunks


def test_small_payload_is_one_configmap() -> None:
    archive = pack(b'{"hello": 1}', "result.json")
    [cm] = build_configmaps(archive, "ads-ranker-profile", "team-a", **KW)
    assert cm["apiVersion"] == "v1" and cm["kind"] == "ConfigMap"
    meta = cm["metadata"]
    assert meta["name"] == "ads-ranker-profile-0" and meta["namespace"] == "team-a"
    assert meta["labels"] == {names.LABEL_JOB: "ads-ranker", names.LABEL_COMPONENT: "profiler"}
    ann = meta["annotations"]
    assert ann[names.ANN_CHUNK_INDEX] == "0" and ann[names.ANN_CHUNK_COUNT] == "1"
    assert ann[names.ANN_FINGERPRINT] == "abc123" and len(ann[names.ANN_SHA]) == 64
    assert list(cm["binaryData"]) == [names.PAYLOAD_KEY]
    assert read_members(unpack_archive([cm])) == {"result.json": b'{"hello": 1}'}
    json.dumps(cm)  # a plain JSON body


def test_large_payload_is_chunked_under_the_limit() -> None:
    data = big_payload()
    archive = pack(data, "model.pt")
    cms = build_configmaps(
        archive, "ads-ranker-costmodel", "ns", **{**KW, "component": "costmodel"}
    )
    assert len(cms) == 3
    for i, cm in enumerate(cms):
        assert cm["metadata"]["name"] == f"ads-ranker-costmodel-{i}"
        assert cm["metadata"]["annotations"][names.ANN_CHUNK_COUNT] == "3"
        assert cm["metadata"]["labels"][names.LABEL_COMPONENT] == "costmodel"
        decoded = base64.b64decode(cm["binaryData"][names.PAYLOAD_KEY])
        assert len(decoded) <= 900 * 1024 < CONFIGMAP_LIMIT_BYTES
        assert len(json.dumps(cm)) < 1.5 * CONFIGMAP_LIMIT_BYTES  # the request, base64 and all
    shuffled = [cms[2], cms[0], cms[1]]
    assert read_members(unpack_archive(shuffled)) == {"model.pt": data}


def test_bodies_are_deterministic() -> None:
    a = build_configmaps(pack(b"x" * 5000), "p", "ns", **KW)
    b = build_configmaps(pack(b"x" * 5000), "p", "ns", **KW)
    assert a == b


def test_missing_chunk_is_detected() -> None:
    cms = build_configmaps(pack(big_payload()), "p", "ns", **KW)
    with pytest.raises(UserError, match=r"incomplete: 1 of 3 chunks missing \(p-1\)"):
        unpack_archive([cms[0], cms[2]])
    with pytest.raises(UserError, match="expected one chunk 0, found 0"):
        unpack_archive(cms[1:])


def test_corrupted_chunk_is_detected() -> None:
    cms = build_configmaps(pack(big_payload()), "p", "ns", **KW)
    bad = copy.deepcopy(cms)
    raw = bytearray(base64.b64decode(bad[1]["binaryData"][names.PAYLOAD_KEY]))
    raw[100] ^= 0xFF
    bad[1]["binaryData"][names.PAYLOAD_KEY] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(UserError, match=r"chunk 1 \(p-1\) is corrupted"):
        unpack_archive(bad)
    # A chunk consistent with its own sha256 but not with the whole is caught too.
    forged = copy.deepcopy(bad)
    forged[1]["metadata"]["annotations"][names.ANN_CHUNK_SHA] = hashlib.sha256(raw).hexdigest()
    with pytest.raises(UserError, match="reassembled archive is corrupted"):
        unpack_archive(forged)


def test_stale_chunks_of_an_older_publication_are_ignored() -> None:
    old = build_configmaps(pack(big_payload()), "p", "ns", **KW)  # 3 chunks
    new = build_configmaps(pack(b"small now", "f"), "p", "ns", **KW)  # 1 chunk, replaces p-0
    assert read_members(unpack_archive([new[0], old[1], old[2]])) == {"f": b"small now"}


def test_accepts_client_objects_and_picks_the_named_payload() -> None:
    cms = build_configmaps(pack(b"abc", "f"), "first", "ns", **KW)
    cms += build_configmaps(pack(b"def", "f"), "second", "ns", **KW)
    objs = [
        V1ConfigMap(
            metadata=V1ObjectMeta(
                name=c["metadata"]["name"], annotations=c["metadata"]["annotations"]
            ),
            binary_data=c["binaryData"],
        )
        for c in cms
    ]
    assert read_members(unpack_archive(objs, "second")) == {"f": b"def"}
    with pytest.raises(UserError, match="several published payloads"):
        unpack_archive(objs)


def test_names_are_valid_and_bounded() -> None:
    longest_ok = "a" * 249  # "-998" makes 253
    check_name(longest_ok)
    names = [c["metadata"]["name"] for c in build_configmaps(pack(b"x"), longest_ok, "n", **KW)]
    assert all(DNS1123.match(n) and len(n) <= 253 for n in names)
    for bad in ("a" * 250, "Upper", "under_score", "-lead", "trail-", ""):
        with pytest.raises(UserError, match="cannot name the published ConfigMaps"):
            check_name(bad)
    with pytest.raises(UserError, match="not a valid label value"):
        build_configmaps(pack(b"x"), "p", "ns", **{**KW, "job": "j" * 64})


def test_directory_round_trip(tmp_path: Path) -> None:
    fp = Fingerprint("cpu:Test", "cpu", 2, "2.13.0", "1.8.0", "3.11.7")
    src = tmp_path / "ds"
    with CostDataset.create_or_open(src, "comm", fp, {"seed": 1}) as ds:
        ds.append(
            0,
            {
                "batch_size": 64,
                "world_size": 2,
                "dims": [4, 8],
                "delays_s": [0.0, 0.01],
                "fwd_s": [0.1, 0.2],
                "bwd_s": [0.1, 0.2],
                "fwd_cv": [0.0, 0.0],
                "bwd_cv": [0.0, 0.0],
                "repeats": 10,
            },
        )
    (src / "sub").mkdir()
    (src / "sub" / "note.txt").write_text("nested")
    cms = build_configmaps(pack(src), "p", "ns", **KW)
    out = unpack(cms, tmp_path / "out")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "dataset.json",
        "records.jsonl",
        "sub/note.txt",
    ]
    assert CostDataset.open(out).dataset_hash() == CostDataset.open(src).dataset_hash()
    assert pack(src) == pack(src)  # deterministic archive


def test_pack_refuses_links_and_empty_dirs(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="no files"):
        pack(tmp_path / "d")
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "f")
    with pytest.raises(UserError, match="not links"):
        pack(tmp_path / "d")
    with pytest.raises(UserError, match="nothing to publish"):
        pack(tmp_path / "missing")


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=20_000),
    chunk=st.integers(min_value=64, max_value=4096),
    name=st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?\Z"),
)
def test_pack_unpack_round_trip_property(data: bytes, chunk: int, name: str) -> None:
    cms = build_configmaps(pack(data, "blob"), name, "ns", chunk_bytes=chunk, **KW)
    assert all(len(base64.b64decode(c["binaryData"][names.PAYLOAD_KEY])) <= chunk for c in cms)
    assert [int(c["metadata"]["annotations"][names.ANN_CHUNK_INDEX]) for c in cms] == list(
        range(len(cms))
    )
    assert read_members(unpack_archive(reversed(cms))) == {"blob": data}


class FakeCoreV1:
    """Records calls to the two CoreV1Api methods publish() uses; 409 for existing names."""

    def __init__(self, existing: set[str] | None = None) -> None:
        self.existing = set(existing or ())
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []

    def create_namespaced_config_map(self, namespace: str, body: Any, **_: Any) -> Any:
        name = body["metadata"]["name"]
        self.calls.append(("create", namespace, name, body))
        if name in self.existing:
            raise ApiException(status=409, reason="AlreadyExists")
        self.existing.add(name)
        return body

    def replace_namespaced_config_map(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        self.calls.append(("replace", namespace, name, body))
        return body


def test_publish_creates_chunk_zero_last_and_replaces_existing() -> None:
    api = FakeCoreV1(existing={"prof-1"})
    data = big_payload()
    names = publish(data, "prof", "team-a", api, filename="model.pt", **KW)
    assert names == ["prof-0", "prof-1", "prof-2"]
    assert [(c[0], c[1], c[2]) for c in api.calls] == [
        ("create", "team-a", "prof-1"),
        ("replace", "team-a", "prof-1"),
        ("create", "team-a", "prof-2"),
        ("create", "team-a", "prof-0"),  # the commit point goes last
    ]
    bodies = {c[2]: c[3] for c in api.calls}  # the replace resent the same body
    assert read_members(unpack_archive(bodies.values())) == {"model.pt": data}
    assert all(b["metadata"]["namespace"] == "team-a" for b in bodies.values())


def test_publish_passes_owner_references_and_propagates_other_errors() -> None:
    owner = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "DLRMJob", "name": "j", "uid": "u"}
    api = FakeCoreV1()
    publish(b"x", "p", "ns", api, owner_references=[owner], **KW)
    assert api.calls[0][3]["metadata"]["ownerReferences"] == [owner]

    class Forbidden(FakeCoreV1):
        def create_namespaced_config_map(self, namespace: str, body: Any, **_: Any) -> Any:
            raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(ApiException):
        publish(b"x", "p", "ns", Forbidden(), **KW)
