"""What a user meets after the install: the ``helm test`` hook applies a valid tiny
DLRMJob, the NOTES tell what to apply next, and the DLRMJobs docs/install.md shows pass
the CRD's schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from chart_helpers import CHART, ROOT, Obj, crd_schemas, is_hook, one, rules, run_helm

pytest_plugins = ["chart_helpers"]


def test_helm_test_hook_applies_a_valid_tiny_job(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    hooks = [o for o in objs if is_hook(o)]
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hooks} == {"test"}
    pod = one(hooks, "Pod")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    job = json.loads(env["DLRMJOB"])
    # The API server names it from generateName before validating.
    job["metadata"]["name"] = job["metadata"].pop("generateName") + "x7k2p"
    schema = crd_schemas()[(job["apiVersion"], job["kind"])]
    assert schema.validate(schema.default(job)) == []
    assert job["spec"]["planner"]["device"] == "cpu"  # plans without GPUs
    assert job["spec"]["profiling"]["policy"] == "Never"
    assert "Planned" in pod["spec"]["containers"][0]["args"][0]
    assert compile(pod["spec"]["containers"][0]["args"][0], "helm-test", "exec")
    role = one(hooks, "Role")
    assert rules(role) == {("shardwise.dev", "dlrmjobs", ("create", "get", "delete"))}
    # Served namespace: the first watched one.
    namespaced = [o for o in rendered["namespaced"] if is_hook(o)]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"team-a"}
    assert not [o for o in rendered["standby"] if is_hook(o)]


def test_notes_tell_what_to_apply_next(tmp_path: Path) -> None:
    proc = run_helm("install", "r", str(CHART), "-n", "team-a", "--dry-run=client")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    for expected in (
        "rollout status deployment/r-shardwise",
        "helm test r -n team-a",
        "kind: DLRMJob",
        "kubectl -n team-a get dj",
        "describe dj first",
        "helm uninstall r -n team-a",
        "no ServiceMonitor or PodMonitor",
    ):
        assert expected in notes, expected
    # The DLRMJob the notes show is valid against the CRD.
    block = notes.split("<<'EOF'\n", 1)[1].split("\n  EOF", 1)[0]
    job = yaml.safe_load("\n".join(line.removeprefix("  ") for line in block.splitlines()))
    schema = crd_schemas()[(job["apiVersion"], job["kind"])]
    assert schema.validate(schema.default(job)) == []


def test_install_doc_dlrmjobs_are_valid() -> None:
    """The DLRMJobs docs/install.md tells users to apply pass the CRD's schema."""
    text = (ROOT / "docs" / "install.md").read_text()
    jobs = [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
        if (doc := yaml.safe_load(block)) and doc.get("kind") == "DLRMJob"
    ]
    assert jobs
    for job in jobs:
        job["spec"]["template"]["image"] = "registry.example.com/shardwise:0.1.0-gpu"
        schema = crd_schemas()[(job["apiVersion"], job["kind"])]
        assert schema.validate(schema.default(job)) == [], job["metadata"]["name"]
