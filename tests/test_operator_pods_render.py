"""The pods the operator renders, as a production GPU cluster takes them
(:mod:`shardwise.operator.render.pods`): Pod Security "restricted" by default, checked
with the emulator's implementation of the API server's checks (:mod:`k8s.podsecurity`,
pinned against a real API server by tests/test_k8s_contract.py); a user's looser or
stricter settings; writable paths as volumes; ``/dev/shm`` by its rule; the pod
template overrides, and the fields the operator owns refused."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from k8s import podsecurity
from k8s.helpers import ROOT
from k8s.schema import StructuralSchema
from operator_builders import A100, CFG, JOB, spec

from shardwise import names
from shardwise.operator.cluster.startup import StartupProblem
from shardwise.operator.crd import SpecError, parse_spec
from shardwise.operator.decide.lifecycle import Condition, Phase, phase_of
from shardwise.operator.render import children as render
from shardwise.operator.render import pods

CAL = render.Calibration("dj-tables-0123abcd", "t" * 16, 4)


def template(s: Any, workers: int = 2) -> dict[str, Any]:
    body = render.worker_job(JOB, s, "dj-plan-x", "a" * 64, workers, A100, CFG)
    out: dict[str, Any] = body["spec"]["template"]
    return out


def profiling_template(s: Any) -> dict[str, Any]:
    out: dict[str, Any] = render.profiling_job(JOB, s, A100, 1, CFG, CAL)["spec"]["template"]
    return out


def overridden(**fields: Any) -> Any:
    return spec(template={"image": "x", **fields})


def example(name: str) -> Any:
    return parse_spec(yaml.safe_load((ROOT / "examples" / name).read_text())["spec"])


@pytest.mark.parametrize("name", ["dlrmjob.yaml", "dlrmjob-cpu.yaml", "dlrmjob-gpu-pool.yaml"])
def test_every_pod_the_examples_make_passes_restricted(name: str) -> None:
    s = example(name)
    for t in (template(s), profiling_template(s)):
        assert podsecurity.evaluate("restricted", t["metadata"], t["spec"]) == []


def test_the_defaults_are_what_restricted_asks_and_the_image_user() -> None:
    t = template(spec())
    pod, worker = t["spec"], t["spec"]["containers"][0]
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"USER {pods.IMAGE_UID}:{pods.IMAGE_UID}" in dockerfile, "the image's user"
    # without them, the API server's checks refuse the pod, each requirement named
    bare = {**pod, "securityContext": {}, "containers": [{**worker, "securityContext": {}}]}
    reasons = [r for r, _ in podsecurity.evaluate("restricted", {}, bare)]
    assert reasons == [
        "allowPrivilegeEscalation != false", "unrestricted capabilities",
        "runAsNonRoot != true", "seccompProfile",
    ]  # fmt: skip


def test_the_users_settings_win_key_by_key() -> None:
    """Stricter (a read-only root, another user) and looser (a capability added) settings
    are the user's; a looser one is then refused where the namespace enforces it."""
    s = overridden(
        securityContext={"readOnlyRootFilesystem": True, "capabilities": {"add": ["IPC_LOCK"]}},
        podOverrides={"spec": {"securityContext": {"runAsUser": 2000, "supplementalGroups": [5]}}},
    )
    t = template(s)
    pod, worker = t["spec"], t["spec"]["containers"][0]
    assert pod["securityContext"]["runAsUser"] == 2000
    assert pod["securityContext"]["supplementalGroups"] == [5]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, "kept"
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"add": ["IPC_LOCK"]},
    }
    assert podsecurity.violation("restricted", t) == (
        'violates PodSecurity "restricted:latest": unrestricted capabilities (container '
        '"worker" must set securityContext.capabilities.drop=["ALL"]; container "worker" must '
        'not include "IPC_LOCK" in securityContext.capabilities.add)'
    )
    assert podsecurity.violation("baseline", t) == (
        'violates PodSecurity "baseline:latest": non-default capabilities (container "worker" '
        'must not include "IPC_LOCK" in securityContext.capabilities.add)'
    )
    prof = profiling_template(s)["spec"]["containers"][0]
    assert prof["securityContext"] == worker["securityContext"], "the operator's container"


