"""The Kubernetes API behaviours the operator relies on, stated as tests.

They run against the API emulator (``tests/k8s``) by default. With
``SHARDWISE_CONTRACT_CLUSTER=1`` they run against the cluster of the current
kubeconfig instead (a throwaway namespace is created and deleted; the DLRMJob CRD is
installed if missing, which needs cluster-admin), so the emulator can be checked
against the real thing. Garbage collection is asynchronous on a real cluster, hence
the waits.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from k8s.helpers import CRD_PATH, wait_for
from k8s.server import EmulatorServer

from shardwise.operator.kube import ApiError, KubeApi

REAL = os.environ.get("SHARDWISE_CONTRACT_CLUSTER") == "1"
DJ = ("shardwise.dev/v1alpha1", "dlrmjobs")


@dataclass
class Cluster:
    kube: KubeApi
    ns: str
    real: bool


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    server = None
    if REAL:
        kube = KubeApi.from_environment()
        ns = f"sw-contract-{uuid.uuid4().hex[:6]}"
    else:
        server = EmulatorServer().start()
        kube = KubeApi.for_host(server.url)
        ns = "contract"
    if (
        kube.get(
            "apiextensions.k8s.io/v1", "customresourcedefinitions", None, crd["metadata"]["name"]
        )
        is None
    ):
        kube.create(crd)
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    wait_for(lambda: kube.list(*DJ, ns) is not None, what="the DLRMJob API to be served")
    yield Cluster(kube, ns, REAL)
    if REAL:
        kube.delete("v1", "namespaces", None, ns)
    kube.close()
    if server is not None:
        server.stop()
        assert server.emulator.unexpected == []


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def configmap(
    ns: str, name: str, labels: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels or {}}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}, **extra}


def dlrmjob(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "shardwise.dev/v1alpha1",
        "kind": "DLRMJob",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "tables": {"inline": [{"name": "t0", "rows": 1000, "dim": 16, "poolingFactor": 1.0}]},
            "gpusPerWorker": 1,
            "workers": {"max": 1},
            "template": {"image": "example/shardwise:0.1.0"},
            **spec,
        },
    }


def suspended_job(ns: str, name: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Job that never runs a pod (suspended), for API behaviour alone."""
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if owner is not None:
        meta["ownerReferences"] = [owner_ref(owner)]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "suspend": True,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "busybox"}],
                }
            },
        },
    }


def owner_ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_create_stamps_server_metadata(cluster: Cluster) -> None:
    created = cluster.kube.create(dlrmjob(cluster.ns, _name("meta")))
    meta = created["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["namespace"] == cluster.ns
    assert meta["generation"] == 1
    cm = cluster.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"generateName": "gen-", "namespace": cluster.ns},
        }
    )
    assert cm["metadata"]["name"].startswith("gen-") and len(cm["metadata"]["name"]) > 4


def test_duplicate_create_is_409_already_exists(cluster: Cluster) -> None:
    name = _name("dup")
    cluster.kube.create(configmap(cluster.ns, name))
    with pytest.raises(ApiError) as err:
        cluster.kube.create(configmap(cluster.ns, name))
    assert err.value.status == 409 and err.value.reason == "AlreadyExists"


