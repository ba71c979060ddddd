"""The chart's RBAC: exactly the rules docs/operations.md ("RBAC") documents, bound
where the watch scope needs them: no wildcards, no secrets, the operator's cluster and
namespaced rules, kopf's peering, the profiler's service account and the aggregated
DLRMJob roles."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from chart_helpers import (
    CRD,
    NS,
    ROOT,
    Obj,
    Rule,
    count_kinds,
    find,
    is_hook,
    one,
    operator_container,
    render,
    rules,
)

pytest_plugins = ["chart_helpers"]


#: Every rule the operator gets, with nothing else: docs/operations.md ("RBAC") gives
#: the reason for each. A new verb here is a new right in every cluster.
OPERATOR_CLUSTER_RULES: set[Rule] = {
    ("", "nodes", ("get", "list", "watch")),
    ("kueue.x-k8s.io", "clusterqueues", ("get", "list", "watch")),
}
#: kopf's CRD observer, cluster-wide operators only (a namespaced one serves exact
#: namespace names with kopf's scanning off; tests/test_operator_rbac.py runs both).
CRD_RULE: Rule = ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"))
OPERATOR_NAMESPACED_RULES: set[Rule] = {
    ("shardwise.dev", "dlrmjobs", ("get", "list", "watch", "patch")),
    ("shardwise.dev", "dlrmjobs/status", ("patch",)),
    ("batch", "jobs", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "pods", ("get", "list", "watch", "delete")),
    ("", "configmaps", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "services", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "events", ("create", "get", "list", "patch")),
    ("kueue.x-k8s.io", "workloads", ("get", "list", "watch")),
    ("kueue.x-k8s.io", "localqueues", ("get", "list", "watch")),
}
PEERING_CLUSTER_RULE: Rule = ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"))
PEERING_NAMESPACED_RULE: Rule = ("kopf.dev", "kopfpeerings", ("list", "watch", "patch"))
PROFILER_RULES: set[Rule] = {("", "configmaps", ("create", "update"))}
#: Rank 0 writes the live summary: reads the job's live ConfigMap, patches it, creates
#: it when missing. Nothing else (no list, watch, delete, update).
WORKER_RULES: set[Rule] = {("", "configmaps", ("get", "create", "patch"))}


def _bound_roles(objs: list[Obj], sa: str) -> dict[tuple[str, str | None], Obj]:
    """The (Cluster)Roles bound to a service account, keyed by (kind, namespace)."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole") and not is_hook(o)
    }
    out = {}
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding") or is_hook(b):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles[(ref["kind"], ns, ref["name"])]
        out[(b["kind"], b["metadata"].get("namespace"))] = role
    return out


