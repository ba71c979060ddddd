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
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import kueue
from k8s import kueue_slices as slices
from k8s.helpers import CRD_PATH, wait_for
from k8s.server import EmulatorServer

from shardwise.operator.cluster.quota import ClusterQueueInfo, cluster_queue_info
from shardwise.operator.kube import ApiError, KubeApi, resource_path

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
    """A Job that never runs a pod, for API behaviour alone: suspended, and should a test
    resume it, its pod selects a node that no cluster has (a pod bound to a node without
    a kubelet could never finish terminating)."""
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
                    "nodeSelector": {"shardwise.dev/contract-test": "no-such-node"},
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


def test_a_watch_by_field_selector_sees_only_that_name(cluster: Cluster) -> None:
    """The operator watches one user ConfigMap by name (operator/loop/tableswatch.py):
    from a filtered list's version, only that name's later changes arrive."""
    kube, ns = cluster.kube, cluster.ns
    name, other = _name("one"), _name("other")
    items, since = kube.list_version("v1", "configmaps", ns, f"metadata.name={name}")
    assert items == () and since
    kube.create(configmap(ns, other))
    kube.create(configmap(ns, name))
    kube.patch("v1", "configmaps", ns, name, {"data": {"k": "changed"}})
    seen = [
        (e["type"], e["object"]["metadata"]["name"], e["object"]["data"]["k"])
        for e in kube.watch(
            "v1", "configmaps", ns, field_selector=f"metadata.name={name}",
            resource_version=since, timeout_seconds=2,
        )
    ]  # fmt: skip
    assert seen == [("ADDED", name, "v"), ("MODIFIED", name, "changed")]
    kube.delete("v1", "configmaps", ns, name)
    kube.delete("v1", "configmaps", ns, other)


def test_an_event_is_counted_by_patching_the_one_posted(cluster: Cluster) -> None:
    """The operator counts a repeated Event (operator/events.py): a second create of the
    same name is a 409, a merge patch raises the count; an Event must live in the
    namespace of the object it is about."""
    kube, ns = cluster.kube, cluster.ns
    about = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "namespace": ns, "uid": "u"}
    name = _name("x.0123456789abcdef")
    body = {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": ns},
        "involvedObject": about, "type": "Warning", "reason": "Tested", "message": "m",
        "count": 1, "firstTimestamp": "2026-11-26T10:00:00Z",
        "lastTimestamp": "2026-11-26T10:00:00Z", "source": {"component": "contract"},
    }  # fmt: skip
    kube.create(body)
    with pytest.raises(ApiError) as again:
        kube.create(body)
    assert again.value.status == 409
    kube.patch("v1", "events", ns, name, {"count": 2, "lastTimestamp": "2026-11-26T10:01:00Z"})
    got = kube.get("v1", "events", ns, name)
    assert (
        got is not None
        and got["count"] == 2
        and got["lastTimestamp"].startswith("2026-11-26T10:01")
    )
    elsewhere = {**body, "metadata": {"name": _name("y.0123"), "namespace": ns}}
    elsewhere["involvedObject"] = {**about, "namespace": "kube-system"}
    with pytest.raises(ApiError) as wrong:
        kube.create(elsewhere)
    assert wrong.value.status == 422 and "involvedObject.namespace" in wrong.value.message
    kube.delete("v1", "events", ns, name)


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


# --------------------------------------------------------------------------- CRD creation
# Throwaway CRDs under this group pin what the API server checks when a CRD is created
# (and then how it words its 422s for custom resources), so that the emulator, which
# refuses the same CRDs in the same words, is checked against a real server.
TEST_GROUP = "contract.shardwise.dev"
CRDS = ("apiextensions.k8s.io/v1", "customresourcedefinitions")
SCHEMA_PATH = "spec.validation.openAPIV3Schema"
NOT_CHECKED = (
    "<nil>",
    "Invalid value: null: some validation rules were not checked because the object was "
    "invalid; correct the existing errors to complete validation",
)


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **extra}


def _with_spec(spec_properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return _obj({"spec": _obj(spec_properties, **extra)})


def _crd(schema: dict[str, Any], status: bool = False, **version: Any) -> dict[str, Any]:
    plural = f"w{uuid.uuid4().hex[:8]}s"
    kind = plural[:-1].capitalize()
    v1: dict[str, Any] = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        **version,
    }
    if status:
        v1["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{TEST_GROUP}"},
        "spec": {
            "group": TEST_GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": kind},
            "versions": [v1],
        },
    }


def _causes(err: ApiError) -> list[tuple[str, str]]:
    body = err.body if isinstance(err.body, dict) else {}
    causes = (body.get("details") or {}).get("causes") or []
    return [(c.get("field"), c.get("message")) for c in causes]


def _refused(cluster: Cluster, crd: dict[str, Any]) -> list[tuple[str, str]]:
    """The (field, message) causes of the 422 that creating ``crd`` gets."""
    try:
        cluster.kube.create(crd)
    except ApiError as err:
        assert err.status == 422, err.message
        return _causes(err)
    cluster.kube.delete(*CRDS, None, crd["metadata"]["name"])
    raise AssertionError(f"the API server accepted {crd['metadata']['name']}")


def _rule(rule: str, **fields: Any) -> str:
    """A rule as the server prints it in an error: its Go struct, as JSON."""
    shown = {"Rule": rule, "Message": "", "MessageExpression": "", "Reason": None}
    shown |= {"FieldPath": "", "OptionalOldSelf": None} | fields
    return json.dumps(shown, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def test_crd_defaults_are_checked_by_cel_as_written(cluster: Cluster) -> None:
    """A rule reading an optional field fails on a ``default: {}``: the default is checked
    as written, without the defaults of its own fields (so ``device`` is missing)."""
    planner = _obj(
        {"device": {"type": "string", "default": "cuda"}, "mem": {"type": "integer"}},
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "self.device != 'cpu' || has(self.mem)",
                    "message": "mem is required when device is cpu",
                }
            ]
        },
    )
    assert _refused(cluster, _crd(_with_spec({"planner": planner}))) == [
        (
            f"{SCHEMA_PATH}.properties[spec].properties[planner].default",
            'Invalid value: "object": no such key: device evaluating rule: '
            "mem is required when device is cpu",
        )
    ]
    guarded = copy.deepcopy(planner)
    guarded["x-kubernetes-validations"][0]["rule"] = (
        "!has(self.device) || self.device != 'cpu' || has(self.mem)"
    )
    crd = _crd(_with_spec({"planner": guarded}))
    cluster.kube.create(crd)
    cluster.kube.delete(*CRDS, None, crd["metadata"]["name"])