def test_writable_paths_are_volumes() -> None:
    """/tmp (torchrun's and the launcher's temporary files) in every pod; the plan
    read-only; the profiling pod's work dir; a user's own /tmp wins."""
    t = template(spec())
    mounts = {m["mountPath"]: m for m in t["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in t["spec"]["volumes"]}
    assert mounts["/tmp"]["name"] == "shardwise-tmp" and volumes["shardwise-tmp"]["emptyDir"] == {}
    assert mounts[names.PLAN_DIR]["readOnly"] is True
    prof = profiling_template(spec())["spec"]
    prof_mounts = {m["mountPath"] for m in prof["containers"][0]["volumeMounts"]}
    assert {"/tmp", render.PROFILE_WORK_DIR} <= prof_mounts
    own = overridden(
        volumes=[{"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}}],
        volumeMounts=[{"name": "scratch", "mountPath": "/tmp"}],
    )
    t = template(own)
    assert [
        m["name"] for m in t["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/tmp"
    ] == ["scratch"]
    assert "shardwise-tmp" not in {v["name"] for v in t["spec"]["volumes"]}


def shm_of(t: dict[str, Any]) -> dict[str, Any] | None:
    volumes = {v["name"]: v for v in t["spec"].get("volumes") or []}
    mounts = {m["mountPath"]: m["name"] for m in t["spec"]["containers"][0]["volumeMounts"]}
    if "/dev/shm" not in mounts:
        return None
    source: dict[str, Any] = volumes[mounts["/dev/shm"]]["emptyDir"]
    return source


def test_dev_shm_follows_the_pods_memory_by_its_rule() -> None:
    def shm(gpus: int, **template_fields: Any) -> dict[str, Any] | None:
        return shm_of(
            template(spec(gpusPerWorker=gpus, template={"image": "x", **template_fields}))
        )

    limit = {"resources": {"requests": {"memory": "16Gi"}, "limits": {"memory": "64Gi"}}}
    assert shm(8, **limit) == {"medium": "Memory", "sizeLimit": "32Gi"}, "half the limit"
    request = {"resources": {"requests": {"memory": "10Gi"}}}
    assert shm(2, **request) == {"medium": "Memory", "sizeLimit": "5Gi"}, "else half the request"
    assert shm(4) == {"medium": "Memory", "sizeLimit": "4Gi"}, "else 1 GiB per rank"
    assert shm(3, resources={"limits": {"memory": "3G"}}) == {
        "medium": "Memory", "sizeLimit": "1430Mi"
    }  # fmt: skip
    assert shm(1) is None, "one rank: no NCCL peers in the pod"
    assert shm(1, shmSize="2Gi") == {"medium": "Memory", "sizeLimit": "2Gi"}, "asked for"
    assert shm(8, shmSize="48Gi", **limit) == {"medium": "Memory", "sizeLimit": "48Gi"}
    assert shm_of(profiling_template(spec(gpusPerWorker=8))) is None, "one process"
    with pytest.raises(SpecError) as err:
        spec(template={"image": "x", "shmSize": "80Gi", **limit})
    assert err.value.problems == [
        "spec.template.shmSize: 80Gi is more than the worker's memory limit (64Gi): what "
        "/dev/shm holds counts against it"
    ]


OVERRIDES: dict[str, Any] = {
    "metadata": {"labels": {"team": "ads"}, "annotations": {"cost-center": "42"}},
    "spec": {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": ["h100"]}]}]}}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "priorityClassName": "training-high",
        "imagePullSecrets": [{"name": "registry"}],
        "runtimeClassName": "nvidia",
        "schedulerName": "volcano",
        "hostNetwork": True,
        "hostIPC": True,
        "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]},
                           {"name": "logs", "image": "fluent-bit", "restartPolicy": "Always"}],
        "containers": [{"name": "exporter", "image": "dcgm-exporter",
                        "securityContext": {"runAsUser": 0}}],
    },
}  # fmt: skip


def test_overrides_reach_the_worker_pods_and_what_makes_sense_the_profiling_pod() -> None:
    s = overridden(podOverrides=OVERRIDES)
    t = template(s)
    pod, o = t["spec"], OVERRIDES["spec"]
    assert t["metadata"]["labels"]["team"] == "ads"
    assert t["metadata"]["labels"][names.LABEL_COMPONENT] == "worker", "the operator's kept"
    assert t["metadata"]["annotations"] == {"cost-center": "42"}
    for key in ("affinity", "topologySpreadConstraints", "priorityClassName", "imagePullSecrets",
                "runtimeClassName", "schedulerName", "hostNetwork", "hostIPC",
                "dnsConfig"):  # fmt: skip
        assert pod[key] == o[key], key
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet", "the ranks still resolve the Service"
    assert [c["name"] for c in pod["containers"]] == ["worker", "exporter"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch", "logs"]
    # every container gets the restricted defaults under its own settings
    exporter = pod["containers"][1]["securityContext"]
    assert exporter == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                        "runAsUser": 0}  # fmt: skip
    assert pod["initContainers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # the user's host networking and root sidecar: Pod Security names each
    assert podsecurity.violation("restricted", t) == (
        'violates PodSecurity "restricted:latest": host namespaces (hostNetwork=true, '
        'hostIPC=true), runAsUser=0 (container "exporter" must not set runAsUser=0)'
    )
    prof = profiling_template(s)
    ppod = prof["spec"]
    assert prof["metadata"]["labels"]["team"] == "ads"
    for key in ("affinity", "priorityClassName", "imagePullSecrets", "runtimeClassName",
                "schedulerName"):  # fmt: skip
        assert ppod[key] == o[key], key
    for key in ("topologySpreadConstraints", "hostNetwork", "hostIPC", "dnsPolicy", "dnsConfig"):
        assert key not in ppod, f"{key}: one pod, no peers"
    assert [c["name"] for c in ppod["containers"]] == ["profiler"]
    assert [c["name"] for c in ppod["initContainers"]] == ["fetch", "logs"]
    # an override is part of the worker template: changing it replaces the Job
    plain = render.worker_job(JOB, spec(), "p", "a" * 64, 2, A100, CFG)
    other = render.worker_job(JOB, s, "p", "a" * 64, 2, A100, CFG)
    key = names.ANN_TEMPLATE_HASH
    assert plain["metadata"]["annotations"][key] != other["metadata"]["annotations"][key]
    assert render.profiling_settings_hash(JOB, s, A100, CFG, CAL) != (
        render.profiling_settings_hash(JOB, spec(), A100, CFG, CAL)
    )


def test_what_the_operator_owns_is_refused_naming_it() -> None:
    """parse_spec says what the CRD's rules say (for objects made before them)."""
    with pytest.raises(SpecError) as err:
        overridden(
            env=[{"name": "SHARDWISE_RDZV_ENDPOINT", "value": "x"}],
            volumes=[{"name": "shardwise-plan", "emptyDir": {}}],
            podOverrides={
                "metadata": {"labels": {"shardwise.dev/job": "x", "job-name": "y"}},
                "spec": {"restartPolicy": "Always", "subdomain": "s", "volumes": [],
                         "containers": [{"name": "worker", "image": "x"}]},
            },
        )  # fmt: skip
    assert err.value.problems == [
        "spec.template.env[0].name: SHARDWISE_RDZV_ENDPOINT is set by the operator",
        "spec.template.volumes[0].name: 'shardwise-plan': names starting with 'shardwise-' "
        "are the operator's volumes (the plan, /tmp, /dev/shm)",
        "spec.template.podOverrides.spec.restartPolicy: the operator's (Never: the Job "
        "controller replaces a failed rank)",
        "spec.template.podOverrides.spec.subdomain: the operator's (the workers' Service: the "
        "rendezvous host's name)",
        "spec.template.podOverrides.spec.volumes: given in spec.template.volumes",
        "spec.template.podOverrides.metadata.labels[shardwise.dev/job]: set by the operator "
        "or the Job controller",
        "spec.template.podOverrides.metadata.labels[job-name]: set by the operator or the Job "
        "controller",
        "spec.template.podOverrides.spec.containers[0].name: 'worker' is the operator's "
        "container (its command is the rank's; set its securityContext in "
        "spec.template.securityContext)",
    ]


def test_a_refused_pod_names_the_fields_and_the_phase_says_nothing_runs() -> None:
    refusal = (
        'Error creating: pods "dj-workers-0-x7k2p" is forbidden: violates PodSecurity '
        '"restricted:latest": host namespaces (hostNetwork=true), seccompProfile (pod must not '
        'set securityContext.seccompProfile.type to "Unconfined")'
    )
    problem = StartupProblem("Job", "dj-workers", "FailedCreate", refusal)
    assert problem.fields("worker") == [
        "spec.template.podOverrides.spec.hostNetwork",
        "spec.template.podOverrides.spec.securityContext",
        "spec.template.securityContext",
        "spec.template.podOverrides.spec.initContainers/containers",
    ]
    assert problem.describe() == f"job dj-workers: FailedCreate: {refusal}", "whole"
    priority = StartupProblem(
        "Job", "dj-workers", "FailedCreate",
        'Error creating: pods "dj-workers-0-" is forbidden: no PriorityClass with name x was found',
    )  # fmt: skip
    assert priority.fields("profiler") == ["spec.template.podOverrides.spec.priorityClassName"]
    cond = Condition("WorkersReady", False, "FailedCreate", problem.with_fields("worker"))
    assert phase_of([Condition("Planned", True, "PlanReady"), cond]) == (
        Phase.PENDING, cond.message
    )  # fmt: skip
    starting = Condition("WorkersReady", False, "Starting", "0/2 workers ready, 2 active")
    assert phase_of([starting])[0] is Phase.RUNNING


def test_a_privileged_worker_is_refused_naming_the_field_to_fix() -> None:
    """A user's ``privileged: true`` (or root) is laid over the defaults as given; Pod
    Security names it, and the DLRMJob's condition points at the field that set it."""
    s = overridden(
        securityContext={"privileged": True},
        podOverrides={"spec": {"securityContext": {"runAsUser": 0}}},
    )
    t = template(s)
    why = podsecurity.violation("restricted", t)
    assert why == (
        'violates PodSecurity "restricted:latest": privileged (container "worker" must not '
        "set securityContext.privileged=true), runAsUser=0 (pod must not set runAsUser=0)"
    )
    problem = StartupProblem(
        "Job",
        "dj-workers",
        "FailedCreate",
        f'Error creating: pods "dj-workers-0-ab12c" is forbidden: {why}',
    )
    assert problem.fields("worker") == [
        "spec.template.securityContext",
        "spec.template.podOverrides.spec.initContainers/containers",
        "spec.template.podOverrides.spec.securityContext",
    ]
    assert problem.with_fields("worker").endswith(
        "(the DLRMJob's spec.template.securityContext, spec.template.podOverrides.spec."
        "initContainers/containers, spec.template.podOverrides.spec.securityContext)"
    )


def test_the_platform_pages_override_example_is_valid_and_admitted_under_restricted() -> None:
    """docs/platform.md's podOverrides example: the CRD accepts it (nothing pruned),
    the operator parses it, and every pod it makes passes "restricted"."""
    page = (ROOT / "docs" / "platform.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    given = yaml.safe_load(block)["spec"]["template"]
    body = {
        "apiVersion": "shardwise.dev/v1alpha1",
        "kind": "DLRMJob",
        "metadata": {"name": "docs", "namespace": "ml"},
        "spec": {
            "tables": {"inline": [{"name": "t0", "rows": 1000, "dim": 16, "poolingFactor": 1}]},
            "gpusPerWorker": 8,
            "workers": {"max": 2},
            "template": given,
        },
    }
    crd = yaml.safe_load((ROOT / "crds" / "dlrmjob.yaml").read_text())
    schema = StructuralSchema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    admitted, dropped = schema.admit(body)
    assert (dropped, schema.validate(admitted)) == ([], [])
    s = parse_spec(admitted["spec"])
    worker, prof = template(s), profiling_template(s)
    for t in (worker, prof):
        assert podsecurity.evaluate("restricted", t["metadata"], t["spec"]) == []
    assert [c["name"] for c in worker["spec"]["initContainers"]] == [
        "wait-for-storage",
        "log-shipper",
    ]
    assert worker["spec"]["securityContext"]["supplementalGroups"] == [2000]
    assert worker["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_a_malformed_required_node_affinity_is_refused_naming_it() -> None:
    """An affinity no node can match is a spec error before any pod is made (not a job
    sized on no node): the term and requirement are named as the API server names them."""
    bad = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["x"]}]},
                ]
            }
        }
    }
    with pytest.raises(SpecError) as err:
        overridden(podOverrides={"spec": {"affinity": bad}})
    where = (
        "spec.template.podOverrides.spec.affinity.nodeAffinity."
        "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1]"
    )
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(where), err.value.problems
    good = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": bad["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][:1]}}}  # fmt: skip
    overridden(podOverrides={"spec": {"affinity": good}})
