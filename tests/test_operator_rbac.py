"""The chart's RBAC is enough, and no more: the operator, logged in as the chart's
service account, serves a DLRMJob to Running against an emulator that authorizes every
request with the Roles and bindings ``helm template`` renders, with no 403 at all.

Both scopes: ``operator.watch.allNamespaces: false`` (a Role per served namespace; kopf
must not scan namespaces or CRDs, which it is not allowed to) and the default
cluster-wide install.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s.emulator import ApiEmulator
from k8s.helpers import (
    GPU_TYPE,
    NAMESPACE,
    ROOT,
    TEST_CONFIG,
    add_node,
    condition,
    dlrmjob,
    finish_job,
    job_pod,
    load_crd,
    render_chart,
    set_job_status,
    status_of,
    wait_for,
    wait_phase,
)
from k8s.rbac import Attributes, RbacAuthorizer, admin, request_attributes, service_account
from k8s.server import EmulatorServer
from kubernetes import client as k8s_client

from shardwise.names import profiling_job_name
from shardwise.operator.kube import KubeApi
from shardwise.operator.pod.publish_model import publish_cost_model

pytest_plugins = ["k8s.fixtures"]
NS = NAMESPACE
RELEASE_NS = "shardwise"
MODEL = ROOT / "planner" / "data" / "costmodel-cpu.pt"
ADMIN, OPERATOR, PROFILER = "admin-token", "operator-token", "profiler-token"
SCOPES: dict[str, dict[str, Any]] = {
    "namespaced": {"operator": {"watch": {"allNamespaces": False, "namespaces": [NS]}}},
    # the profiler's service account where the job runs (default: the release namespace)
    "all-namespaces": {"profiler": {"namespaces": [NS]}},
}
#: Short Events checks, so that the FailedCreate lookup (events list) is exercised.
CONFIG = dataclasses.replace(TEST_CONFIG, failed_create_grace_seconds=0.2, pod_check_seconds=1.0)


def operator_identity(objs: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The chart Deployment's service account and its `shardwise operator` arguments."""
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    return pod["serviceAccountName"], pod["containers"][0]["args"]


def scope_of(args: list[str]) -> dict[str, Any]:
    if "--all-namespaces" in args:
        return {"clusterwide": True, "namespaces": ()}
    names = tuple(a.split("=", 1)[1] for a in args if a.startswith("--namespace="))
    return {"clusterwide": False, "namespaces": names}