def test_crd_defaults_must_fit_their_schema(cluster: Cluster) -> None:
    at = f"{SCHEMA_PATH}.properties[spec].properties"
    for prop, expected in (
        (
            {"n": {"type": "integer", "default": "three"}},
            (
                f"{at}[n].default",
                'Invalid value: "string":  in body must be of type integer: "string"',
            ),
        ),
        (
            {"n": {"type": "integer", "minimum": 1, "default": 0}},
            (f"{at}[n].default", "Invalid value: 0:  in body should be greater than or equal to 1"),
        ),
        (
            {"p": {"type": "string", "enum": ["A", "B"], "default": "C"}},
            (f"{at}[p].default", 'Unsupported value: "C": supported values: "A", "B"'),
        ),
        (
            {"o": _obj({"a": {"type": "integer", "maximum": 3}}, default={"a": 4})},
            (f"{at}[o].default.a", "Invalid value: 4: a in body should be less than or equal to 3"),
        ),
        (
            {"o": _obj({"a": {"type": "string"}}, default={"b": "x"})},
            (f"{at}[o].default", 'Invalid value: {"b":"x"}: must not have unknown fields'),
        ),
        (
            {
                "w": _obj(
                    {"a": {"type": "integer"}},
                    default={"a": 5},
                    **{
                        "x-kubernetes-validations": [
                            {"rule": "self.a < 3", "message": "a below 3", "fieldPath": ".a"}
                        ]
                    },
                )
            },
            (f"{at}[w].default.a", "Invalid value: a below 3"),
        ),
    ):
        assert _refused(cluster, _crd(_with_spec(prop))) == [expected], prop


def test_crd_schemas_must_be_structural(cluster: Cluster) -> None:
    at = f"{SCHEMA_PATH}.properties[spec].properties"
    for schema, expected in (
        (
            _with_spec({"x": {"description": "no type"}}),
            (f"{at}[x].type", "Required value: must not be empty for specified object fields"),
        ),
        (
            _with_spec({"x": {"type": "array"}}),
            (f"{at}[x].items", "Required value: must be specified"),
        ),
        (
            _with_spec({"x": {"type": "string", "anyOf": [{"type": "string", "pattern": "^a"}]}}),
            (f"{at}[x].anyOf[0].type", "Forbidden: must be empty to be structural"),
        ),
        (
            _with_spec(
                {"x": _obj({"a": {"type": "string"}}, additionalProperties={"type": "string"})}
            ),
            (
                f"{at}[x].additionalProperties",
                "Forbidden: additionalProperties and properties are mutual exclusive",
            ),
        ),
        (
            _obj({"metadata": _obj({"labels": {"type": "object"}}), "spec": {"type": "object"}}),
            (
                f"{SCHEMA_PATH}.properties[metadata]",
                "Forbidden: must not specify anything other than name and generateName, but "
                "metadata is implicitly specified",
            ),
        ),
        (
            _with_spec(
                {
                    "l": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["k"],
                        "items": _obj({"k": {"type": "string"}}),
                    }
                }
            ),
            (
                f"{at}[l].items.properties[k].default",
                "Required value: this property is in x-kubernetes-list-map-keys, so it must "
                "have a default or be a required property",
            ),
        ),
        (
            _with_spec({"s": {"type": "string", "pattern": "^(a"}}),
            (
                f"{at}[s].pattern",
                'Invalid value: "^(a": must be a valid regular expression, but isn\'t: error '
                "parsing regexp: missing closing ): `^(a`",
            ),
        ),
    ):
        assert _refused(cluster, _crd(schema)) == [expected], schema


def test_crd_rules_must_compile(cluster: Cluster) -> None:
    at = f"{SCHEMA_PATH}.properties[spec].x-kubernetes-validations[0].rule"
    for rule, detail in (
        (
            "self.devic == 'cpu'",
            "compilation failed: ERROR: <input>:1:5: undefined field 'devic'\n"
            " | self.devic == 'cpu'\n | ....^",
        ),
        (
            "!has(self.devic) || true",
            "compilation failed: ERROR: <input>:1:5: undefined field 'devic'\n"
            " | !has(self.devic) || true\n | ....^",
        ),
        ("self.device + 'x'", "cel expression must evaluate to a bool"),
    ):
        schema = _with_spec(
            {"device": {"type": "string"}}, **{"x-kubernetes-validations": [{"rule": rule}]}
        )
        assert _refused(cluster, _crd(schema)) == [(at, f"Invalid value: {_rule(rule)}: {detail}")]
    root = _obj(
        {"spec": {"type": "object"}},
        **{"x-kubernetes-validations": [{"rule": "size(self.metadata.labels) < 3"}]},
    )
    (field, message), *_ = _refused(cluster, _crd(root))
    assert field == f"{SCHEMA_PATH}.x-kubernetes-validations[0].rule"
    assert "undefined field 'labels'" in message, "a root rule sees only metadata.name"


def test_crd_rule_cost_is_estimated_against_the_budget(cluster: Cluster) -> None:
    hint = (
        "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where "
        "arrays, maps, and strings are declared)"
    )
    items_rule = (
        f"{SCHEMA_PATH}.properties[spec].properties[l].items.x-kubernetes-validations[0].rule"
    )
    matches = {"type": "string", "x-kubernetes-validations": [{"rule": "self.matches('^[a-z]+$')"}]}
    bounded = _with_spec({"l": {"type": "array", "maxItems": 100, "items": matches}})
    assert _refused(cluster, _crd(bounded)) == [
        (items_rule, f"Forbidden: estimated rule cost exceeds budget by factor of 6.3x {hint}")
    ]
    unbounded = _with_spec({"l": {"type": "array", "items": matches}})
    assert _refused(cluster, _crd(unbounded)) == [
        (
            items_rule,
            f"Forbidden: estimated rule cost exceeds budget by factor of more than 100x {hint}",
        ),
        (
            items_rule,
            "Forbidden: contributed to estimated rule cost total exceeding cost limit for "
            "entire OpenAPIv3 schema",
        ),
        (
            SCHEMA_PATH,
            "Forbidden: x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 "
            f"schema exceeds budget by factor of more than 100x {hint}",
        ),
    ]
    small = {**matches, "maxLength": 64}
    crd = _crd(_with_spec({"l": {"type": "array", "maxItems": 10, "items": small}}))
    cluster.kube.create(crd)
    cluster.kube.delete(*CRDS, None, crd["metadata"]["name"])


def test_crd_versions_with_their_own_schemas_are_checked_each(cluster: Cluster) -> None:
    """Versions sharing one schema are checked once, as ``spec.validation``; otherwise
    each at ``spec.versions[i].schema``."""
    bad = _with_spec({"a": {"type": "integer", "default": "x"}})
    two = _crd(bad)
    two["spec"]["versions"].append(
        {
            "name": "v2",
            "served": True,
            "storage": False,
            "schema": {"openAPIV3Schema": _with_spec({"b": {"type": "string"}})},
        }
    )
    assert _refused(cluster, two) == [
        (
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[a].default",
            'Invalid value: "string":  in body must be of type integer: "string"',
        )
    ]