def test_status_is_a_separate_subresource(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("status")
    body = dlrmjob(ns, name)
    body["status"] = {"phase": "Running"}
    created = kube.create(body)
    assert "status" not in created, "status is ignored on create"
    rv0 = created["metadata"]["resourceVersion"]

    after_status = kube.patch(
        *DJ, ns, name, {"status": {"phase": "Pending"}, "spec": {"gpusPerWorker": 7}}, "status"
    )
    assert after_status["status"]["phase"] == "Pending"
    assert after_status["spec"]["gpusPerWorker"] == 1, "a status write changes nothing else"
    assert after_status["metadata"]["generation"] == 1, "a status write keeps the generation"
    assert after_status["metadata"]["resourceVersion"] != rv0

    after_spec = kube.patch(
        *DJ, ns, name, {"spec": {"gpusPerWorker": 2}, "status": {"phase": "Failed"}}
    )
    assert after_spec["spec"]["gpusPerWorker"] == 2
    assert after_spec["status"]["phase"] == "Pending", "an object write ignores status"
    assert after_spec["metadata"]["generation"] == 2, "a spec change bumps the generation"

    same = kube.patch(*DJ, ns, name, {"spec": {"gpusPerWorker": 2}})
    assert same["metadata"]["resourceVersion"] == after_spec["metadata"]["resourceVersion"], (
        "a no-op write changes nothing, not even the resourceVersion"
    )
    labelled = kube.patch(*DJ, ns, name, {"metadata": {"labels": {"team": "ads"}}})
    assert labelled["metadata"]["generation"] == 2, "metadata changes keep the generation"


def test_stale_resource_version_is_409(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("rv")
    created = kube.create(configmap(ns, name))
    kube.patch("v1", "configmaps", ns, name, {"data": {"k": "w"}})
    stale = {
        "metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
        "data": {"k": "x"},
    }
    with pytest.raises(ApiError) as err:
        kube.patch("v1", "configmaps", ns, name, stale)
    assert err.value.status == 409


def test_label_selectors_on_lists(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    run = uuid.uuid4().hex[:6]
    for name, labels in (
        ("a", {"app": "x", "tier": "1"}),
        ("b", {"app": "y"}),
        ("c", {"app": "x"}),
    ):
        kube.create(configmap(ns, f"sel-{run}-{name}", {"run": run, **labels}))

    def names(selector: str) -> list[str]:
        found = kube.list("v1", "configmaps", ns, f"run={run},{selector}")
        return sorted(o["metadata"]["name"].rsplit("-", 1)[1] for o in found)

    assert names("app=x") == ["a", "c"]
    assert names("app!=x") == ["b"]
    assert names("app in (x,y)") == ["a", "b", "c"]
    assert names("tier") == ["a"]
    assert names("!tier") == ["b", "c"]


def test_list_response_names_its_kind(cluster: Cluster) -> None:
    result = cluster.kube.request("GET", f"/api/v1/namespaces/{cluster.ns}/configmaps")
    assert result["kind"] == "ConfigMapList" and result["apiVersion"] == "v1"
    assert result["metadata"]["resourceVersion"]
    custom = cluster.kube.request(
        "GET", f"/apis/shardwise.dev/v1alpha1/namespaces/{cluster.ns}/dlrmjobs"
    )
    assert custom["kind"] == "DLRMJobList"


def _watch(cluster: Cluster, path: str, since: str, seconds: int = 2) -> list[dict[str, Any]]:
    """Every event of a watch from ``since`` until the server ends it after ``seconds``."""
    ac = cluster.kube.api_client
    query = [("watch", "true"), ("resourceVersion", since), ("timeoutSeconds", str(seconds))]
    method, url, headers, _, _ = ac.param_serialize(
        method="GET",
        resource_path=path,
        query_params=query,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = ac.call_api(method, url, header_params=headers, _request_timeout=seconds + 10)
    return [json.loads(line) for line in response.read().splitlines() if line.strip()]


def test_watch_from_a_resource_version_replays_later_events(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    since = kube.request("GET", f"/api/v1/namespaces/{ns}/configmaps")["metadata"][
        "resourceVersion"
    ]
    name = _name("watched")
    kube.create(configmap(ns, name, {"watch": "me"}))
    kube.patch("v1", "configmaps", ns, name, {"data": {"k": "changed"}})
    kube.delete("v1", "configmaps", ns, name)
    events = _watch(cluster, f"/api/v1/namespaces/{ns}/configmaps", since)
    mine = [
        (e["type"], e["object"]["data"]["k"])
        for e in events
        if e["object"]["metadata"]["name"] == name
    ]
    assert mine == [("ADDED", "v"), ("MODIFIED", "changed"), ("DELETED", "changed")]


def test_schema_rejects_invalid_custom_resources_with_422(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    for spec, field in (
        ({"workers": {"min": 0, "max": 1}}, "spec.workers.min"),
        ({"workers": {"min": 3, "max": 2}}, "spec.workers"),
        ({"profiling": {"policy": "Sometimes"}}, "spec.profiling.policy"),
    ):
        with pytest.raises(ApiError) as err:
            kube.create(dlrmjob(ns, _name("bad"), **spec))
        assert err.value.status == 422
        causes = (err.value.body.get("details") or {}).get("causes") or []
        assert any(c.get("field") == field for c in causes), (field, causes)


def test_schema_defaults_and_prunes(cluster: Cluster) -> None:
    body = dlrmjob(cluster.ns, _name("defaults"))
    body["spec"]["notAField"] = 1
    created = cluster.kube.create(body)
    assert "notAField" not in created["spec"]
    assert created["spec"]["planner"]["algorithm"] == "neuroshard"
    assert created["spec"]["workers"]["min"] == 1
    assert created["spec"]["profiling"]["policy"] == "IfStale"


def test_status_writes_are_validated_too(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("badstatus")
    kube.create(dlrmjob(ns, name))
    with pytest.raises(ApiError) as err:
        kube.patch(*DJ, ns, name, {"status": {"phase": "Dancing"}}, "status")
    assert err.value.status == 422


def test_immutable_configmap_refuses_new_data(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("frozen")
    kube.create(configmap(ns, name, immutable=True))
    with pytest.raises(ApiError) as err:
        kube.patch("v1", "configmaps", ns, name, {"data": {"k": "other"}})
    assert err.value.status == 422
    relabelled = kube.patch("v1", "configmaps", ns, name, {"metadata": {"annotations": {"a": "b"}}})
    assert relabelled["metadata"]["annotations"] == {"a": "b"}, "metadata stays mutable"


def test_job_pod_template_is_immutable(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("job")
    kube.create(suspended_job(ns, name))
    template = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "other"}]}}}}
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", ns, name, template)
    assert err.value.status == 422
    resumed = kube.patch("batch/v1", "jobs", ns, name, {"spec": {"suspend": False}})
    assert resumed["spec"]["suspend"] is False, "suspend stays mutable"
    kube.delete("batch/v1", "jobs", ns, name)


def test_deleting_an_owner_collects_its_dependents(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    owner = kube.create(dlrmjob(ns, _name("owner")))
    child = configmap(ns, _name("child"))
    child["metadata"]["ownerReferences"] = [owner_ref(owner)]
    child_cm = kube.create(child)
    child_job = kube.create(suspended_job(ns, _name("child-job"), owner))
    kube.delete(*DJ, ns, owner["metadata"]["name"])
    for api, plural, obj in (("v1", "configmaps", child_cm), ("batch/v1", "jobs", child_job)):
        wait_for(
            lambda a=api, p=plural, o=obj: kube.get(a, p, ns, o["metadata"]["name"]) is None,
            timeout=60,
            what=f"{plural} {obj['metadata']['name']} to be garbage-collected",
        )


def test_orphan_propagation_keeps_dependents(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    owner = kube.create(dlrmjob(ns, _name("owner")))
    name = _name("kept")
    kube.create(
        {
            **configmap(ns, name),
            "metadata": {"name": name, "namespace": ns, "ownerReferences": [owner_ref(owner)]},
        }
    )
    kube.delete(*DJ, ns, owner["metadata"]["name"], propagation="Orphan")
    wait_for(
        lambda: kube.get(*DJ, ns, owner["metadata"]["name"]) is None,
        timeout=60,
        what="the owner to go",
    )
    kept = wait_for(
        lambda: (
            (cm := kube.get("v1", "configmaps", ns, name))
            and not cm["metadata"].get("ownerReferences")
            and cm
        ),
        timeout=60,
        what="the orphaned ConfigMap to lose its owner reference",
    )
    assert kept["metadata"]["name"] == name


def test_finalizers_hold_deletion_until_removed(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("final")
    body = configmap(ns, name)
    body["metadata"]["finalizers"] = ["shardwise.dev/test"]
    kube.create(body)
    kube.delete("v1", "configmaps", ns, name)
    held = kube.get("v1", "configmaps", ns, name)
    assert held is not None and held["metadata"].get("deletionTimestamp")
    kube.patch("v1", "configmaps", ns, name, {"metadata": {"finalizers": None}})
    wait_for(
        lambda: kube.get("v1", "configmaps", ns, name) is None, what="deletion after the finalizer"
    )


def test_configmaps_are_limited_to_one_mebibyte(cluster: Cluster) -> None:
    body = configmap(cluster.ns, _name("big"))
    body["data"] = {"k": "x" * ((1 << 20) + 1)}
    with pytest.raises(ApiError) as err:
        cluster.kube.create(copy.deepcopy(body))
    assert err.value.status in (413, 422)


def test_foreground_deletion_waits_for_dependents(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    owner = kube.create(suspended_job(ns, _name("fg")))
    name = _name("held")
    child = configmap(ns, name)
    child["metadata"]["ownerReferences"] = [owner_ref(owner)]
    child["metadata"]["finalizers"] = ["shardwise.dev/test"]
    kube.create(child)
    kube.delete("batch/v1", "jobs", ns, owner["metadata"]["name"], propagation="Foreground")
    held = wait_for(
        lambda: (
            (cm := kube.get("v1", "configmaps", ns, name))
            and cm["metadata"].get("deletionTimestamp")
            and cm
        ),
        timeout=60,
        what="the dependent to be deleting",
    )
    assert held["metadata"]["finalizers"] == ["shardwise.dev/test"]
    job = kube.get("batch/v1", "jobs", ns, owner["metadata"]["name"])
    assert job is not None and job["metadata"].get("deletionTimestamp"), "the owner waits"
    kube.patch("v1", "configmaps", ns, name, {"metadata": {"finalizers": None}})
    wait_for(
        lambda: kube.get("batch/v1", "jobs", ns, owner["metadata"]["name"]) is None,
        timeout=60,
        what="the owner to go once its dependents are gone",
    )


def test_dependents_of_an_owner_that_does_not_exist_are_collected(cluster: Cluster) -> None:
    kube, ns, name = cluster.kube, cluster.ns, _name("dangling")
    body = configmap(ns, name)
    ghost = {
        "metadata": {"name": "ghost", "uid": str(uuid.uuid4())},
        "apiVersion": "v1",
        "kind": "ConfigMap",
    }
    body["metadata"]["ownerReferences"] = [owner_ref(ghost)]
    kube.create(body)
    wait_for(lambda: kube.get("v1", "configmaps", ns, name) is None, timeout=60, what="collection")