def test_no_wildcards_or_secrets_anywhere(rendered: dict[str, list[Obj]]) -> None:
    for scenario, objs in rendered.items():
        for role in (o for o in objs if o["kind"] in ("Role", "ClusterRole")):
            for rule in role["rules"]:
                flat = [*rule["apiGroups"], *rule["resources"], *rule["verbs"]]
                assert "*" not in flat, f"{scenario}: {role['metadata']['name']}: {rule}"
                assert "secrets" not in rule["resources"]
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_operator_rbac_all_namespaces(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    bound = _bound_roles(objs, "r-shardwise")
    assert (
        set(bound) == {("ClusterRoleBinding", None)} and len(find(objs, "ClusterRoleBinding")) == 2
    )
    cluster = one(objs, "ClusterRole", "r-shardwise-cluster")
    namespaced = one(objs, "ClusterRole", "r-shardwise-namespaced")
    assert rules(cluster) == OPERATOR_CLUSTER_RULES | {CRD_RULE}
    assert rules(namespaced) == OPERATOR_NAMESPACED_RULES


def test_operator_rbac_namespaced_is_split(rendered: dict[str, list[Obj]]) -> None:
    """A namespaced operator gets only cluster-scoped rules cluster-wide, and its
    namespaced rules in the served namespaces alone."""
    objs = rendered["namespaced"]
    bound = _bound_roles(objs, "r-shardwise")
    assert set(bound) == {
        ("ClusterRoleBinding", None),
        ("RoleBinding", "team-a"),
        ("RoleBinding", "team-b"),
    }
    assert rules(bound[("ClusterRoleBinding", None)]) == OPERATOR_CLUSTER_RULES
    for ns in ("team-a", "team-b"):
        assert rules(bound[("RoleBinding", ns)]) == OPERATOR_NAMESPACED_RULES
    assert not find(objs, "ClusterRole", "r-shardwise-namespaced")
    # The operator's bindings in other namespaces name its service account in the release's.
    for binding in find(objs, "RoleBinding") + find(objs, "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            if subject["name"] == "r-shardwise":
                assert subject["namespace"] == NS


def test_peering_rbac_follows_the_scope(rendered: dict[str, list[Obj]]) -> None:
    cluster = _bound_roles(rendered["peering-cluster"], "r-shardwise")
    assert PEERING_CLUSTER_RULE in rules(cluster[("ClusterRoleBinding", None)]) | rules(
        one(rendered["peering-cluster"], "ClusterRole", "r-shardwise-cluster")
    )
    assert one(rendered["peering-cluster"], "ClusterKopfPeering")["metadata"]["name"] == "shardwise"
    ns = _bound_roles(rendered["peering-namespaced"], "r-shardwise")
    assert PEERING_NAMESPACED_RULE in rules(ns[("RoleBinding", "team-a")])
    assert PEERING_CLUSTER_RULE not in rules(ns[("ClusterRoleBinding", None)])
    assert one(rendered["peering-namespaced"], "KopfPeering")["metadata"]["namespace"] == "team-a"
    for scenario in ("default", "namespaced"):
        flat = set().union(
            *(
                rules(r)
                for r in find(rendered[scenario], "ClusterRole") + find(rendered[scenario], "Role")
            )
        )
        assert not {r for r in flat if r[0] == "kopf.dev"}, scenario
    assert not find(rendered["standby"], "ClusterKopfPeering")


def test_profiler_service_account(rendered: dict[str, list[Obj]]) -> None:
    crd = yaml.safe_load(CRD.read_text())
    profiling = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["profiling"]
    default_sa = profiling["properties"]["serviceAccountName"]["default"]
    expected = {
        "default": [NS],
        "namespaced": ["team-a", "team-b"],
        "customized": ["team-a", "team-b"],
    }
    for scenario, namespaces in expected.items():
        objs = rendered[scenario]
        sas = [o for o in find(objs, "ServiceAccount", default_sa) if not is_hook(o)]
        assert sorted(o["metadata"]["namespace"] for o in sas) == namespaces, scenario
        bound = _bound_roles(objs, default_sa)
        assert set(bound) == {("RoleBinding", ns) for ns in namespaces}
        for role in bound.values():
            assert rules(role) == PROFILER_RULES
    assert not find(rendered["standby"], "ServiceAccount", default_sa)


def test_worker_service_account(rendered: dict[str, list[Obj]]) -> None:
    """The workers' account and Role go where the profiler's do (its own
    ``workers.namespaces`` overrides), bound to that account only."""
    expected = {
        "default": ("shardwise-worker", [NS]),
        "namespaced": ("shardwise-worker", ["team-a", "team-b"]),
        "namespaced-release-ns": ("shardwise-worker", [NS]),
        "customized": ("dlrm-worker", ["team-a"]),
    }
    for scenario, (sa, namespaces) in expected.items():
        objs = rendered[scenario]
        sas = [o for o in find(objs, "ServiceAccount", sa) if not is_hook(o)]
        assert sorted(o["metadata"]["namespace"] for o in sas) == namespaces, scenario
        bound = _bound_roles(objs, sa)
        assert set(bound) == {("RoleBinding", ns) for ns in namespaces}, scenario
        for role in bound.values():
            assert rules(role) == WORKER_RULES
            assert role["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    for scenario in ("standby", "minimal"):
        assert not find(rendered[scenario], "ServiceAccount", "shardwise-worker"), scenario


def test_aggregated_dlrmjob_roles(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    edit = one(objs, "ClusterRole", "r-shardwise-dlrmjobs-edit")
    view = one(objs, "ClusterRole", "r-shardwise-dlrmjobs-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert ("shardwise.dev", "dlrmjobs", ("get", "list", "watch")) in rules(view)
    assert all(verb in ("get", "list", "watch") for _, _, verbs in rules(view) for verb in verbs)
    # Users may not write the status: that is the operator's.
    assert all(
        not (res == "dlrmjobs/status" and set(verbs) - {"get"}) for _, res, verbs in rules(edit)
    )
    assert not find(rendered["standby"], "ClusterRole", "shardwise-standby-dlrmjobs-edit")


def test_rbac_rules_are_documented() -> None:
    """docs/operations.md lists every rule with its reason (the table under "RBAC")."""
    text = (ROOT / "docs" / "operations.md").read_text()
    documented = set()
    for m in re.finditer(r"^\| `([^`]*)` \| `([^`]+)` \| `([^`]+)` \|", text, re.MULTILINE):
        group, resource, verbs = m.groups()
        documented.add((group, resource, tuple(v.strip() for v in verbs.split(","))))
    expected = OPERATOR_CLUSTER_RULES | OPERATOR_NAMESPACED_RULES | PROFILER_RULES | {CRD_RULE}
    expected |= WORKER_RULES
    expected |= {PEERING_CLUSTER_RULE, PEERING_NAMESPACED_RULE}
    assert expected <= documented, sorted(expected - documented)


def test_minimal_renders_no_rbac(rendered: dict[str, list[Obj]]) -> None:
    objs = [o for o in rendered["minimal"] if not is_hook(o)]
    assert count_kinds(objs) == {"Deployment": 1}
    assert (
        one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing-sa"
    )


def test_the_worker_role_lets_rank_0_write_the_live_summary(
    rendered: dict[str, list[Obj]],
) -> None:
    """Evaluated as the API server's RBAC authorizer would (tests/k8s/rbac.py): the
    workers' account may read, create and patch the job's live ConfigMap where the chart
    created it, and nothing more: no list, update, delete, secrets or other namespace."""
    from k8s.rbac import RbacAuthorizer, request_attributes, service_account

    authz = RbacAuthorizer(rendered["namespaced"])
    worker = service_account("team-a", "shardwise-worker")
    cms = "/api/v1/namespaces/team-a/configmaps"

    def may(method: str, path: str) -> bool:
        return authz.allowed(worker, request_attributes(method, path, {}))

    assert may("GET", f"{cms}/dj-live") and may("PATCH", f"{cms}/dj-live") and may("POST", cms)
    assert not may("GET", cms), "no list"
    assert not may("PUT", f"{cms}/dj-live") and not may("DELETE", f"{cms}/dj-live")
    assert not may("GET", "/api/v1/namespaces/team-a/secrets/x")
    assert not may("PATCH", "/api/v1/namespaces/team-c/configmaps/dj-live")
    # The profiler's account got no more than it had.
    profiler = service_account("team-a", "shardwise-profiler")
    assert not authz.allowed(profiler, request_attributes("PATCH", f"{cms}/dj-live", {}))


def test_kueue_off_drops_the_workloads_rule_and_tells_the_operator(tmp_path: Path) -> None:
    """`kueue.enabled: false` (no Kueue on the cluster, or no right to read it): no
    Kueue rule, and the operator runs with --no-kueue so it never watches them;
    a profiling queue is passed on."""
    on = render(tmp_path, {"kueue": {"profilingQueue": "profiling"}})
    off = render(tmp_path, {"kueue": {"enabled": False}})
    read = ("get", "list", "watch")
    workloads = ("kueue.x-k8s.io", "workloads", read)
    queues = ("kueue.x-k8s.io", "clusterqueues", read)
    assert workloads in rules(one(on, "ClusterRole", "r-shardwise-namespaced"))
    assert queues in rules(one(on, "ClusterRole", "r-shardwise-cluster"))
    for role in ("r-shardwise-namespaced", "r-shardwise-cluster"):
        assert not {r for r in rules(one(off, "ClusterRole", role)) if r[0] == "kueue.x-k8s.io"}
    assert "--profiling-queue=profiling" in operator_container(on)["args"]
    assert "--no-kueue" not in operator_container(on)["args"]
    assert "--no-kueue" in operator_container(off)["args"]