@contextmanager
def _served(cluster: Cluster, schema: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """A throwaway CRD with ``schema`` and a status subresource: (apiVersion, plural, kind)."""
    crd = _crd(schema, status=True)
    cluster.kube.create(crd)
    api, plural = f"{TEST_GROUP}/v1", crd["spec"]["names"]["plural"]
    try:
        wait_for(
            lambda: cluster.kube.list(api, plural, cluster.ns) is not None,
            timeout=60,
            what=f"{plural} to be served",
        )
        yield api, plural, crd["spec"]["names"]["kind"]
    finally:
        cluster.kube.delete(*CRDS, None, crd["metadata"]["name"])


def test_custom_resource_422s_name_fields_and_values_as_the_server_does(cluster: Cluster) -> None:
    """How the server words each kind of refusal of a custom resource."""
    spec = _obj(
        {
            "a": {
                "type": "integer",
                "x-kubernetes-validations": [{"rule": "self < 10", "message": "a below 10"}],
            },
            "s": {"type": "string", "maxLength": 20},
            "o": _obj(
                {"p": {"type": "integer"}, "q": {"type": "integer"}},
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "self.p < self.q",
                            "messageExpression": "self.p > 100 ? 'huge' : 'p not below q'",
                        },
                        {
                            "rule": "self.p != 7",
                            "reason": "FieldValueForbidden",
                            "message": "p may not be 7",
                            "fieldPath": ".p",
                        },
                    ]
                },
            ),
            "l": {
                "type": "array",
                "maxItems": 3,
                "x-kubernetes-list-type": "set",
                "items": {"type": "string"},
            },
            "n": {"type": "integer", "x-kubernetes-validations": [{"rule": "100 / self > 1"}]},
            "q": {"x-kubernetes-int-or-string": True},
        }
    )
    status = _obj({"count": {"type": "integer", "minimum": 0}})
    schema = _obj(
        {"spec": spec, "status": status},
        **{
            "x-kubernetes-validations": [
                {"rule": "self.metadata.name != 'forbidden'", "message": "bad name"}
            ]
        },
    )
    with _served(cluster, schema) as (api, plural, kind):

        def refused(name: str, **fields: Any) -> list[tuple[str, str]]:
            body = {"apiVersion": api, "kind": kind, "metadata": {"name": name}, "spec": fields}
            with pytest.raises(ApiError) as err:
                cluster.kube.request(
                    "POST", f"/apis/{api}/namespaces/{cluster.ns}/{plural}", body=body
                )
            assert err.value.status == 422
            return _causes(err.value)

        assert refused("a", a=12) == [("spec.a", "Invalid value: 12: a below 10")]
        assert refused("forbidden") == [("<nil>", "Invalid value: bad name")]
        assert refused("o", o={"p": 5, "q": 3}) == [("spec.o", "Invalid value: p not below q")]
        assert refused("p", o={"p": 7, "q": 9}) == [("spec.o.p", "Forbidden: p may not be 7")]
        assert refused("k", o={"p": 1}) == [
            ("spec.o", 'Invalid value: "object": no such key: q evaluating rule: self.p < self.q')
        ]
        assert refused("z", n=0) == [
            ("spec.n", 'Invalid value: "integer": division by zero evaluating rule: 100 / self > 1')
        ]
        assert refused("d", l=["a", "b", "a"]) == [("spec.l[2]", 'Duplicate value: "a"')]
        assert refused("m", l=["a", "b", "c", "d"]) == [
            ("spec.l", "Too many: 4: must have at most 3 items"),
            NOT_CHECKED,
        ]
        assert refused("t", s="x" * 21, a=12) == [
            ("spec.s", "Too long: may not be more than 20 bytes"),
            NOT_CHECKED,
        ], "a Too long error stops the rules (a=12 goes unreported)"
        assert refused("b", q=True) == [
            (
                "spec.q",
                'Invalid value: "boolean": spec.q in body must be of type integer,string: '
                '"boolean"',
            ),
            NOT_CHECKED,
        ]
        assert refused("f", a=16.5) == [
            ("spec.a", 'Invalid value: "number": spec.a in body must be of type integer: "number"'),
            (
                "<nil>",
                'Invalid value: "": Checked value must be of type integer (default format) in '
                "spec.a",
            ),
            NOT_CHECKED,
        ]
        body = {"apiVersion": api, "kind": kind, "metadata": {"name": "st"}, "spec": {"a": 1}}
        cluster.kube.request("POST", f"/apis/{api}/namespaces/{cluster.ns}/{plural}", body=body)
        with pytest.raises(ApiError) as err:
            cluster.kube.patch(api, plural, cluster.ns, "st", {"status": {"count": -1}}, "status")
        assert _causes(err.value) == [
            (
                "status.count",
                "Invalid value: -1: count in body should be greater than or equal to 0",
            )
        ], "a status write is checked against the status schema, its names relative to status"


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
INVALID_EXAMPLES = sorted((EXAMPLES[0].parent / "invalid").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_accepted(cluster: Cluster, path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = cluster.ns  # as `kubectl apply -n NS -f` does
    created = cluster.kube.create(body)
    cluster.kube.delete(*DJ, cluster.ns, created["metadata"]["name"])


@pytest.mark.parametrize("path", INVALID_EXAMPLES, ids=[p.stem for p in INVALID_EXAMPLES])
def test_invalid_examples_are_refused_as_their_headers_say(cluster: Cluster, path: Path) -> None:
    text = path.read_text()
    field = text.split("# expect-field: ")[1].splitlines()[0]
    message = text.split("# expect-message: ")[1].splitlines()[0]
    body = yaml.safe_load(text)
    body["metadata"]["namespace"] = cluster.ns
    with pytest.raises(ApiError) as err:
        cluster.kube.create(body)
    assert err.value.status == 422
    causes = _causes(err.value)
    assert any(f == field and message in m for f, m in causes), causes


def test_a_pod_on_a_node_without_a_kubelet_terminates_only_when_forced(cluster: Cluster) -> None:
    kube, ns = cluster.kube, cluster.ns
    node = _name("contract-lost-node")
    # No kubelet reports on this node (no Ready condition), and it takes no new pods.
    kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
                 "spec": {"unschedulable": True}})  # fmt: skip
    try:
        name = _name("stranded")
        kube.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "c", "image": "busybox"}]},
        })  # fmt: skip
        kube.delete("v1", "pods", ns, name)
        held = kube.get("v1", "pods", ns, name)
        assert held is not None, "a bound pod waits for its kubelet to confirm"
        assert held["metadata"]["deletionTimestamp"]
        assert held["metadata"]["deletionGracePeriodSeconds"] == 5
        kube.delete("v1", "pods", ns, name, grace_period_seconds=0)
        wait_for(lambda: kube.get("v1", "pods", ns, name) is None, what="the forced deletion")
        unbound = _name("unbound")
        kube.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": unbound, "namespace": ns},
            "spec": {"nodeSelector": {"shardwise.dev/contract-test": "no-such-node"},
                     "containers": [{"name": "c", "image": "busybox"}]},
        })  # fmt: skip
        kube.delete("v1", "pods", ns, unbound)
        wait_for(lambda: kube.get("v1", "pods", ns, unbound) is None, what="an unbound pod to go")
    finally:
        kube.delete("v1", "nodes", None, node)


# --------------------------------------------------------------------------- Kueue
# What the operator relies on of Kueue (kueue.x-k8s.io/v1beta2, v0.15+, its batch/v1 Job
# integration). Against the emulator, the stand-in of k8s.kueue plays Kueue; on a real
# cluster, Kueue must be installed (else these are skipped). Quota is on cpu with tiny
# requests, which any cluster can quota, and the flavor's node label is on no node: no
# pod ever runs, only the Jobs' spec and the Workloads' status are read.

FLAVOR_LABEL = "shardwise.dev/contract-flavor"


