"""The API server's built-in PodSecurity admission, for pods created in a namespace
labelled ``pod-security.kubernetes.io/enforce: baseline`` or ``restricted``.

The checks are the Pod Security Standards as ``k8s.io/pod-security-admission/policy``
implements them at ``latest``, with its words: each failed check's reason and detail,
joined as the admission joins them, in its order (the baseline checks that the
restricted level keeps, then the restricted ones, each group in the order the Go
package registers them: by file name). The refusal is the API server's 403:
``pods "NAME" is forbidden: violates PodSecurity "restricted:latest": …``, with NAME
the pod's generated name (PodSecurity validates after the name is generated).

Only ``enforce`` is played (a refused pod is never stored); ``warn`` and ``audit``,
workload resources (a Job is admitted, its pods are not), ``enforce-version`` (every
namespace is at ``latest``), exemptions, pod updates, ephemeral containers and the
``securityContext.appArmorProfile`` field (its annotation form is checked) are not.
``tests/test_k8s_contract.py`` pins the messages against a real API server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

ENFORCE = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")

Pod = Mapping[str, Any]
Result = tuple[str, str]  # (forbidden reason, forbidden detail)
Check = Callable[[Mapping[str, Any], Mapping[str, Any]], Result | None]


def _plural(singular: str, plural: str, count: int) -> str:
    return singular if count == 1 else plural


def _quote(items: list[str]) -> str:
    return '"' + '", "'.join(items) + '"' if items else ""


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Init containers, then containers (the policy's ``visitContainers``)."""
    yield from spec.get("initContainers") or []
    yield from spec.get("containers") or []


