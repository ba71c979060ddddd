"""A pod's container as a local process, for the local kubelet (:mod:`k8s.kubelet`):
its argv, environment and working directory, with its volumes made on the host.

- ``command`` + ``args``, ``$(VAR)`` expanded from the container's env as Kubernetes
  does; ``.venv/bin`` first on ``PATH`` (so ``python``, ``torchrun`` and ``shardwise``
  are ours); no image, so a container without a command is refused;
- env: the container's ``env`` (``value``; ``fieldRef`` to the pod's name, namespace,
  uid, node, service account, IP, labels and annotations, e.g. the Job controller's
  ``JOB_COMPLETION_INDEX``; ``configMapKeyRef`` and ``secretKeyRef``, a missing one
  the kubelet's ``CreateContainerConfigError``), ``HOSTNAME`` (the pod's hostname),
  ``KUBECONFIG`` (a file for the emulator: the stand-in for the service account's
  in-cluster access, with the token given for that account, if any), a ``TMPDIR`` of
  its own and the marker :data:`MARKER`; of the host's environment only ``PATH``,
  ``HOME``, the user and the locale;
- volumes: a ``configMap`` or ``secret`` is written as files (its keys, or its
  ``items``; a snapshot at start), an ``emptyDir`` is a directory per pod, a
  ``persistentVolumeClaim`` is one directory per claim, shared by every pod that mounts
  it (checkpoints survive a reshard). A process cannot mount at an absolute path, so
  **each volumeMount's mountPath is rewritten** to its directory wherever it starts a
  path in the command, args, env values and ``workingDir``;
- cluster DNS: ``<host>.<subdomain>[.<ns>[.svc[.cluster.local]]][:port]`` of the pod's
  own subdomain is rewritten to ``127.0.0.1`` and each port to a free one chosen per
  owning Job (pods of one Job meet at one port; its replacement gets another). Every
  pod sees that address as its own, so torchrun's c10d store is hosted by the first
  pod to start (torch's fallback), not necessarily index 0;
- pods share the host's network: ``SHARDWISE_METRICS_PORT`` (when the env does not set
  it) is a free block of 8 ports per pod, where in a cluster each pod has 9400.

Not done: images, ``envFrom``, ``resourceFieldRef``, projected and
other volume kinds (refused with a :class:`PodError`), ``subPath`` beyond a plain join,
read-only mounts, configMap updates after start, claims that must exist and be bound.
"""

from __future__ import annotations

import base64
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from k8s.helpers import ROOT
from k8s.jobcontroller import meta
from shardwise.operator.kube import KubeApi

#: Every process of a pod inherits ``LOCAL_KUBELET_POD=<uid>``: how the kubelet finds
#: them all, as a cgroup would hold them.
MARKER = "LOCAL_KUBELET_POD"
VENV_BIN = ROOT / ".venv" / "bin"
HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "LOGNAME")
METRICS_ENV = "SHARDWISE_METRICS_PORT"
METRICS_BLOCK = 8
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class PodError(Exception):
    """A pod the local kubelet cannot start (yet): its message goes in the pod's status."""


class ConfigError(PodError):
    """A container the kubelet cannot configure (an env var from a missing Secret or
    ConfigMap key): ``CreateContainerConfigError``, retried until it is there."""