@pytest.fixture(scope="module")
def kueue_running(cluster: Cluster) -> Iterator[None]:
    """Kueue serving and acting: the cluster's own, or the stand-in on the emulator."""
    if cluster.real:
        if not kueue.kueue_served(cluster.kube):
            pytest.skip("kueue.x-k8s.io/v1beta2 is not served here: install Kueue v0.15+")
        yield
        return
    stand_in = kueue.KueueCluster(cluster.kube.api_client.configuration.host).start()
    yield
    stand_in.stop()
    assert stand_in.errors == [], "\n".join(stand_in.errors)


def test_kueue_may_place_a_suspended_job_that_never_started(cluster: Cluster) -> None:
    """Kubernetes 1.27+: a suspended Job that has not started takes a new node selector
    (and tolerations, affinity, template labels and annotations), which Kueue writes
    when it admits it; the rest of its pod template stays immutable."""
    kube, ns, name = cluster.kube, cluster.ns, _name("placed")
    kube.create(suspended_job(ns, name))
    toleration = {"key": "pool", "operator": "Exists", "effect": "NoSchedule"}
    pod = {"nodeSelector": {FLAVOR_LABEL: "a"}, "tolerations": [toleration]}
    placed = {"spec": {"template": {"metadata": {"labels": {"pool": "a"}}, "spec": pod}}}
    got = kube.patch("batch/v1", "jobs", ns, name, placed)
    assert got["spec"]["template"]["spec"]["nodeSelector"] == {
        "shardwise.dev/contract-test": "no-such-node",
        FLAVOR_LABEL: "a",
    }
    assert got["spec"]["template"]["spec"]["tolerations"] == [toleration]
    image = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "other"}]}}}}
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", ns, name, image)
    assert err.value.status == 422
    kube.delete("batch/v1", "jobs", ns, name)


@dataclass
class Queues:
    """Kueue objects made for one test (unique names; deleted after it, Jobs first)."""

    kube: KubeApi
    ns: str
    real: bool
    made: list[tuple[str, str, str | None, str]]

    def _make(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        created = kueue.create_object(self.kube, body)
        meta = created["metadata"]
        self.made.append((body["apiVersion"], plural, meta.get("namespace"), meta["name"]))
        return created

    def _object(self, kind: str, plural: str, prefix: str, **fields: Any) -> str:
        meta = {"name": _name(prefix)}
        body = {"apiVersion": kueue.API, "kind": kind, "metadata": meta, **fields}
        if kind == "LocalQueue":
            body["metadata"]["namespace"] = self.ns
        return str(self._make(plural, body)["metadata"]["name"])

    def flavor(self) -> str:
        """A ResourceFlavor whose node label (its own name) no node has."""
        name = _name("contract-rf")
        spec = {"nodeLabels": {FLAVOR_LABEL: name}}
        body = {"apiVersion": kueue.API, "kind": "ResourceFlavor", "metadata": {"name": name}}
        self._make("resourceflavors", {**body, "spec": spec})
        return name

    def queue(self, cpu: str, preempt: bool = False) -> tuple[str, str, str]:
        """A LocalQueue into a ClusterQueue of ``cpu`` on a flavor of its own: the names
        of the LocalQueue, the ClusterQueue and the flavor."""
        flavor = self.flavor()
        quota = {"name": flavor, "resources": [{"name": "cpu", "nominalQuota": cpu}]}
        spec: dict[str, Any] = {
            "namespaceSelector": {},
            "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [quota]}],
        }
        if preempt:
            spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
        cq = self._object("ClusterQueue", "clusterqueues", "contract-cq", spec=spec)
        lq = self._object("LocalQueue", "localqueues", "contract-lq", spec={"clusterQueue": cq})
        return lq, cq, flavor

    def priority_class(self, value: int) -> str:
        return self._object("WorkloadPriorityClass", "workloadpriorityclasses", "contract-p",
                            value=value)  # fmt: skip

    def job(
        self, queue: str, cpu: str, priority_class: str | None = None, elastic: int = 0
    ) -> dict[str, Any]:
        """A Job for the queue, created suspended (what Kueue's webhook would make it);
        ``elastic``: an Indexed Job of that many pods that asks for workload slices."""
        body = suspended_job(self.ns, _name("queued"))
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: queue}
        if elastic:
            body["metadata"]["annotations"] = {slices.ELASTIC_ANNOTATION: "true"}
            body["spec"] |= {"completionMode": "Indexed", "completions": elastic,
                             "parallelism": elastic}  # fmt: skip
        if priority_class:
            body["metadata"]["labels"][kueue.PRIORITY_LABEL] = priority_class
        container = body["spec"]["template"]["spec"]["containers"][0]
        container["resources"] = {"requests": {"cpu": cpu}}
        return self._make("jobs", body)

    def spec(self, job: dict[str, Any]) -> dict[str, Any]:
        current = self.kube.get("batch/v1", "jobs", self.ns, job["metadata"]["name"]) or {}
        return dict(current.get("spec") or {})

    def workload(self, job: dict[str, Any], type_: str, status: str) -> dict[str, Any]:
        """The Job's Workload once its condition ``type_`` has ``status``."""

        def probe() -> dict[str, Any] | None:
            found = kueue.workloads_of(self.kube, job)
            ok = found and (kueue.condition(found[0], type_) or {}).get("status") == status
            return found[0] if ok else None

        what = f"{job['metadata']['name']}'s Workload with {type_}={status}"
        return wait_for(probe, what=what)


@pytest.fixture
def queues(cluster: Cluster, kueue_running: None) -> Iterator[Queues]:
    made = Queues(cluster.kube, cluster.ns, cluster.real, [])
    yield made
    for api, plural, ns, name in sorted(made.made, key=lambda m: m[1] != "jobs"):
        cluster.kube.delete(api, plural, ns, name)


def test_kueue_keeps_a_job_over_quota_suspended_and_says_why(queues: Queues) -> None:
    lq, _, flavor = queues.queue(cpu="100m")
    job = queues.job(lq, cpu="500m")
    wl = queues.workload(job, "QuotaReserved", "False")
    reserved = kueue.condition(wl, "QuotaReserved") or {}
    assert reserved["reason"] == "Pending"
    if queues.real:
        assert "cpu" in reserved["message"] and flavor in reserved["message"], reserved
    else:
        assert reserved["message"] == (
            f"couldn't assign flavors to pod set main: insufficient quota for cpu in flavor "
            f"{flavor}, request > maximum capacity (500m > 100m)"
        )
    assert (kueue.condition(wl, "Admitted") or {}).get("status") != "True"
    assert "admission" not in (wl.get("status") or {})
    assert queues.spec(job)["suspend"] is True


def test_kueue_admission_resumes_the_job_on_its_flavors_nodes(queues: Queues) -> None:
    lq, cq, flavor = queues.queue(cpu="200m")
    job = queues.job(lq, cpu="100m")
    wl = queues.workload(job, "Admitted", "True")
    assert (kueue.condition(wl, "QuotaReserved") or {}).get("status") == "True"
    admission = wl["status"]["admission"]
    assert admission["clusterQueue"] == cq
    assert admission["podSetAssignments"][0]["flavors"] == {"cpu": flavor}
    wait_for(lambda: queues.spec(job).get("suspend") is False, what="the admitted Job resumed")
    assert queues.spec(job)["template"]["spec"]["nodeSelector"] == {
        "shardwise.dev/contract-test": "no-such-node",
        FLAVOR_LABEL: flavor,
    }, "the flavor's node labels join the Job's own node selector"


