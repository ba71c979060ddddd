"""Publishing a result (a cost dataset, a model file) through the Kubernetes API.

A profiling pod (docs/design.md §1) has no volume the operator can read, so it hands its
result back as ConfigMaps: the payload is packed into a deterministic ``tar.gz``
and split into chunks of at most ``chunk_bytes`` (900 KiB by default) placed in
``binaryData`` under the key :data:`names.PAYLOAD_KEY`, one chunk per ConfigMap. The API
server limits a ConfigMap's data to 1 MiB (counted on the decoded bytes; the request
carries base64, 4/3 of that, well under the request limit), so 900 KiB leaves room.

Names: chunk ``i`` of ``name`` is ``<name>-<i>``. Every chunk carries the labels
``shardwise.dev/job`` and ``shardwise.dev/component`` (docs/design.md §3) and annotations with
its index, the chunk count, its own sha256, the whole archive's sha256, the payload
name and the fingerprint key. :func:`publish` writes chunks 1..n-1 first and chunk 0
last: chunk 0 is the commit point, and :func:`unpack_archive` takes the set named by
the chunk-0 it finds, so a reader never mixes two publications (stale chunks of an
older, longer publication are ignored by their sha256).

The builders are pure functions returning plain dicts (what the official client
accepts as a body); :func:`publish` is the only code that talks to the API.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import re
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from shardwise import apiclient, names
from shardwise.basics import UserError

#: The API server's limit on a ConfigMap's data (decoded bytes).
CONFIGMAP_LIMIT_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 900 * 1024
MAX_NAME_LEN = 253
MAX_CHUNKS = 999

Component = Literal["profiler", "costmodel"]
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class ConfigMapApi(Protocol):
    """The two methods of ``kubernetes.client.CoreV1Api`` that :func:`publish` calls."""

    def create_namespaced_config_map(self, namespace: str, body: Any, **kwargs: Any) -> Any: ...

    def replace_namespaced_config_map(
        self, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any: ...


# --------------------------------------------------------------------------- packing


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(source: str | Path | bytes, filename: str = "payload") -> bytes:
    """A deterministic ``tar.gz`` of a directory, a file, or bytes (as ``filename``).

    Deterministic (sorted members, zero mtimes and owners, no gzip timestamp) so the
    same content gives the same bytes, sha256 and chunks: republishing an unchanged
    result changes nothing. Symbolic links and other special files are refused.
    """
    members: list[tuple[str, bytes]] = []
    if isinstance(source, bytes):
        members.append((filename, source))
    else:
        root = Path(source)
        if root.is_symlink() or not root.exists():
            raise UserError(f"{root}: nothing to publish there (missing or a link).")
        if root.is_file():
            members.append((root.name, root.read_bytes()))
        else:
            for path in sorted(root.rglob("*")):
                rel = path.relative_to(root).as_posix()
                if path.is_symlink() or not (path.is_file() or path.is_dir()):
                    raise UserError(f"{path}: only plain files can be published, not links.")
                if path.is_file():
                    members.append((rel, path.read_bytes()))
            if not members:
                raise UserError(f"{root}: the directory holds no files to publish.")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)


def _members(archive: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for info in tar:
            if not info.isfile():
                raise UserError(f"published archive holds a non-file member {info.name!r}.")
            f = tar.extractfile(info)
            assert f is not None  # a regular file always has a stream
            out.append((info, f.read()))
    return out


def read_members(archive: bytes) -> dict[str, bytes]:
    """The files of a :func:`pack` archive, in memory (path → bytes)."""
    return {info.name: data for info, data in _members(archive)}


def extract(archive: bytes, dest: str | Path) -> Path:
    """Unpack a :func:`pack` archive under ``dest`` (safe paths only: tarfile's
    ``data`` filter refuses absolute paths, ``..`` and links)."""
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        try:
            tar.extractall(d, filter="data")
        except tarfile.FilterError as err:
            raise UserError(f"published archive has an unsafe member: {err}") from None
    return d


# --------------------------------------------------------------------------- naming


def chunk_name(name: str, index: int) -> str:
    return f"{name}-{index}"


def check_name(name: str, chunks: int = MAX_CHUNKS) -> None:
    """``name`` must leave every ``<name>-<i>`` a valid ConfigMap name (DNS-1123
    subdomain, ≤ 253 characters)."""
    longest = chunk_name(name, max(chunks - 1, 0))
    if not _DNS1123_SUBDOMAIN.match(name) or len(longest) > MAX_NAME_LEN:
        raise UserError(
            f"{name!r} cannot name the published ConfigMaps: use lowercase letters, digits, "
            f"'-' and '.', starting and ending with a letter or digit, at most "
            f"{MAX_NAME_LEN - len(longest) + len(name)} characters."
        )


def _check_label(key: str, value: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise UserError(
            f"label {key}={value!r} is not a valid label value (at most 63 letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit)."
        )


# --------------------------------------------------------------------------- building


def build_configmaps(
    archive: bytes,
    name: str,
    namespace: str,
    *,
    job: str,
    component: Component,
    fingerprint_key: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    owner_references: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The ConfigMap bodies (chunk 0 first) that carry ``archive``.

    Pure: the same arguments give the same bodies. ``labels``/``annotations`` are
    added to the standard ones; ``owner_references`` lets the operator tie the
    objects to its DLRMJob.
    """
    if not 0 < chunk_bytes <= CONFIGMAP_LIMIT_BYTES - 4096:
        raise ValueError(f"chunk_bytes must be in 1..{CONFIGMAP_LIMIT_BYTES - 4096}")
    if not archive:
        raise ValueError("nothing to publish: the archive is empty")
    if component not in ("profiler", "costmodel"):
        raise ValueError(f"component must be profiler or costmodel, not {component!r}")
    chunks = [archive[i : i + chunk_bytes] for i in range(0, len(archive), chunk_bytes)]
    if len(chunks) > MAX_CHUNKS:
        raise UserError(
            f"the result is {len(archive)} bytes compressed, {len(chunks)} ConfigMaps of "
            f"{chunk_bytes} bytes; more than {MAX_CHUNKS} is not a sensible use of the API."
        )
    check_name(name, len(chunks))
    _check_label(names.LABEL_JOB, job)
    total_sha = hashlib.sha256(archive).hexdigest()
    all_labels = {**(labels or {}), names.LABEL_JOB: job, names.LABEL_COMPONENT: component}
    bodies = []
    for i, chunk in enumerate(chunks):
        ann = {
            **(annotations or {}),
            names.ANN_PAYLOAD: name,
            names.ANN_CHUNK_INDEX: str(i),
            names.ANN_CHUNK_COUNT: str(len(chunks)),
            names.ANN_CHUNK_SHA: hashlib.sha256(chunk).hexdigest(),
            names.ANN_SHA: total_sha,
            names.ANN_SIZE: str(len(archive)),
            names.ANN_FINGERPRINT: fingerprint_key,
        }
        metadata: dict[str, Any] = {
            "name": chunk_name(name, i),
            "namespace": namespace,
            "labels": dict(all_labels),
            "annotations": ann,
        }
        if owner_references:
            metadata["ownerReferences"] = [dict(o) for o in owner_references]
        bodies.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": metadata,
                "binaryData": {names.PAYLOAD_KEY: base64.b64encode(chunk).decode("ascii")},
            }
        )
    return bodies


