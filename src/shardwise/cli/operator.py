"""`shardwise operator`: run the DLRMJob operator (kopf's engine, as `kopf run` would)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from shardwise.basics import UserError
from shardwise.cli._common import err


def operator_cmd(
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            "-n",
            help="Serve DLRMJobs in this namespace; repeat for several.",
        ),
    ] = None,
    all_namespaces: Annotated[
        bool,
        typer.Option("--all-namespaces", "-A", help="Serve DLRMJobs cluster-wide."),
    ] = False,
    health_port: Annotated[
        int,
        typer.Option(
            "--liveness-port",
            "--health-port",
            min=0,
            max=65535,
            help="Port of /healthz (liveness) and /readyz (readiness).",
        ),
    ] = 8080,
    metrics_port: Annotated[
        int,
        typer.Option(min=0, max=65535, help="Port of the Prometheus /metrics endpoint."),
    ] = 9090,
    peering: Annotated[
        str | None,
        typer.Option(
            help="Join this kopf peering object (needs kopf's peering CRDs); default: --standalone."
        ),
    ] = None,
    standalone: Annotated[
        bool, typer.Option("--standalone", help="Run without peering (the default).")
    ] = False,
    priority: Annotated[
        int, typer.Option(help="Peering priority: the highest of the peers works.")
    ] = 0,
    planner_workers: Annotated[
        int, typer.Option(min=1, help="Planner processes (one plan each at a time).")
    ] = 1,
    gpu_resource: Annotated[
        str, typer.Option(help="Extended resource a worker requests per GPU.")
    ] = "nvidia.com/gpu",
    gpu_type_label: Annotated[
        str, typer.Option(help="Node label naming the GPU type.")
    ] = "nvidia.com/gpu.product",
    gpu_memory_label: Annotated[
        str, typer.Option(help="Node label with one GPU's memory in MiB.")
    ] = "nvidia.com/gpu.memory",
    worker_service_account: Annotated[
        str,
        typer.Option(
            help="ServiceAccount of worker pods whose spec.template.serviceAccountName is "
            "empty: rank 0 writes the job's live summary ConfigMap through it (needs get, "
            "create, patch on configmaps; the chart's shardwise-worker). Default: the "
            "namespace's default account, and no live summary."
        ),
    ] = "",
    worker_service_account_namespace: Annotated[
        list[str] | None,
        typer.Option(
            help="A namespace where --worker-service-account exists; repeat for several. "
            "Jobs in other namespaces keep the default account. Default: every namespace."
        ),
    ] = None,
    kueue: Annotated[
        bool,
        typer.Option(
            "--kueue/--no-kueue",
            help="Read Kueue's Workloads (kueue.x-k8s.io; needs get, list, watch on "
            "workloads) to say why a job labelled kueue.x-k8s.io/queue-name waits. Jobs are "
            "queued by that label either way; turn this off where Kueue is not installed.",
        ),
    ] = True,
    profiling_queue: Annotated[
        str,
        typer.Option(
            help="The Kueue LocalQueue (in the job's namespace) profiling Jobs go through. "
            "Default: the DLRMJob's own queue, or none when it has none.",
        ),
    ] = "",
    server: Annotated[
        str | None,
        typer.Option(
            help="API server URL (e.g. http://127.0.0.1:8001 from `kubectl proxy`); "
            "default: the pod's service account, else the kubeconfig. An https URL's "
            "certificate is verified."
        ),
    ] = None,
    certificate_authority: Annotated[
        Path | None,
        typer.Option(
            help="With an https --server: the CA file its certificate is verified "
            "against (default: the system's CAs)."
        ),
    ] = None,
    insecure_skip_tls_verify: Annotated[
        bool,
        typer.Option(
            "--insecure-skip-tls-verify",
            help="With an https --server: do not verify its certificate (a test cluster "
            "only: anyone on the path can read and change the traffic).",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Run the operator: it profiles GPU types, plans the sharding and runs the workers
    of every DLRMJob it serves (install crds/dlrmjob.yaml first).

    Writes no file: it creates the jobs' profiling Jobs, ConfigMaps and worker pods
    through the Kubernetes API, records each job's state in its status, and serves
    health and metrics on its two ports.

    Example: shardwise operator --namespace ml --liveness-port 8080 --metrics-port 9090
    """
    if standalone and peering:
        raise UserError("give --peering NAME or --standalone, not both.")
    if health_port == metrics_port:
        raise UserError("--liveness-port and --metrics-port must differ.")
    if all_namespaces == bool(namespace):
        raise UserError("give --namespace (once or more) or --all-namespaces, not both or neither.")
    _check_tls_options(server, certificate_authority, insecure_skip_tls_verify)
    if worker_service_account_namespace and not worker_service_account:
        raise UserError(
            "--worker-service-account-namespace says where --worker-service-account exists: "
            "give that too, or leave both out."
        )
    import kopf

    from shardwise.operator.config import OperatorConfig
    from shardwise.operator.main import RunOptions, run

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("shardwise.operator").setLevel(logging.DEBUG if verbose else logging.INFO)
    options = RunOptions(
        namespaces=tuple(namespace or ()),
        clusterwide=all_namespaces,
        health_port=health_port,
        metrics_port=metrics_port,
        peering=peering,
        priority=priority,
        config=OperatorConfig(
            gpu_resource=gpu_resource,
            gpu_type_label=gpu_type_label,
            gpu_memory_label=gpu_memory_label,
            worker_service_account=worker_service_account,
            worker_service_account_namespaces=frozenset(worker_service_account_namespace or ()),
            kueue=kueue,
            profiling_queue=profiling_queue,
        ),
        server=server,
        insecure_skip_tls_verify=insecure_skip_tls_verify,
        certificate_authority=str(certificate_authority) if certificate_authority else None,
    )
    where = "all namespaces" if all_namespaces else ", ".join(namespace or ())
    err.print(
        f"shardwise operator: starting for {where}; health on :{health_port}, "
        f"metrics on :{metrics_port}"
    )
    run(options, planner_workers=planner_workers)


def _check_tls_options(server: str | None, ca: Path | None, insecure: bool) -> None:
    """The TLS options apply to --server only: a kubeconfig names its own CA (or
    insecure-skip-tls-verify), and a pod trusts its service account's CA."""
    if (ca or insecure) and not server:
        flag = "--certificate-authority" if ca else "--insecure-skip-tls-verify"
        raise UserError(
            f"{flag} goes with --server; without it the kubeconfig's cluster entry says "
            "how to verify the server (certificate-authority, insecure-skip-tls-verify)."
        )
    if ca and insecure:
        raise UserError("give --certificate-authority or --insecure-skip-tls-verify, not both.")
    if ca and not ca.is_file():
        raise UserError(f"--certificate-authority {ca}: no such file.")
    if insecure and server and server.startswith("https://"):
        err.print(
            f"shardwise operator: warning: not verifying the TLS certificate of {server} "
            "(--insecure-skip-tls-verify)."
        )
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
