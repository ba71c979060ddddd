"""The official Kubernetes client as the pods use it: the profiling pod publishes its
results through it, and rank 0 of the workers writes the job's live summary.

Both run inside the cluster with a service account; outside it (tests against the API
emulator, a command run by hand) the local kubeconfig (``$KUBECONFIG`` or
``~/.kube/config``) stands in, as ``kubectl`` would. It sits beside ``names`` and
``basics`` because ``profiler`` and ``runtime`` may not import each other; the
kubernetes package is imported only when a client is asked for.
"""

from __future__ import annotations

from typing import Any

from shardwise.basics import UserError


def core_v1_api(fix: str = "") -> Any:
    """A ``kubernetes.client.CoreV1Api`` from the pod's service account, else the local
    kubeconfig; neither is a :class:`UserError` that says where it looked, then ``fix``
    (what the caller's user can do about it)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        except (config.ConfigException, OSError, ValueError) as err:
            raise UserError(
                "no Kubernetes API configured (neither an in-cluster service account nor a "
                f"kubeconfig: {err}).{' ' + fix if fix else ''}"
            ) from None
    return client.CoreV1Api()