# --------------------------------------------------------------------------- reading


def _as_dict(cm: Any) -> dict[str, Any]:
    """Accept plain dicts and the client's ``V1ConfigMap`` objects alike."""
    if isinstance(cm, Mapping):
        return dict(cm)
    meta = cm.metadata
    return {
        "metadata": {
            "name": meta.name,
            "annotations": dict(meta.annotations or {}),
            "labels": dict(meta.labels or {}),
        },
        "binaryData": dict(cm.binary_data or {}),
    }


def unpack_archive(configmaps: Iterable[Any], name: str | None = None) -> bytes:
    """Reassemble and verify the archive from its ConfigMaps (any order, extras ignored).

    Chunk 0 of ``name`` (or the only payload present) decides the publication; its
    siblings are those with the same archive sha256. Missing chunks, a chunk whose
    bytes do not match its sha256, or a whole that does not match raise UserError.
    """
    objs = [_as_dict(cm) for cm in configmaps]
    ours = []
    for cm in objs:
        ann = cm.get("metadata", {}).get("annotations") or {}
        if names.ANN_PAYLOAD in ann and (name is None or ann[names.ANN_PAYLOAD] == name):
            ours.append(cm)
    payloads = {cm["metadata"]["annotations"][names.ANN_PAYLOAD] for cm in ours}
    if name is None and len(payloads) > 1:
        raise UserError(f"several published payloads found ({sorted(payloads)}); name one.")
    label = name or (next(iter(payloads)) if payloads else "?")
    heads = [cm for cm in ours if cm["metadata"]["annotations"].get(names.ANN_CHUNK_INDEX) == "0"]
    if len(heads) != 1:
        raise UserError(
            f"published payload {label!r}: expected one chunk 0, found {len(heads)}; "
            "the publication is missing or incomplete."
        )
    head = heads[0]["metadata"]["annotations"]
    try:
        total_sha, count, size = (
            head[names.ANN_SHA],
            int(head[names.ANN_CHUNK_COUNT]),
            int(head[names.ANN_SIZE]),
        )
    except (KeyError, ValueError) as err:
        raise UserError(f"published payload {label!r}: chunk 0 lacks {err}.") from None
    by_index: dict[int, bytes] = {}
    for cm in ours:
        ann = cm["metadata"]["annotations"]
        if ann.get(names.ANN_SHA) != total_sha:
            continue  # a stale chunk of an earlier publication
        i = int(ann.get(names.ANN_CHUNK_INDEX, "-1"))
        if not 0 <= i < count:
            raise UserError(f"published payload {label!r}: chunk index {i} outside 0..{count - 1}.")
        data = base64.b64decode((cm.get("binaryData") or {}).get(names.PAYLOAD_KEY, ""))
        if hashlib.sha256(data).hexdigest() != ann.get(names.ANN_CHUNK_SHA):
            raise UserError(
                f"published payload {label!r}: chunk {i} ({cm['metadata'].get('name')}) is "
                "corrupted (its sha256 does not match). Publish again."
            )
        by_index[i] = data
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        absent = ", ".join(chunk_name(label, i) for i in missing[:5])
        raise UserError(
            f"published payload {label!r} is incomplete: {len(missing)} of {count} chunks "
            f"missing ({absent}). The publication was interrupted or is still running."
        )
    archive = b"".join(by_index[i] for i in range(count))
    if len(archive) != size or hashlib.sha256(archive).hexdigest() != total_sha:
        raise UserError(f"published payload {label!r}: the reassembled archive is corrupted.")
    return archive