@pytest.mark.slow
def test_kueue_preempts_a_lower_priority_job_for_a_higher_one(queues: Queues) -> None:
    lq, _, flavor = queues.queue(cpu="200m", preempt=True)
    low, high = queues.priority_class(100), queues.priority_class(1000)
    first = queues.job(lq, cpu="200m", priority_class=low)
    queues.workload(first, "Admitted", "True")
    wait_for(lambda: queues.spec(first).get("suspend") is False, what="the first Job to run")
    second = queues.job(lq, cpu="200m", priority_class=high)

    evicted = queues.workload(first, "Evicted", "True")
    cond = kueue.condition(evicted, "Evicted") or {}
    assert cond["reason"] == "Preempted"
    assert cond["message"].startswith("Preempted to accommodate a workload"), cond
    assert (kueue.condition(evicted, "Preempted") or {}).get("reason") == "InClusterQueue"
    wait_for(lambda: queues.spec(first).get("suspend") is True, what="the first Job suspended")
    selector = {"shardwise.dev/contract-test": "no-such-node"}
    wait_for(
        lambda: queues.spec(first)["template"]["spec"].get("nodeSelector") == selector,
        what="the preempted Job's node selector restored",
    )

    admitted = queues.workload(second, "Admitted", "True")
    assert admitted["status"]["admission"]["podSetAssignments"][0]["flavors"] == {"cpu": flavor}
    wait_for(lambda: queues.spec(second).get("suspend") is False, what="the second Job to run")
    requeued = queues.workload(first, "QuotaReserved", "False")
    assert (kueue.condition(requeued, "Admitted") or {}).get("status") != "True"
    assert "admission" not in (requeued.get("status") or {}), "its quota is given back"


def test_kueue_says_when_a_jobs_local_queue_does_not_exist(queues: Queues) -> None:
    missing = _name("no-such-queue")
    job = queues.job(missing, cpu="100m")
    wl = queues.workload(job, "QuotaReserved", "False")
    reserved = kueue.condition(wl, "QuotaReserved") or {}
    assert missing in reserved["message"], reserved
    if not queues.real:  # reasons differ across Kueue versions
        assert reserved["reason"] == "Inadmissible"
        assert reserved["message"] == f"LocalQueue {missing} doesn't exist"
    assert queues.spec(job)["suspend"] is True


@pytest.mark.slow
def test_kueue_counts_admitted_requests_and_a_deleted_job_gives_them_back(
    queues: Queues,
) -> None:
    """What a queued DLRMJob is sized by: the ClusterQueue's status says how much of
    each resource its admitted workloads hold (read with the operator's own reader),
    and a deleted Job (a suspended DLRMJob deletes its queued Job) gives its share
    back, so the next Job in the queue is admitted."""
    lq, cq, _ = queues.queue(cpu="2")
    first = queues.job(lq, cpu="1")
    queues.workload(first, "Admitted", "True")

    def held() -> ClusterQueueInfo | None:
        body = queues.kube.get(kueue.API, "clusterqueues", None, cq) or {}
        info = cluster_queue_info(body, "cpu")
        return info if info.used == 1 else None

    info = wait_for(held, what=f"ClusterQueue {cq}'s status counting 1 cpu")
    assert info.nominal == 2
    second = queues.job(lq, cpu="2")
    queues.workload(second, "QuotaReserved", "False")
    queues.kube.delete("batch/v1", "jobs", queues.ns, first["metadata"]["name"])
    queues.workload(second, "Admitted", "True")
    wait_for(lambda: queues.spec(second).get("suspend") is False, what="the next Job to run")


def test_an_indexed_jobs_completions_change_only_in_tandem_with_parallelism(
    cluster: Cluster,
) -> None:
    """Elastic Indexed Jobs (Kubernetes 1.27+), which Kueue's workload slices scale:
    ``completions`` follows ``parallelism``, never alone, and a NonIndexed Job's never
    changes."""
    kube, ns, name = cluster.kube, cluster.ns, _name("elastic")
    body = suspended_job(ns, name)
    body["spec"] |= {"completionMode": "Indexed", "completions": 2, "parallelism": 2}
    kube.create(body)
    both = kube.patch("batch/v1", "jobs", ns, name, {"spec": {"completions": 3, "parallelism": 3}})
    assert (both["spec"]["completions"], both["spec"]["parallelism"]) == (3, 3)
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", ns, name, {"spec": {"completions": 4}})
    assert err.value.status == 422
    assert "spec.completions: Invalid value: 4: can only be modified in tandem with " \
        "spec.parallelism" in str(err.value)  # fmt: skip
    plain = _name("plain")
    body = suspended_job(ns, plain)
    body["spec"] |= {"completions": 2, "parallelism": 2}
    kube.create(body)
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", ns, plain, {"spec": {"completions": 3, "parallelism": 3}})
    assert err.value.status == 422
    assert "spec.completions: Invalid value: 3: field is immutable" in str(err.value)
    for job in (name, plain):
        kube.delete("batch/v1", "jobs", ns, job)


def _elastic(queues: Queues, job: dict[str, Any]) -> None:
    """Wait for the gate Kueue's webhook puts in an elastic Job's template; a real
    Kueue without ``ElasticJobsViaWorkloadSlices`` (before v0.18, or turned off) adds
    none, and the slice tests are skipped there."""
    try:
        wait_for(
            lambda: slices.gated(queues.spec(job)["template"]),
            timeout=5 if queues.real else 20,
            what="the elastic-job scheduling gate in the template",
        )
    except AssertionError:
        if queues.real:
            pytest.skip("Kueue's ElasticJobsViaWorkloadSlices is off here: no elastic-job gate")
        raise