def _sc(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return (obj or {}).get("securityContext") or {}


def _setters(pod_bad: bool, containers: list[str]) -> list[str]:
    out = ["pod"] if pod_bad else []
    if containers:
        out.append(f"{_plural('container', 'containers', len(containers))} {_quote(containers)}")
    return out


# --------------------------------------------------------------------------- baseline
def _app_armor(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    bad = sorted(
        f'{k}="{v}"'
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(prefix) and v and v != "runtime/default" and not v.startswith("localhost/")
    )
    if bad:
        reason = _plural("forbidden AppArmor profile", "forbidden AppArmor profiles", len(bad))
        return reason, ", ".join(bad)
    return None


def _host_namespaces(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    found = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return ("host namespaces", ", ".join(found)) if found else None


def _host_ports(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad, ports = [], set()
    for c in _containers(spec):
        used = [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")]
        if used:
            bad.append(c["name"])
            ports.update(used)
    if not bad:
        return None
    detail = (
        f"{_plural('container', 'containers', len(bad))} {_quote(bad)} "
        f"{_plural('uses', 'use', len(bad))} {_plural('hostPort', 'hostPorts', len(ports))} "
        + ", ".join(sorted(ports))
    )
    return "hostPort", detail


def _probe_hosts(c: Mapping[str, Any]) -> list[str]:
    hosts = []
    handlers = [c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
    handlers += [(c.get("lifecycle") or {}).get(h) for h in ("postStart", "preStop")]
    for handler in handlers:
        for kind in ("httpGet", "tcpSocket"):
            host = ((handler or {}).get(kind) or {}).get("host")
            if host:
                hosts.append(str(host))
    return hosts


def _host_probes(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad, hosts = set(), set()
    for c in _containers(spec):
        found = _probe_hosts(c)
        if found:
            bad.add(c["name"])
            hosts.update(found)
    if not bad:
        return None
    detail = (
        f"{_plural('container', 'containers', len(bad))} {_quote(sorted(bad))} "
        f"{_plural('uses', 'use', len(bad))} "
        f"{_plural('probe or lifecycle host', 'probe or lifecycle hosts', len(hosts))} "
        + _quote(sorted(hosts))
    )
    return "probe or lifecycle host", detail


def _privileged(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad = [c["name"] for c in _containers(spec) if _sc(c).get("privileged") is True]
    if bad:
        word = _plural("container", "containers", len(bad))
        return "privileged", f"{word} {_quote(bad)} must not set securityContext.privileged=true"
    return None


def _proc_mount(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad, kinds = [], set()
    for c in _containers(spec):
        mount = _sc(c).get("procMount")
        if mount is not None and mount != "Default":
            bad.append(c["name"])
            kinds.add(str(mount))
    if bad:
        word = _plural("container", "containers", len(bad))
        detail = f"{word} {_quote(bad)} must not set securityContext.procMount to "
        return "procMount", detail + _quote(sorted(kinds))
    return None


def _se_linux(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    types: set[str] = set()
    flags = {"user": False, "role": False}

    def valid(opts: Mapping[str, Any]) -> bool:
        ok = True
        if opts.get("type", "") not in ("", "container_t", "container_init_t", "container_kvm_t"):
            ok = False
            types.add(str(opts["type"]))
        for key in ("user", "role"):
            if opts.get(key):
                ok, flags[key] = False, True
        return ok

    pod_opts = _sc(spec).get("seLinuxOptions")
    pod_bad = pod_opts is not None and not valid(pod_opts)
    bad = [
        c["name"]
        for c in _containers(spec)
        if _sc(c).get("seLinuxOptions") is not None and not valid(_sc(c)["seLinuxOptions"])
    ]
    setters = _setters(pod_bad, bad)
    if not setters:
        return None
    data = []
    if types:  # as the policy has it: user and role are only named with a bad type
        data.append(f"{_plural('type', 'types', len(types))} {_quote(sorted(types))}")
        data += [f"{k} may not be set" for k in ("user", "role") if flags[k]]
    detail = f"{' and '.join(setters)} set forbidden securityContext.seLinuxOptions: "
    return "seLinuxOptions", detail + "; ".join(data)


SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)


def _sysctls(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad = [s["name"] for s in _sc(spec).get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    return ("forbidden sysctls", ", ".join(bad)) if bad else None


def _host_process(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    def on(sc: Mapping[str, Any]) -> bool:
        return (sc.get("windowsOptions") or {}).get("hostProcess") is True

    setters = _setters(on(_sc(spec)), [c["name"] for c in _containers(spec) if on(_sc(c))])
    if setters:
        detail = " and ".join(setters) + " must not set securityContext.windowsOptions."
        return "hostProcess", detail + "hostProcess=true"
    return None


#: Baseline checks that the restricted level replaces with a stricter one of its own.
_DEFAULT_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip


def _capabilities_baseline(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad, caps = [], set()
    for c in _containers(spec):
        added = {str(x) for x in (_sc(c).get("capabilities") or {}).get("add") or []}
        extra = added - _DEFAULT_CAPABILITIES
        if extra:
            bad.append(c["name"])
            caps |= extra
    if bad:
        word = _plural("container", "containers", len(bad))
        detail = f"{word} {_quote(bad)} must not include {_quote(sorted(caps))} in "
        return "non-default capabilities", detail + "securityContext.capabilities.add"
    return None


def _host_path(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if bad:
        return "hostPath volumes", f"{_plural('volume', 'volumes', len(bad))} {_quote(bad)}"
    return None


def _seccomp_valid(profile: Mapping[str, Any]) -> bool:
    return profile.get("type") in ("RuntimeDefault", "Localhost")


def _seccomp(spec: Mapping[str, Any], restricted: bool) -> Result | None:
    bad_values: set[str] = set()
    pod_profile = _sc(spec).get("seccompProfile")
    pod_bad = pod_profile is not None and not _seccomp_valid(pod_profile)
    if pod_bad:
        bad_values.add(str((pod_profile or {}).get("type", "")))
    pod_set = pod_profile is not None and not pod_bad
    explicit, implicit = [], []
    for c in _containers(spec):
        profile = _sc(c).get("seccompProfile")
        if profile is not None:
            if not _seccomp_valid(profile):
                explicit.append(c["name"])
                bad_values.add(str(profile.get("type", "")))
        elif not pod_set:
            implicit.append(c["name"])
    setters = _setters(pod_bad, explicit)
    if setters:
        detail = f"{' and '.join(setters)} must not set securityContext.seccompProfile.type to "
        return "seccompProfile", detail + _quote(sorted(bad_values))
    if restricted and implicit:
        word = _plural("container", "containers", len(implicit))
        return "seccompProfile", (
            f"pod or {word} {_quote(implicit)} must set securityContext.seccompProfile.type "
            'to "RuntimeDefault" or "Localhost"'
        )
    return None


def _seccomp_baseline(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    return _seccomp(spec, restricted=False)


# --------------------------------------------------------------------------- restricted
def _privilege_escalation(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad = [
        c["name"] for c in _containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False
    ]
    if bad:
        word = _plural("container", "containers", len(bad))
        return "allowPrivilegeEscalation != false", (
            f"{word} {_quote(bad)} must set securityContext.allowPrivilegeEscalation=false"
        )
    return None


def _capabilities_restricted(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    no_drop, adding, caps = [], [], set()
    for c in _containers(spec):
        capabilities = _sc(c).get("capabilities")
        if capabilities is None:
            no_drop.append(c["name"])
            continue
        if "ALL" not in (capabilities.get("drop") or []):
            no_drop.append(c["name"])
        extra = {str(x) for x in capabilities.get("add") or []} - {"NET_BIND_SERVICE"}
        if extra:
            adding.append(c["name"])
            caps |= extra
    details = []
    if no_drop:
        word = _plural("container", "containers", len(no_drop))
        details.append(
            f'{word} {_quote(no_drop)} must set securityContext.capabilities.drop=["ALL"]'
        )
    if adding:
        word = _plural("container", "containers", len(adding))
        details.append(
            f"{word} {_quote(adding)} must not include {_quote(sorted(caps))} in "
            "securityContext.capabilities.add"
        )
    return ("unrestricted capabilities", "; ".join(details)) if details else None


#: Volume sources the restricted level allows.
ALLOWED_VOLUMES = frozenset(
    {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
        "persistentVolumeClaim", "projected", "secret",
    }
)  # fmt: skip


def _restricted_volumes(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    bad, kinds = [], set()
    for v in spec.get("volumes") or []:
        sources = set(v) - {"name"}
        if not sources & ALLOWED_VOLUMES:
            bad.append(str(v["name"]))
            kinds.add(min(sources) if sources else "unknown")
    if not bad:
        return None
    return "restricted volume types", (
        f"{_plural('volume', 'volumes', len(bad))} {_quote(bad)} "
        f"{_plural('uses', 'use', len(bad))} "
        f"{_plural('restricted volume type', 'restricted volume types', len(kinds))} "
        + _quote(sorted(kinds))
    )


def _run_as_non_root(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    pod_value = _sc(spec).get("runAsNonRoot")
    pod_bad, pod_ok = pod_value is False, pod_value is True
    explicit, implicit = [], []
    for c in _containers(spec):
        value = _sc(c).get("runAsNonRoot")
        if value is not None:
            if value is False:
                explicit.append(c["name"])
        elif not pod_ok:
            implicit.append(c["name"])
    setters = _setters(pod_bad, explicit)
    if setters:
        detail = f"{' and '.join(setters)} must not set securityContext.runAsNonRoot=false"
        return "runAsNonRoot != true", detail
    if implicit:
        word = _plural("container", "containers", len(implicit))
        return "runAsNonRoot != true", (
            f"pod or {word} {_quote(implicit)} must set securityContext.runAsNonRoot=true"
        )
    return None


def _run_as_user(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    setters = _setters(
        _sc(spec).get("runAsUser") == 0,
        [c["name"] for c in _containers(spec) if _sc(c).get("runAsUser") == 0],
    )
    if setters:
        return "runAsUser=0", f"{' and '.join(setters)} must not set runAsUser=0"
    return None


def _seccomp_restricted(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Result | None:
    return _seccomp(spec, restricted=True)


#: In the policy package's registration order (its files' names).
BASELINE: tuple[Check, ...] = (
    _app_armor, _host_namespaces, _host_ports, _host_probes, _privileged, _proc_mount,
    _se_linux, _sysctls, _host_process,
)  # fmt: skip
#: Baseline checks evaluated at the baseline level only (restricted has stricter ones).
BASELINE_ONLY: tuple[Check, ...] = (_capabilities_baseline, _host_path, _seccomp_baseline)
RESTRICTED: tuple[Check, ...] = (
    _privilege_escalation, _capabilities_restricted, _restricted_volumes, _run_as_non_root,
    _run_as_user, _seccomp_restricted,
)  # fmt: skip


def evaluate(level: str, meta: Mapping[str, Any], spec: Mapping[str, Any]) -> list[Result]:
    """The failed checks of a pod (its metadata and spec) at ``level``, in order."""
    if level == "privileged":
        return []
    checks = BASELINE + (RESTRICTED if level == "restricted" else BASELINE_ONLY)
    return [r for check in checks if (r := check(meta, spec)) is not None]


def forbidden_detail(results: list[Result]) -> str:
    """The admission's ``ForbiddenDetail()``: each reason, its detail in parentheses."""
    return ", ".join(f"{r} ({d})" if d else r for r, d in results)


def namespace_level(namespace: Mapping[str, Any] | None) -> str:
    """The level a namespace enforces (``privileged`` when it says none)."""
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    level = labels.get(ENFORCE, "privileged")
    return level if level in LEVELS else "restricted"  # an invalid level enforces the strictest


def violation(level: str, pod: Pod) -> str | None:
    """``violates PodSecurity "LEVEL:latest": …`` for a pod the level refuses, else None."""
    results = evaluate(level, pod.get("metadata") or {}, pod.get("spec") or {})
    if not results:
        return None
    return f'violates PodSecurity "{level}:latest": {forbidden_detail(results)}'