def unpack(configmaps: Iterable[Any], dest: str | Path, name: str | None = None) -> Path:
    """Verify and extract the published payload under ``dest``; returns ``dest``."""
    return extract(unpack_archive(configmaps, name), dest)


# --------------------------------------------------------------------------- publishing


def publish(
    source: str | Path | bytes,
    name: str,
    namespace: str,
    api: ConfigMapApi,
    *,
    job: str,
    component: Component,
    fingerprint_key: str = "",
    filename: str = "payload",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    owner_references: Sequence[Mapping[str, Any]] | None = None,
) -> list[str]:
    """Pack ``source`` and create-or-replace its ConfigMaps; returns their names.

    Chunks 1..n-1 go first and chunk 0 last (the commit point, see module docstring).
    ``api`` is a ``kubernetes.client.CoreV1Api``; a 409 on create means the object
    exists (an earlier run, a restarted pod) and it is replaced.
    """
    from kubernetes.client.exceptions import ApiException

    bodies = build_configmaps(
        pack(source, filename),
        name,
        namespace,
        job=job,
        component=component,
        fingerprint_key=fingerprint_key,
        chunk_bytes=chunk_bytes,
        labels=labels,
        annotations=annotations,
        owner_references=owner_references,
    )
    for body in [*bodies[1:], bodies[0]]:
        try:
            api.create_namespaced_config_map(namespace, body)
        except ApiException as err:
            if err.status != 409:
                raise
            api.replace_namespaced_config_map(body["metadata"]["name"], namespace, body)
    return [b["metadata"]["name"] for b in bodies]


def core_v1_api() -> Any:
    """A ``CoreV1Api`` from the pod's service account, else the local kubeconfig
    (:func:`shardwise.apiclient.core_v1_api`, which the workers share)."""
    try:
        return apiclient.core_v1_api("Drop --publish to keep the result on disk only.")
    except UserError as err:
        raise UserError(f"cannot publish: {err}") from None


def parse_target(target: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` as given to ``--publish``."""
    namespace, sep, name = target.partition("/")
    if not sep or not namespace or not name:
        raise UserError(f"--publish wants NAMESPACE/NAME (e.g. ml/dj-costs-a100), not {target!r}.")
    return namespace, name