def _slices(queues: Queues, job: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(
        kueue.workloads_of(queues.kube, job), key=lambda w: w["metadata"]["creationTimestamp"]
    )


@pytest.mark.slow
def test_kueue_scales_an_elastic_job_up_by_a_slice_that_replaces_the_admitted_one(
    queues: Queues,
) -> None:
    """A scale-up of an admitted elastic Job is a new Workload for the whole new count,
    admitted with the old slice's share counted as free, which then finishes
    (``WorkloadSliceReplaced``); the Job is never suspended. One that does not fit
    waits, saying why, while the old slice keeps its admission."""
    lq, _, _ = queues.queue(cpu="300m")
    job = queues.job(lq, cpu="100m", elastic=2)
    _elastic(queues, job)
    first = queues.workload(job, "Admitted", "True")
    assert first["metadata"]["annotations"][slices.ELASTIC_ANNOTATION] == "true"
    wait_for(lambda: queues.spec(job).get("suspend") is False, what="the elastic Job to run")
    name = job["metadata"]["name"]
    queues.kube.patch("batch/v1", "jobs", queues.ns, name,
                      {"spec": {"parallelism": 3, "completions": 3}})  # fmt: skip

    def replaced() -> tuple[dict[str, Any], dict[str, Any]] | None:
        # told apart by uid: both may be created within one second (creationTimestamp's unit)
        found = _slices(queues, job)
        mine = [w for w in found if w["metadata"]["uid"] == first["metadata"]["uid"]]
        others = [w for w in found if w["metadata"]["uid"] != first["metadata"]["uid"]]
        if len(mine) == 1 and len(others) == 1 and kueue.is_true(mine[0], "Finished"):
            return mine[0], others[0]
        return None

    old, new = wait_for(replaced, what="the first slice replaced by a second")
    finished = kueue.condition(old, "Finished") or {}
    assert finished["reason"] == slices.REPLACED
    assert finished["message"].startswith("Replaced to accommodate a workload"), finished
    m = first["metadata"]
    assert new["metadata"]["annotations"][slices.REPLACEMENT_FOR] == f"{m['namespace']}/{m['name']}"
    assert new["spec"]["podSets"][0]["count"] == 3
    assert kueue.is_true(new, "Admitted") and queues.spec(job)["suspend"] is False

    queues.kube.patch("batch/v1", "jobs", queues.ns, name,
                      {"spec": {"parallelism": 5, "completions": 5}})  # fmt: skip

    def waiting() -> dict[str, Any] | None:
        found = [w for w in _slices(queues, job) if not kueue.is_true(w, "Finished")]
        pending = [w for w in found if not kueue.is_true(w, "QuotaReserved")]
        reason = kueue.condition(pending[0], "QuotaReserved") if pending else None
        return pending[0] if reason else None

    pending = wait_for(waiting, what="a third slice, pending")
    assert "cpu" in (kueue.condition(pending, "QuotaReserved") or {})["message"], pending
    held = next(w for w in _slices(queues, job) if w["metadata"]["uid"] == new["metadata"]["uid"])
    assert kueue.is_true(held, "Admitted") and not kueue.is_true(held, "Finished")
    assert queues.spec(job)["suspend"] is False, "the Job runs on at its admitted size"


@pytest.mark.slow
def test_kueue_shrinks_an_elastic_jobs_admitted_slice_in_place(queues: Queues) -> None:
    """A scale-down needs no new admission: the admitted Workload's count drops, and
    the ClusterQueue gives the difference back."""
    lq, cq, _ = queues.queue(cpu="3")
    job = queues.job(lq, cpu="1", elastic=3)
    _elastic(queues, job)
    first = queues.workload(job, "Admitted", "True")

    def using(cpus: int) -> ClusterQueueInfo | None:
        body = queues.kube.get(kueue.API, "clusterqueues", None, cq) or {}
        info = cluster_queue_info(body, "cpu")
        return info if info.used == cpus else None

    wait_for(lambda: using(3), what=f"ClusterQueue {cq} counting 3 cpus")
    queues.kube.patch("batch/v1", "jobs", queues.ns, job["metadata"]["name"],
                      {"spec": {"parallelism": 1, "completions": 1}})  # fmt: skip

    def shrunk() -> dict[str, Any] | None:
        (wl,) = [w for w in _slices(queues, job) if not kueue.is_true(w, "Finished")]
        return wl if wl["spec"]["podSets"][0]["count"] == 1 else None

    wl = wait_for(shrunk, what="the admitted slice shrunk to 1 pod")
    assert wl["metadata"]["uid"] == first["metadata"]["uid"] and kueue.is_true(wl, "Admitted")
    wait_for(lambda: using(1), what=f"ClusterQueue {cq} counting 1 cpu")


# --------------------------------------------------------------------------- pod admission
# What the API server refuses of a pod (a 403, worded by the admission plugin), which the
# DLRMJob must report: Pod Security by the namespace's enforce label, an unknown
# PriorityClass, a ResourceQuota; and the Job controller's FailedCreate Event quoting it.
# On the emulator the stand-in Job controller (k8s.jobcontroller) plays
# kube-controller-manager's. Every pod selects a node no cluster has: nothing runs.

ENFORCE = "pod-security.kubernetes.io/enforce"
NO_NODE = {"shardwise.dev/contract-test": "no-such-node"}
RESTRICTED_BUSYBOX = (
    'allowPrivilegeEscalation != false (container "c" must set '
    "securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container "
    '"c" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod or '
    'container "c" must set securityContext.runAsNonRoot=true), seccompProfile (pod or '
    'container "c" must set securityContext.seccompProfile.type to "RuntimeDefault" or '
    '"Localhost")'
)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[Callable[[str | None], str]]:
    """Make a namespace enforcing a Pod Security level (``None``: none); deleted after."""
    made: list[str] = []

    def make(level: str | None) -> str:
        name = _name(f"sw-pss-{level or 'none'}")
        labels = {ENFORCE: level} if level else {}
        cluster.kube.create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
        made.append(name)
        if cluster.real:  # pods wait for the namespace's default ServiceAccount
            wait_for(lambda: cluster.kube.get("v1", "serviceaccounts", name, "default"),
                     what=f"{name}'s default ServiceAccount")  # fmt: skip
        return name

    yield make
    for name in made:
        cluster.kube.delete("v1", "namespaces", None, name)


def _post(kube: KubeApi, plural: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create an object of a kind the operator's client does not name."""
    ns = body["metadata"].get("namespace")
    created: dict[str, Any] = kube.request(
        "POST", resource_path(body["apiVersion"], plural, ns), body=body
    )
    return created


def busybox(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    meta = {"namespace": ns, **({"generateName": name} if name.endswith("-") else {"name": name})}
    body = {"nodeSelector": NO_NODE, "containers": [{"name": "c", "image": "busybox"}], **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body}


def refusal(cluster: Cluster, body: dict[str, Any]) -> str:
    """The 403's message creating ``body`` gets (and that nothing was stored)."""
    with pytest.raises(ApiError) as err:
        cluster.kube.create(body)
    assert (err.value.status, err.value.reason) == (403, "Forbidden"), err.value
    name = body["metadata"].get("name")
    if name:
        assert cluster.kube.get("v1", "pods", body["metadata"]["namespace"], name) is None
    return err.value.message


def test_pod_security_refuses_pods_by_the_namespaces_level(
    cluster: Cluster, namespace: Callable[[str | None], str]
) -> None:
    restricted, baseline, open_ = namespace("restricted"), namespace("baseline"), namespace(None)
    assert refusal(cluster, busybox(restricted, "bare")) == (
        f'pods "bare" is forbidden: violates PodSecurity "restricted:latest": {RESTRICTED_BUSYBOX}'
    )
    host = busybox(baseline, "host", hostNetwork=True, hostIPC=True)
    assert refusal(cluster, host) == (
        'pods "host" is forbidden: violates PodSecurity "baseline:latest": host namespaces '
        "(hostNetwork=true, hostIPC=true)"
    )
    caps = busybox(baseline, "caps")
    caps["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    assert refusal(cluster, caps) == (
        'pods "caps" is forbidden: violates PodSecurity "baseline:latest": non-default '
        'capabilities (container "c" must not include "SYS_ADMIN" in '
        "securityContext.capabilities.add)"
    )
    # what baseline allows, and what no level is enforced on
    cluster.kube.create(busybox(baseline, "plain"))
    cluster.kube.create(busybox(open_, "host", hostNetwork=True))
    hardened = busybox(
        restricted,
        "hardened",
        securityContext={
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    )
    hardened["spec"]["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}  # fmt: skip
    cluster.kube.create(hardened)


def _as_pod(ns: str, name: str, template: dict[str, Any]) -> dict[str, Any]:
    """A Job's pod template as a pod of its own, kept off every node; what a real cluster
    checks elsewhere (a RuntimeClass, a PriorityClass that must exist) left out."""
    spec = copy.deepcopy(template["spec"])
    spec["nodeSelector"] = NO_NODE
    for key in ("runtimeClassName", "priorityClassName"):
        spec.pop(key, None)
    meta = {"name": name, "namespace": ns, "labels": template["metadata"].get("labels", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_operators_pods_pass_pod_security_restricted(
    cluster: Cluster, namespace: Callable[[str | None], str], path: Path
) -> None:
    """The worker and profiling pods the operator renders for each example, as the API
    server's own Pod Security admission judges them in a namespace enforcing
    "restricted" (the claim docs/platform.md makes)."""
    from shardwise.operator.config import OperatorConfig
    from shardwise.operator.crd import parse_spec
    from shardwise.operator.render import children as render

    ns = namespace("restricted")
    spec = parse_spec(yaml.safe_load(path.read_text())["spec"])
    job = render.JobMeta("ex", ns, "uid-contract", 1)
    cfg = OperatorConfig()
    worker = render.worker_job(job, spec, "ex-plan-x", "a" * 64, 2, "GPU", cfg)
    calibration = render.Calibration("ex-tables-x", "t" * 16, 8)
    profiler = render.profiling_job(job, spec, "GPU", 1, cfg, calibration)
    for kind, body in (("worker", worker), ("profiler", profiler)):
        created = cluster.kube.create(_as_pod(ns, f"{kind}-0", body["spec"]["template"]))
        assert created["metadata"]["name"] == f"{kind}-0"


def test_an_unknown_priority_class_is_refused_before_the_name_is_made(cluster: Cluster) -> None:
    """The Priority plugin runs before the name is generated: a pod made from a
    ``generateName`` (as the Job controller makes them) is named by its prefix."""
    wanted = _name("sw-contract-prio")
    body = busybox(cluster.ns, "prio-", priorityClassName=wanted)
    assert refusal(cluster, body) == (
        f'pods "prio-" is forbidden: no PriorityClass with name {wanted} was found'
    )
    _post(cluster.kube, "priorityclasses", {"apiVersion": "scheduling.k8s.io/v1",
          "kind": "PriorityClass", "metadata": {"name": wanted}, "value": 1000})  # fmt: skip
    try:
        created = cluster.kube.create(body)
        assert created["metadata"]["name"].startswith("prio-")
        cluster.kube.delete("v1", "pods", cluster.ns, created["metadata"]["name"])
    finally:
        cluster.kube.delete("scheduling.k8s.io/v1", "priorityclasses", None, wanted)


def test_a_resource_quota_refuses_what_it_cannot_hold(
    cluster: Cluster, namespace: Callable[[str | None], str]
) -> None:
    ns = namespace(None)
    meta = {"name": "q", "namespace": ns}
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": meta,
             "spec": {"hard": {"pods": "1", "requests.cpu": "1"}}}  # fmt: skip
    _post(cluster.kube, "resourcequotas", quota)
    wait_for(lambda: (cluster.kube.get("v1", "resourcequotas", ns, "q") or {}).get("status"),
             what="the quota's status")  # fmt: skip
    assert refusal(cluster, busybox(ns, "a")) == (
        'pods "a" is forbidden: failed quota: q: must specify requests.cpu for: c'
    )

    def asking(name: str, cpu: str) -> dict[str, Any]:
        body = busybox(ns, name)
        body["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
        return body

    cluster.kube.create(asking("a", "600m"))
    assert refusal(cluster, asking("b", "600m")) == (
        'pods "b" is forbidden: exceeded quota: q, requested: pods=1,requests.cpu=600m, used: '
        "pods=1,requests.cpu=600m, limited: pods=1,requests.cpu=1"
    )


@pytest.fixture
def job_controller(cluster: Cluster) -> Iterator[None]:
    """kube-controller-manager's Job controller: the cluster's own, or the stand-in on
    the emulator for the contract's Jobs (label ``shardwise.dev/contract-job``)."""
    if cluster.real:
        yield
        return
    from k8s.jobcontroller import JobController

    kube = KubeApi.for_host(cluster.kube.api_client.configuration.host)
    controller = JobController(kube, "shardwise.dev/contract-job")
    yield from _every_200_ms(kube, lambda: controller.sync(kube.list("v1", "pods")))


def _every_200_ms(kube: KubeApi, sync: Callable[[], None]) -> Iterator[None]:
    """A stand-in controller's loop on a thread for a fixture's life; then ``kube``
    is closed."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.2):
            sync()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(10)
    kube.close()


def _failed_creates(cluster: Cluster, ns: str, job: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=Job,involvedObject.name={job},reason=FailedCreate"
    return cluster.kube.list("v1", "events", ns, None, selector)


def test_the_job_controller_says_on_the_job_why_it_made_no_pod(
    cluster: Cluster, namespace: Callable[[str | None], str], job_controller: None
) -> None:
    """A Job whose pods the API server refuses has no pod, and a FailedCreate Warning
    Event on it quoting the refusal whole, within seconds; repeats are counted or
    combined, not posted without end."""
    ns = namespace("restricted")
    name = _name("refused")
    body = suspended_job(ns, name)
    body["metadata"]["labels"] = {"shardwise.dev/contract-job": "1"}
    body["spec"]["suspend"] = False
    cluster.kube.create(body)
    t0 = time.monotonic()
    events = wait_for(lambda: _failed_creates(cluster, ns, name), 30, 0.2, "FailedCreate")
    print(f"FailedCreate on the Job {time.monotonic() - t0:.1f} s after it was created")
    event = events[0]
    assert event["type"] == "Warning" and event["source"]["component"] == "job-controller"
    assert event["involvedObject"]["uid"] == cluster.kube.get(
        "batch/v1", "jobs", ns, name)["metadata"]["uid"]  # type: ignore[index]  # fmt: skip
    pattern = (
        rf'Error creating: pods "{re.escape(name)}-[a-z0-9]*" is forbidden: violates '
        rf'PodSecurity "restricted:latest": {re.escape(RESTRICTED_BUSYBOX)}'
    )
    assert re.fullmatch(r"(\(combined from similar events\): )?" + pattern, event["message"]), (
        event["message"]
    )
    assert cluster.kube.list("v1", "pods", ns, f"batch.kubernetes.io/job-name={name}") == []
    time.sleep(3)
    assert len(_failed_creates(cluster, ns, name)) <= 11, "similar events are combined"
    cluster.kube.delete("batch/v1", "jobs", ns, name)

    # an Indexed Job's pods, refused by a mutating plugin: named by their prefix
    wanted, name = _name("sw-contract-prio"), _name("prio")
    body = suspended_job(cluster.ns, name)
    body["metadata"]["labels"] = {"shardwise.dev/contract-job": "1"}
    body["spec"] |= {"suspend": False, "completionMode": "Indexed", "completions": 1}
    body["spec"]["template"]["spec"]["priorityClassName"] = wanted
    cluster.kube.create(body)
    events = wait_for(lambda: _failed_creates(cluster, cluster.ns, name), 30, 0.2, "FailedCreate")
    assert events[0]["message"] == (
        f'Error creating: pods "{name}-0-" is forbidden: no PriorityClass with name {wanted} '
        "was found"
    )
    cluster.kube.delete("batch/v1", "jobs", cluster.ns, name)


def test_a_host_network_pods_ports_are_its_host_ports(
    cluster: Cluster, namespace: Callable[[str | None], str]
) -> None:
    """Pods (not pod templates, since 1.28) on the host's network get each port's
    ``containerPort`` as its ``hostPort``, init containers' too; a container's other
    ``hostPort`` is refused (a template's too, where it is given). Pod Security then
    names them beside the host network."""
    ns, baseline = namespace(None), namespace("baseline")

    def ports(body: dict[str, Any], section: str = "containers") -> list[tuple[int, int | None]]:
        found = body["spec"][section][0]["ports"]
        return [(p["containerPort"], p.get("hostPort")) for p in found]

    def with_ports(name: str, **spec: Any) -> dict[str, Any]:
        body = busybox(ns, name, **spec)
        body["spec"]["containers"][0]["ports"] = [
            {"name": "rdzv", "containerPort": 29500},
            {"name": "metrics", "containerPort": 9400, "hostPort": 9400},
        ]
        body["spec"]["initContainers"] = [
            {"name": "init", "image": "busybox", "ports": [{"containerPort": 7000}]}
        ]
        return body

    host = cluster.kube.create(with_ports("host", hostNetwork=True))
    assert ports(host) == [(29500, 29500), (9400, 9400)]
    assert ports(host, "initContainers") == [(7000, 7000)]
    plain = cluster.kube.create(with_ports("plain"))
    assert ports(plain) == [(29500, None), (9400, 9400)]
    assert ports(plain, "initContainers") == [(7000, None)]

    job = suspended_job(ns, _name("template"))
    job["spec"]["template"]["spec"] |= {"hostNetwork": True}
    job["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 29500}]
    made = cluster.kube.create(job)
    assert ports(made["spec"]["template"]) == [(29500, None)], "a template is not defaulted"
    cluster.kube.delete("batch/v1", "jobs", ns, job["metadata"]["name"])
    mismatch = "must match `containerPort` when `hostNetwork` is true"
    other = with_ports("other", hostNetwork=True)
    other["spec"]["containers"][0]["ports"][1]["hostPort"] = 9401
    with pytest.raises(ApiError) as err:
        cluster.kube.create(other)
    assert err.value.status == 422
    assert _causes(err.value) == [
        ("spec.containers[0].ports[1].hostPort", f"Invalid value: 9401: {mismatch}")
    ]
    job = suspended_job(ns, _name("template"))
    job["spec"]["template"]["spec"] |= {"hostNetwork": True}
    job["spec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": 29500, "hostPort": 29501}
    ]
    with pytest.raises(ApiError) as err:
        cluster.kube.create(job)
    assert _causes(err.value) == [
        ("spec.template.spec.containers[0].ports[0].hostPort", f"Invalid value: 29501: {mismatch}")
    ]

    refused = with_ports("refused", hostNetwork=True)
    refused["metadata"]["namespace"] = baseline
    del refused["spec"]["containers"][0]["ports"][1]["hostPort"]
    assert refusal(cluster, refused) == (
        'pods "refused" is forbidden: violates PodSecurity "baseline:latest": host namespaces '
        '(hostNetwork=true), hostPort (containers "init", "c" use hostPorts 29500, 7000, 9400)'
    )


@pytest.fixture
def scheduler(cluster: Cluster) -> Iterator[None]:
    """kube-scheduler: the cluster's own, or the stand-in on the emulator for the
    contract's pods (label ``shardwise.dev/contract-scheduled``)."""
    if cluster.real:
        yield
        return
    from k8s.scheduler import schedule

    kube = KubeApi.for_host(cluster.kube.api_client.configuration.host)

    def sync() -> None:
        pods = kube.list("v1", "pods", None, "shardwise.dev/contract-scheduled")
        schedule(kube, pods, kube.list("v1", "nodes"))

    yield from _every_200_ms(kube, sync)


def test_the_scheduler_binds_a_pod_only_to_nodes_its_required_affinity_matches(
    cluster: Cluster, scheduler: None
) -> None:
    """Required node affinity: terms ORed, a term's expressions and fields ANDed (a
    ``Gt`` read as an integer). A node no kubelet runs (made here, Ready for the moment)
    is the only one that matches; a pod that no node matches is Unschedulable, in the
    scheduler's words."""
    kube, ns = cluster.kube, cluster.ns
    node, pool = _name("contract-pool-node"), _name("pool")
    label = "shardwise.dev/contract-pool"
    labels = {label: pool, f"{label}-gpus": "10"}
    kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}})
    status = {
        "allocatable": {"cpu": "4", "memory": "8Gi", "pods": "10"},
        "capacity": {"cpu": "4", "memory": "8Gi", "pods": "10"},
        "conditions": [{"type": "Ready", "status": "True",
                        "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}],
    }  # fmt: skip
    kube.patch("v1", "nodes", None, node, {"status": status}, "status")

    def pod(name: str, *terms: dict[str, Any]) -> dict[str, Any]:
        required = {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": list(terms)}}  # fmt: skip
        body = busybox(ns, name, tolerations=[{"operator": "Exists"}],
                       affinity={"nodeAffinity": required})  # fmt: skip
        del body["spec"]["nodeSelector"]
        body["metadata"]["labels"] = {"shardwise.dev/contract-scheduled": "1"}
        return body

    def expr(key: str, op: str, *values: str) -> dict[str, Any]:
        return {"key": key, "operator": op, **({"values": list(values)} if values else {})}

    placed, nowhere = _name("placed"), _name("nowhere")
    try:
        kube.create(pod(
            placed,
            {"matchExpressions": [expr(label, "In", "no-such-pool")]},
            {"matchExpressions": [expr(label, "In", pool), expr(f"{label}-gpus", "Gt", "9")],
             "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]},
        ))  # fmt: skip
        kube.create(pod(
            nowhere,
            {"matchExpressions": [expr(label, "In", pool), expr(f"{label}-gpus", "Lt", "9")]},
            {"matchExpressions": [expr(label, "NotIn", pool), expr(label, "Exists")]},
        ))  # fmt: skip
        bound = wait_for(lambda: (kube.get("v1", "pods", ns, placed) or {}).get("spec", {})
                         .get("nodeName"), 30, 0.2, "the pod to be bound")  # fmt: skip
        assert bound == node

        def unschedulable() -> dict[str, Any] | None:
            got = kube.get("v1", "pods", ns, nowhere) or {}
            conds = (got.get("status") or {}).get("conditions") or []
            return next((c for c in conds if c.get("reason") == "Unschedulable"), None)

        cond = wait_for(unschedulable, 30, 0.2, "the pod to be found unschedulable")
        assert cond["status"] == "False" and cond["type"] == "PodScheduled"
        assert "node(s) didn't match Pod's node affinity/selector" in cond["message"]
        assert (kube.get("v1", "pods", ns, nowhere) or {})["spec"].get("nodeName") is None
    finally:
        for name in (placed, nowhere):
            kube.delete("v1", "pods", ns, name, grace_period_seconds=0)
        kube.delete("v1", "nodes", None, node)
