"""The operator's own settings: cluster conventions (GPU labels and resource), not job
settings. ``shardwise operator`` fills them from its flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    #: Extended resource a worker requests per GPU.
    gpu_resource: str = "nvidia.com/gpu"
    #: Node label naming the GPU type (NVIDIA GPU feature discovery sets it).
    gpu_type_label: str = "nvidia.com/gpu.product"
    #: Node label with one GPU's memory in MiB (GPU feature discovery).
    gpu_memory_label: str = "nvidia.com/gpu.memory"
    #: Reconcile every job at least this often even when nothing is heard.
    resync_seconds: float = 300.0
    #: How long a succeeded profiling Job may take to show its published model.
    publish_grace_seconds: float = 60.0
    #: How soon a missing or invalid tables ConfigMap is read again; each retry that
    #: fails the same way doubles the wait, up to ``max_tables_retry_seconds``.
    tables_retry_seconds: float = 30.0
    max_tables_retry_seconds: float = 600.0
    #: A running Job without pods this long is looked up in the Events (FailedCreate).
    failed_create_grace_seconds: float = 5.0
    #: ... and again this often while it stays without pods.
    pod_check_seconds: float = 15.0
    #: A pod of ours deleted this long ago, still terminating on a node that is gone or
    #: not Ready, is force-deleted (before its grace period ends): the workers' own stop
    #: bound (10 s + 5 s by default) has ended it by then if it runs at all.
    lost_pod_seconds: float = 30.0
    #: First retry after an API error; doubles up to ``max_error_backoff``.
    error_backoff_seconds: float = 1.0
    max_error_backoff_seconds: float = 60.0
    #: The worker pods' ServiceAccount when ``spec.template.serviceAccountName`` names
    #: none: rank 0 writes the job's live summary ConfigMap through it (the chart's
    #: ``shardwise-worker``, allowed get/create/patch on ConfigMaps). Empty: the
    #: namespace's default account (the workers then warn once and write no summary).
    worker_service_account: str = ""
    #: The namespaces ``worker_service_account`` exists in (the chart creates it there);
    #: empty: every namespace. A job elsewhere keeps the default account, because a pod
    #: naming a missing account is never created and the job would not train at all.
    worker_service_account_namespaces: frozenset[str] = frozenset()
    #: Read Kueue's Workloads (``kueue.x-k8s.io``) for why a queued job waits; off
    #: where Kueue is not installed or the operator may not read them.
    kueue: bool = True
    #: The Kueue LocalQueue profiling Jobs go through (``""``: the job's own queue).
    profiling_queue: str = ""

    def tables_retry_after(self, attempts: int) -> float:
        """Seconds before reading unreadable tables again after ``attempts`` failures
        alike: ``tables_retry_seconds``, doubled for each, at most the maximum."""
        first, most = self.tables_retry_seconds, self.max_tables_retry_seconds
        return float(min(most, first * 2 ** min(max(attempts, 1) - 1, 30)))

    def worker_service_account_for(self, namespace: str) -> str:
        """The account a worker pod in ``namespace`` runs as when its template names
        none (empty: the namespace's default)."""
        spaces = self.worker_service_account_namespaces
        return self.worker_service_account if not spaces or namespace in spaces else ""