@dataclass(frozen=True)
class Process:
    """What to start for a pod."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def free_port(taken: set[int], block: int = 1) -> int:
    """A port (the first of ``block`` consecutive ones) nothing listens on."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + block > 65535 or any(p in taken for p in range(base, base + block)):
            continue
        try:
            for port in range(base + 1, base + block):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        taken.update(range(base, base + block))
        return base
    raise RuntimeError("no free port block found")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables only; ``$$`` is ``$``."""
    return _VAR.sub(lambda h: "$" if h[0] == "$$" else env.get(h[1], h[0]), text)


class PodSpecs:
    """Turns pods into :class:`Process` es; keeps the ports it chose, per owning Job."""

    def __init__(
        self,
        kube: KubeApi,
        url: str,
        root: Path,
        tokens: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        self.kube, self.url, self.root = kube, url, root
        self.tokens = dict(tokens or {})
        self.ports: dict[tuple[str, str, str, str], int] = {}  # (owner, host, sub, port)
        self._taken: set[int] = set()

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The host directory standing for the claim's volume."""
        return self.root / "pvc" / namespace / claim

    def process(self, pod: Mapping[str, Any]) -> Process:
        """The pod's process to be: volumes made, env resolved, paths and names rewritten."""
        m, spec = meta(pod), pod.get("spec") or {}
        containers = spec.get("containers") or []
        if len(containers) != 1:
            raise PodError("the local kubelet runs pods of exactly one container")
        c = containers[0]
        pod_dir = self.root / "pods" / f"{m['namespace']}_{m['name']}"
        mounts = self._mounts(pod, c, pod_dir)
        env = self._container_env(pod, c)
        argv = [*(c.get("command") or []), *(c.get("args") or [])]
        if not c.get("command"):
            raise PodError("the local kubelet has no image entrypoint: give a command")
        argv = [expand(a, env) for a in argv]
        rewrite = self._rewriter(pod, mounts)
        argv = [rewrite(a) for a in argv]
        env = {k: rewrite(v) for k, v in env.items()}
        (pod_dir / "tmp").mkdir(parents=True, exist_ok=True)
        (pod_dir / "cwd").mkdir(exist_ok=True)
        base = {k: os.environ[k] for k in HOST_ENV if k in os.environ}
        base["PATH"] = f"{VENV_BIN}:{base.get('PATH', '/usr/bin:/bin')}"
        host = spec.get("hostname") or m["name"]
        sa = spec.get("serviceAccountName") or "default"
        kubelet_env = {
            "HOSTNAME": host,
            "KUBECONFIG": str(self._kubeconfig(m["namespace"], sa)),
            "TMPDIR": str(pod_dir / "tmp"),
        }
        if METRICS_ENV not in env:
            kubelet_env[METRICS_ENV] = str(free_port(self._taken, METRICS_BLOCK))
        full = {**base, **kubelet_env, **env, MARKER: m["uid"]}
        cwd = rewrite(c["workingDir"]) if c.get("workingDir") else str(pod_dir / "cwd")
        return Process(argv, full, cwd)

    def _mounts(
        self, pod: Mapping[str, Any], c: Mapping[str, Any], pod_dir: Path
    ) -> list[tuple[str, Path]]:
        volumes = {v["name"]: v for v in (pod.get("spec") or {}).get("volumes") or []}
        out = []
        for mount in c.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodError(f"volumeMount {mount['name']!r} names no volume of the pod")
            where = self._volume(pod, volume, pod_dir)
            if mount.get("subPath"):
                where = where / mount["subPath"]
                where.mkdir(parents=True, exist_ok=True)
            out.append((str(mount["mountPath"]).rstrip("/") or "/", where))
        return sorted(out, key=lambda mp: -len(mp[0]))

    def _volume(self, pod: Mapping[str, Any], volume: Mapping[str, Any], pod_dir: Path) -> Path:
        ns, name = str(meta(pod)["namespace"]), str(volume["name"])
        if "persistentVolumeClaim" in volume:
            path = self.pvc_dir(ns, str(volume["persistentVolumeClaim"]["claimName"]))
        elif "emptyDir" in volume:
            path = pod_dir / "volumes" / name
        elif "configMap" in volume or "secret" in volume:
            path = pod_dir / "volumes" / name
            self._project(ns, volume, path)
            return path
        else:
            kinds = sorted(set(volume) - {"name"})
            raise PodError(f"volume {name!r}: the local kubelet does not mount {kinds}")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _project(self, ns: str, volume: Mapping[str, Any], path: Path) -> None:
        """A configMap or secret volume as files (its keys, or its ``items``)."""
        secret = "secret" in volume
        src = volume["secret" if secret else "configMap"]
        name = src.get("secretName" if secret else "name")
        obj = self.kube.get("v1", "secrets" if secret else "configmaps", ns, str(name))
        if obj is None:
            if src.get("optional"):
                path.mkdir(parents=True, exist_ok=True)
                return
            kind = "secret" if secret else "configmap"
            raise PodError(
                f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                f'{kind} "{name}" not found'
            )
        files: dict[str, bytes] = {}
        for key, value in (obj.get("data") or {}).items():
            files[key] = base64.b64decode(value) if secret else str(value).encode()
        for key, value in (obj.get("binaryData") or {}).items():
            files[key] = base64.b64decode(value)
        items = src.get("items")
        chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in files}
        path.mkdir(parents=True, exist_ok=True)
        for key, rel in chosen.items():
            if key not in files:
                raise PodError(f"volume {volume['name']!r}: no key {key!r} in {name}")
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[key])

    def _container_env(self, pod: Mapping[str, Any], c: Mapping[str, Any]) -> dict[str, str]:
        """The container's env, in order, each value expanded from the ones before."""
        m, spec = meta(pod), pod.get("spec") or {}
        env: dict[str, str] = {}
        for var in c.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = expand(str(var.get("value", "")), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                fields = {
                    "metadata.name": m["name"],
                    "metadata.namespace": m["namespace"],
                    "metadata.uid": m["uid"],
                    "spec.nodeName": spec.get("nodeName", ""),
                    "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                    "status.podIP": "127.0.0.1",
                    "status.hostIP": "127.0.0.1",
                }
                if (hit := _FIELD.match(path)) is not None:
                    env[var["name"]] = str((m.get(hit[1]) or {}).get(hit[2], ""))
                elif path in fields:
                    env[var["name"]] = str(fields[path])
                else:
                    raise PodError(f"env {var['name']}: fieldPath {path!r} is not supported")
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                secret = "secretKeyRef" in source
                value = self._key_ref(m["namespace"], source, secret)
                if value is not None:
                    env[var["name"]] = value
            else:
                raise PodError(f"env {var['name']}: valueFrom {sorted(source)} not supported")
        return env

    def _key_ref(self, ns: str, source: Mapping[str, Any], secret: bool) -> str | None:
        """An env value from a ConfigMap's or Secret's key; one that is missing (and not
        optional) is the kubelet's CreateContainerConfigError, in its words."""
        ref = source["secretKeyRef" if secret else "configMapKeyRef"]
        kind, plural = ("Secret", "secrets") if secret else ("ConfigMap", "configmaps")
        obj = self.kube.get("v1", plural, ns, ref["name"])
        if obj is None:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        raw = (obj.get("data") or {}).get(ref["key"])
        if raw is None:
            if ref.get("optional"):
                return None
            raise ConfigError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
        return base64.b64decode(raw).decode() if secret else str(raw)

    def _rewriter(
        self, pod: Mapping[str, Any], mounts: Sequence[tuple[str, Path]]
    ) -> Callable[[str], str]:
        """Mount paths to their directories, the pod's DNS names to 127.0.0.1:<port>."""
        m, spec = meta(pod), pod.get("spec") or {}
        owner = next(
            (r["uid"] for r in m.get("ownerReferences") or [] if r.get("controller")), m["uid"]
        )
        # One pattern, longest mount first, so that a directory put in for one mount
        # is never rewritten again for another (a mount at /tmp, say, and a test root
        # under /tmp).
        where = {mp: str(d) for mp, d in mounts}
        paths = (
            re.compile(
                r"(?<![\w.\-/])("
                + "|".join(re.escape(mp) for mp in sorted(where, key=len, reverse=True))
                + r")(?=/|$|[^\w.\-])"
            )
            if where
            else None
        )
        sub = spec.get("subdomain")
        dns = None
        if sub:
            ns = re.escape(m["namespace"])
            dns = re.compile(
                rf"(?<![\w.\-])([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.{re.escape(sub)}"
                rf"(?:\.{ns}(?:\.svc(?:\.cluster\.local)?)?)?(?::(\d+))?(?![\w.\-])"
            )

        def address(hit: re.Match[str]) -> str:
            if hit[3] is None:
                return "127.0.0.1"
            key = (owner, hit[1], str(sub), hit[3])
            if key not in self.ports:
                self.ports[key] = free_port(self._taken)
            return f"127.0.0.1:{self.ports[key]}"

        def rewrite(text: str) -> str:
            if paths is not None:
                text = paths.sub(lambda hit: where[hit[1]], text)
            return dns.sub(address, text) if dns is not None else text

        return rewrite

    def _kubeconfig(self, namespace: str, account: str) -> Path:
        path = self.root / "kubeconfig" / f"{namespace}_{account}.yaml"
        if not path.exists():
            token = self.tokens.get((namespace, account))
            user = {"token": token} if token else {}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                        "users": [{"name": account, "user": user}],
                        "contexts": [
                            {
                                "name": "pod",
                                "context": {
                                    "cluster": "emulator",
                                    "user": account,
                                    "namespace": namespace,
                                },
                            }
                        ],
                        "current-context": "pod",
                    }
                )
            )
        return path
