"""Required node affinity as the scheduler reads it
(:mod:`shardwise.operator.cluster.node_affinity`), and a job sized on the nodes it
allows: the operator on kopf's real engine against the API emulator."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from k8s.helpers import NAMESPACE as NS
from k8s.helpers import add_node, dlrmjob, wait_phase
from operator_builders import A100, CFG

from shardwise.operator.cluster.capacity import NodeInfo, eligible
from shardwise.operator.cluster.node_affinity import matches, problems, required
from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, **({"values": list(values)} if values else {})}


def term(*expressions: dict[str, Any], fields: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"matchExpressions": list(expressions)} if expressions else {}
    return out | ({"matchFields": list(fields)} if fields else {})


def name_is(op: str, *values: str) -> dict[str, Any]:
    return {"key": "metadata.name", "operator": op, "values": list(values)}


def selector(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeSelectorTerms": list(terms)}


def holds(requirement: dict[str, Any], labels: dict[str, str], name: str = "n") -> bool:
    return matches(selector(term(requirement)), name, labels)


@pytest.mark.parametrize(
    ("requirement", "labels", "expected"),
    [
        (expr("pool", "In", "a", "b"), {"pool": "b"}, True),
        (expr("pool", "In", "a"), {"pool": "c"}, False),
        (expr("pool", "In", "a"), {}, False),
        (expr("pool", "NotIn", "a"), {"pool": "c"}, True),
        (expr("pool", "NotIn", "a"), {"pool": "a"}, False),
        (expr("pool", "NotIn", "a"), {}, True),  # absent: holds
        (expr("pool", "Exists"), {"pool": ""}, True),
        (expr("pool", "Exists"), {}, False),
        (expr("pool", "DoesNotExist"), {}, True),
        (expr("pool", "DoesNotExist"), {"pool": "a"}, False),
        (expr("gpus", "Gt", "4"), {"gpus": "8"}, True),
        (expr("gpus", "Gt", "4"), {"gpus": "4"}, False),
        (expr("gpus", "Gt", "4"), {"gpus": "10"}, True),  # as integers, not as text
        (expr("gpus", "Gt", "4"), {}, False),  # absent: fails
        (expr("gpus", "Gt", "4"), {"gpus": "eight"}, False),  # not an integer: fails
        (expr("gpus", "Gt", "4"), {"gpus": "1_0"}, False),  # Go's ParseInt takes no "_"
        (expr("gpus", "Lt", "4"), {"gpus": "-1"}, True),
        (expr("gpus", "Lt", "4"), {"gpus": "4"}, False),
        (expr("gpus", "Lt", "4"), {}, False),
        (expr("gpus", "Lt", "4"), {"gpus": str(2**63)}, False),  # beyond int64
    ],
)
def test_each_operator_as_kubernetes_defines_it(
    requirement: dict[str, Any], labels: dict[str, str], expected: bool
) -> None:
    assert holds(requirement, labels) is expected


def test_match_fields_read_the_nodes_name() -> None:
    by_name = selector(term(fields=(name_is("In", "n1"),)))
    assert matches(by_name, "n1", {}) and not matches(by_name, "n2", {})
    not_n1 = selector(term(fields=(name_is("NotIn", "n1"),)))
    assert not matches(not_n1, "n1", {}) and matches(not_n1, "n2", {})


def test_terms_are_ored_and_a_terms_requirements_anded() -> None:
    pool_a_big = term(expr("pool", "In", "a"), expr("gpus", "Gt", "4"))
    named = term(fields=(name_is("In", "spare"),))
    both = term(expr("pool", "In", "b"), fields=(name_is("In", "b1"),))
    s = selector(pool_a_big, named, both)
    assert matches(s, "a1", {"pool": "a", "gpus": "8"})
    assert not matches(s, "a2", {"pool": "a", "gpus": "2"}), "one requirement of the term fails"
    assert matches(s, "spare", {}), "the second term"
    assert matches(s, "b1", {"pool": "b"}) and not matches(s, "b2", {"pool": "b"})
    assert not matches(s, "b1", {"pool": "c"}), "expressions and fields of a term are ANDed"


def test_what_matches_no_node() -> None:
    assert matches(None, "n", {}), "no required affinity: every node"
    assert not matches(selector(), "n", {"pool": "a"}), "no terms: no node"
    assert not matches({}, "n", {"pool": "a"})
    assert not matches(selector({}), "n", {"pool": "a"}), "an empty term: no node"
    assert matches(selector({}, term(expr("pool", "Exists"))), "n", {"pool": "a"})
    malformed = [
        expr("pool", "Equals", "a"),
        expr("pool", "In"),
        expr("pool", "Exists", "a"),
        expr("gpus", "Gt", "4", "5"),
        expr("gpus", "Gt", "four"),
        expr("gpus", "Lt", "-5"),  # an integer, but not a valid label value
        expr("bad key!", "Exists"),
        expr("/pool", "Exists"),
    ]
    for bad in malformed:
        assert not matches(selector(term(bad)), "n", {"pool": "a", "gpus": "1"}), bad
        # ... it fails its own term only, and it is named
        assert matches(selector(term(bad), term(expr("pool", "In", "a"))), "n", {"pool": "a"})
        assert problems(selector(term(bad)), "affinity")[0].startswith(
            "affinity.nodeSelectorTerms[0].matchExpressions[0]: "
        ), bad
    for field in (name_is("Exists"), name_is("In", "a", "b")):
        assert not matches(selector(term(fields=(field,))), "a", {}), field
    assert problems(selector(term(expr("example.com/pool", "In", "a"))), "x") == []
    assert problems(None, "x") == [] and problems(selector({}), "x") == []
    assert problems(selector(), "x") == ["x.nodeSelectorTerms: must have at least one node "
                                         "selector term"]  # fmt: skip
    other_field = {"key": "metadata.uid", "operator": "In", "values": ["u"]}
    assert problems(selector(term(fields=(other_field,))), "x") == [
        "x.nodeSelectorTerms[0].matchFields[0]: key 'metadata.uid': only metadata.name is a field"
    ]


def test_required_reads_only_the_required_node_affinity() -> None:
    pool = selector(term(expr("pool", "In", "a")))
    preferred = {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": term(expr("pool", "In", "b"))}]}  # fmt: skip
    assert required({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": pool,
                                      **preferred}}) == pool  # fmt: skip
    assert required({"nodeAffinity": preferred}) is None
    assert required({"podAntiAffinity": {}}) is None and required(None) is None


def test_eligible_nodes_follow_required_affinity_beside_the_selector() -> None:
    nodes = [
        NodeInfo("a1", {CFG.gpu_type_label: A100, "zone": "x", "pool": "a"}, gpus=8),
        NodeInfo("b1", {CFG.gpu_type_label: A100, "zone": "x", "pool": "b"}, gpus=8),
        NodeInfo("b2", {CFG.gpu_type_label: A100, "zone": "y", "pool": "b"}, gpus=8),
    ]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": selector(
        term(expr("pool", "In", "b")))}}  # fmt: skip
    assert [n.name for n in eligible(nodes, {}, [], "cuda", CFG)] == ["a1", "b1", "b2"]
    assert [n.name for n in eligible(nodes, {}, [], "cuda", CFG, affinity)] == ["b1", "b2"]
    assert [n.name for n in eligible(nodes, {"zone": "x"}, [], "cuda", CFG, affinity)] == ["b1"]
    empty = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": selector()}}
    assert eligible(nodes, {}, [], "cuda", CFG, empty) == []


@pytest.mark.slow
def test_a_job_with_required_node_affinity_is_sized_on_the_nodes_it_allows(
    kube: KubeApi, start_operator: Start
) -> None:
    """Three 2-GPU nodes hold three 2-GPU workers; the job's affinity allows pool a, or
    the node named b2: it gets two, and its worker pods carry that affinity."""
    add_node(kube, "a1", gpus=2, pool="a")
    add_node(kube, "b1", gpus=2, pool="b")
    add_node(kube, "b2", gpus=2, pool="b")
    start_operator()
    pool = selector(
        term(expr("pool", "In", "a")),
        term(fields=(name_is("In", "b2"),)),
    )
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": pool}}
    template = {"image": "registry.example/shardwise:test",
                "podOverrides": {"spec": {"affinity": affinity}}}  # fmt: skip
    kube.create(dlrmjob("pool", NS, workers=(1, 8), template=template))
    status = wait_phase(kube, NS, "pool", "Running", timeout=90)
    assert (status["workers"], status["worldSize"]) == (2, 4), status
    wj = kube.get("batch/v1", "jobs", NS, "pool-workers")
    assert wj is not None and wj["spec"]["parallelism"] == 2
    assert wj["spec"]["template"]["spec"]["affinity"] == affinity


def test_the_emulators_scheduler_reads_affinity_alike() -> None:
    """The scheduler stand-in (tests/k8s, checked against a real cluster by the contract
    tests) is written apart from the operator's reading: they agree on every case here."""
    from k8s.nodeaffinity import required_affinity_matches

    cases = [
        (selector(term(expr("pool", "In", "a")), term(fields=(name_is("In", "n"),))), {}),
        (selector(term(expr("gpus", "Gt", "4"), expr("pool", "NotIn", "b"))), {"gpus": "8"}),
        (selector(term(expr("gpus", "Lt", "-5"))), {"gpus": "-9"}),
        (selector(term(expr("pool", "DoesNotExist")), {}), {"pool": "a"}),
        (selector(), {}),
        (selector(term(expr("pool", "Exists", "x"))), {"pool": "a"}),
    ]
    for s, labels in cases:
        pod = {"spec": {"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": s}}}}  # fmt: skip
        node = {"metadata": {"name": "n", "labels": labels}}
        assert required_affinity_matches(pod, node) is matches(s, "n", labels), (s, labels)
