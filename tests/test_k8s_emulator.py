"""The emulator's own guarantees that no contract test can state (they are about two
API servers at once): what lets the suite's tests run side by side (pytest -n)."""

from __future__ import annotations

from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi


def test_two_emulators_never_give_two_objects_one_uid() -> None:
    """A local kubelet finds a pod's processes by its uid: two emulators (two tests on
    two xdist workers) that counted uids alike let one test's pod deletion kill the
    other's ranks."""
    uids: list[str] = []
    for _ in range(2):
        server = EmulatorServer().start()
        try:
            kube = KubeApi.for_host(server.url)
            for i in range(3):
                body = {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": f"c{i}", "namespace": "default"}}  # fmt: skip
                uids.append(kube.create(body)["metadata"]["uid"])
            kube.close()
        finally:
            server.stop()
    assert len(set(uids)) == len(uids), uids
