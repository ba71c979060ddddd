"""Running the operator: kopf's settings (:mod:`shardwise.operator.main`) and the
``shardwise operator`` command."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import typer
from k8s.helpers import NAMESPACE
from k8s.server import EmulatorServer
from typer.testing import CliRunner

from shardwise.basics import UserError
from shardwise.cli.operator import operator_cmd
from shardwise.operator.kube import KubeApi
from shardwise.operator.loop.planner_pool import PlanExecutor
from shardwise.operator.main import RunOptions, exact_names, operate, settings_for


def test_kopf_scans_nothing_for_exact_namespaces() -> None:
    assert settings_for(RunOptions(namespaces=("ml", "team-a"))).scanning.disabled
    assert not settings_for(RunOptions(namespaces=("team-*",))).scanning.disabled
    assert not settings_for(RunOptions(clusterwide=True)).scanning.disabled
    assert not exact_names([]) and not exact_names(["!kube-system"])


def test_cli_needs_a_scope() -> None:
    from shardwise.cli import main  # noqa: F401  (the package imports cleanly with the command)

    app = typer.Typer()
    app.command()(operator_cmd)
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "--all-namespaces" in result.output
    result = CliRunner().invoke(app, [])
    assert result.exit_code != 0 and "--namespace" in str(result.exception)


# --- What `shardwise operator` says when it cannot work: exit 2, no traceback ---------


def shardwise_operator(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise", "operator", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_kubeconfig_says_where_it_looked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(tmp_path / "missing-config")
    proc = shardwise_operator("--namespace", "ml", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    text = " ".join(proc.stderr.split())
    assert "no Kubernetes API server to talk to" in text
    # The console wraps long lines, inside the path too: compare without whitespace.
    assert f"{tmp_path / 'missing-config'}:nosuchfile" in "".join(text.split())
    assert "kubectl proxy" in text


def preflight(url: str, **options: object) -> str:
    """What ``operate`` refuses to start with, before kopf runs."""
    run = RunOptions(namespaces=(NAMESPACE,), health_port=None, server=url, **options)  # type: ignore[arg-type]
    kube = KubeApi.for_host(
        url,
        verify_ssl=not run.insecure_skip_tls_verify,
        ca_cert=run.certificate_authority,
    )
    try:
        with pytest.raises(UserError) as err:
            asyncio.run(operate(run, kube, PlanExecutor(workers=1)))
    finally:
        kube.close()
    return " ".join(str(err.value).split())


def test_a_missing_crd_is_named_with_how_to_install_it() -> None:
    server = EmulatorServer().start()  # no CRD installed
    try:
        text = preflight(server.url)
    finally:
        server.stop()
    assert "the DLRMJob CRD (dlrmjobs.shardwise.dev, version v1alpha1) is not installed" in text
    assert "kubectl apply -f crds/dlrmjob.yaml" in text


class NotKubernetes(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>not here</html>")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An https server with a self-signed certificate; yields (URL, its certificate)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make a test certificate"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotKubernetes)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{httpd.server_address[1]}", cert
    httpd.shutdown()
    httpd.server_close()


def test_tls_is_verified_unless_told_not_to(tls_server: tuple[str, Path]) -> None:
    url, cert = tls_server
    text = preflight(url)
    assert "cannot verify the TLS certificate" in text and "--certificate-authority" in text
    # trusted through its CA, or with verification off: the server is reached, and
    # its 404 without /version is named for what it is
    for options in ({"certificate_authority": str(cert)}, {"insecure_skip_tls_verify": True}):
        text = preflight(url, **options)
        assert "not a Kubernetes API server" in text, options


def test_tls_options_belong_to_server(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(operator_cmd)
    result = CliRunner().invoke(app, ["--namespace", "ml", "--insecure-skip-tls-verify"])
    assert isinstance(result.exception, UserError)
    assert "goes with --server" in str(result.exception)


def test_kopf_404_during_the_run_says_what_was_not_found() -> None:
    from kopf._cogs.clients.errors import APINotFoundError

    from shardwise.operator.main import kopf_failure

    # kopf's observer fails with an empty message when the API answers 404
    failure = kopf_failure(APINotFoundError("", status=404, headers={}), "https://k8s:6443")
    assert failure is not None
    text = str(failure)
    assert "answered 404" in text and "(no message)" in text
    assert "DLRMJob CRD is not installed" in text and "kubectl apply -f crds/dlrmjob.yaml" in text
    assert kopf_failure(RuntimeError("a bug"), "https://k8s:6443") is None