@pytest.fixture(params=list(SCOPES))
def chart(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_chart(tmp_path, SCOPES[request.param], RELEASE_NS)


@pytest.fixture
def authorized(
    chart: tuple[str, list[dict[str, Any]]],
) -> Iterator[tuple[EmulatorServer, RbacAuthorizer, list[str]]]:
    """An emulator that authorizes with the chart's RBAC (and an admin for the test)."""
    _, objs = chart
    sa, args = operator_identity(objs)
    tokens = {
        ADMIN: admin(),
        OPERATOR: service_account(RELEASE_NS, sa),
        PROFILER: service_account(NS, "shardwise-profiler"),
    }
    authz = RbacAuthorizer(objs, tokens)
    emulator = ApiEmulator()
    emulator.authorizer = authz
    server = EmulatorServer(emulator).start()
    kube = KubeApi.for_host(server.url, ADMIN)
    kube.create(load_crd())
    for ns in ("default", NS, RELEASE_NS):
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.close()
    yield server, authz, args
    server.stop()
    assert server.emulator.unexpected == [], "the emulator hit an internal error"


def test_the_charts_rbac_serves_a_job_with_no_403(
    authorized: tuple[EmulatorServer, RbacAuthorizer, list[str]],
    plan_pool: concurrent.futures.Executor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from k8s.fixtures import OperatorThread  # a plugin module: imported once pytest has it

    server, authz, args = authorized
    caplog.set_level(logging.INFO)
    kube = KubeApi.for_host(server.url, ADMIN)
    add_node(kube, "gpu-1", gpus=4)
    op = OperatorThread(server.url, plan_pool, config=CONFIG, token=OPERATOR, **scope_of(args))
    op.start()
    try:
        kube.create(dlrmjob("rbac", NS, policy="IfStale"))
        name = profiling_job_name("rbac", GPU_TYPE, 1)
        job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
        # no pods yet: the operator looks for the Job's FailedCreate Events
        wait_for(lambda: server.emulator.count("list", "events") > 0, what="an Events lookup")
        job_pod(kube, job)  # as the Job controller
        # the profiling pod publishes with the profiler's service account (its Role)
        api = k8s_client.Configuration(host=server.url)
        api.api_key = {"BearerToken": PROFILER}
        api.api_key_prefix = {"BearerToken": "Bearer"}
        core = k8s_client.CoreV1Api(k8s_client.ApiClient(api))
        publish_cost_model(MODEL, GPU_TYPE, NS, core, job="rbac", fingerprint_key="a100-test")
        finish_job(kube, NS, name, ok=True)
        wait_phase(kube, NS, "rbac", "Running", timeout=120)  # it plans: a busy machine
        set_job_status(kube, NS, "rbac-workers", active=2, ready=2)
        wait_for(
            lambda: (
                (c := condition(status_of(kube, NS, "rbac"), "WorkersReady"))
                and c["status"] == "True"
            ),
            what="the workers ready",
        )
        # every transition's Event was posted (events create)
        wait_for(
            lambda: any(
                (e.get("involvedObject") or {}).get("name") == "rbac"
                for e in kube.list("v1", "events", NS)
            ),
            what="Events on the DLRMJob",
        )
    finally:
        op.stop()
        kube.close()
    assert authz.denials == [], [d.message for d in authz.denials]
    # A 403 as the access log writes a status (a bare "403" also matches random uids and
    # response sizes), or any forbidden/permission word kopf or the client would log.
    noisy = [
        r.getMessage()
        for r in caplog.records
        if any(w in r.getMessage() for w in ('" 403 ', "Forbidden", "forbidden", "permission"))
    ]
    assert noisy == [], noisy


def test_the_authorizer_reads_the_charts_rules(chart: tuple[str, list[dict[str, Any]]]) -> None:
    """What the chart grants the operator, and what it does not, request by request."""
    scope, objs = chart
    sa, _ = operator_identity(objs)
    authz = RbacAuthorizer(objs)
    user = service_account(RELEASE_NS, sa)

    def can(method: str, path: str, **query: str) -> bool:
        return authz.allowed(user, request_attributes(method, path, query))

    assert can("GET", f"/api/v1/namespaces/{NS}/events", fieldSelector="reason=FailedCreate")
    assert can("POST", f"/api/v1/namespaces/{NS}/events")
    assert can("GET", f"/api/v1/namespaces/{NS}/pods", watch="true")
    assert can("PATCH", f"/apis/shardwise.dev/v1alpha1/namespaces/{NS}/dlrmjobs/x/status")
    assert can("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/x")
    assert can("GET", "/api/v1/nodes", watch="true")
    assert can("GET", "/apis") and can("GET", "/apis/shardwise.dev/v1alpha1")  # discovery
    assert not can("GET", f"/api/v1/namespaces/{NS}/secrets")
    assert not can("GET", f"/api/v1/namespaces/{NS}/pods/x/log")
    assert not can("DELETE", f"/apis/shardwise.dev/v1alpha1/namespaces/{NS}/dlrmjobs/x")
    assert can("PATCH", f"/api/v1/namespaces/{NS}/events/x")  # a repeat, counted
    assert not can("DELETE", f"/api/v1/namespaces/{NS}/events/x")
    assert not can("GET", "/api/v1/namespaces")
    if scope == "namespaced":
        assert not can("GET", "/api/v1/namespaces/default/pods")
        assert not can("GET", "/api/v1/pods")  # across namespaces
        assert not can("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
    else:
        assert can("GET", "/api/v1/pods", watch="true")
        assert can("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", watch="1")


def test_request_attributes_as_the_api_server_reads_them() -> None:
    read = request_attributes
    assert read("GET", "/api/v1/namespaces/ml/pods", {}) == Attributes(
        "list", True, "/api/v1/namespaces/ml/pods", "", "v1", "pods", "", "ml", ""
    )
    status = read("PATCH", "/apis/shardwise.dev/v1alpha1/namespaces/ml/dlrmjobs/a/status", {})
    assert (status.verb, status.api_group, status.qualified, status.name) == (
        "patch",
        "shardwise.dev",
        "dlrmjobs/status",
        "a",
    )
    ns = read("GET", "/api/v1/namespaces/ml", {})
    assert (ns.verb, ns.resource, ns.name, ns.namespace) == ("get", "namespaces", "ml", "ml")
    assert read("GET", "/api/v1/nodes", {"watch": "true"}).verb == "watch"
    assert read("DELETE", "/api/v1/namespaces/ml/pods", {}).verb == "deletecollection"
    assert not read("GET", "/apis/batch/v1", {}).resource_request
    assert not read("GET", "/version", {}).resource_request


def test_bindings_scope_the_rules() -> None:
    role = {
        "kind": "Role",
        "metadata": {"name": "r", "namespace": "a"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    binding = {
        "kind": "RoleBinding",
        "metadata": {"name": "b", "namespace": "a"},
        "roleRef": {"kind": "Role", "name": "r", "apiGroup": "rbac.authorization.k8s.io"},
        "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "ops"}],
    }
    aggregate = {
        "kind": "ClusterRole",
        "metadata": {"name": "agg"},
        "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"x": "y"}}]},
    }
    part = {
        "kind": "ClusterRole",
        "metadata": {"name": "part", "labels": {"x": "y"}},
        "rules": [{"apiGroups": ["batch"], "resources": ["*/status"], "verbs": ["*"]}],
    }
    crb = {
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "c"},
        "roleRef": {"kind": "ClusterRole", "name": "agg", "apiGroup": "rbac.authorization.k8s.io"},
        "subjects": [{"kind": "Group", "name": "system:serviceaccounts:ops"}],
    }
    authz = RbacAuthorizer([role, binding, aggregate, part, crb])
    sa = service_account("ops", "sa")
    other = service_account("ops", "other")

    def can(user: Any, method: str, path: str) -> bool:
        return authz.allowed(user, request_attributes(method, path, {}))

    assert can(sa, "GET", "/api/v1/namespaces/a/pods/p")
    assert not can(sa, "GET", "/api/v1/namespaces/b/pods/p")
    assert not can(sa, "GET", "/api/v1/namespaces/a/pods")  # list is not get
    assert not can(other, "GET", "/api/v1/namespaces/a/pods/p")
    # the group binding of the aggregated role: any status subresource, anywhere
    assert can(other, "PATCH", "/apis/batch/v1/namespaces/b/jobs/j/status")
    assert not can(other, "PATCH", "/apis/batch/v1/namespaces/b/jobs/j")
    anonymous = authz.authenticate({})
    assert anonymous is not None and not can(anonymous, "GET", "/apis")
    assert can(anonymous, "GET", "/version")
