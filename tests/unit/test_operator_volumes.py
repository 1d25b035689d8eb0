"""Where a claim lets a job's pods go: node selector terms, local volumes, allowedTopologies."""

from __future__ import annotations

import pytest

from meshtrain.operator.policy import volumes


def node(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def volume(name: str, term: dict, **spec: object) -> dict:
    base = {
        "capacity": {"storage": "10Gi"},
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "local",
        "nodeAffinity": {"required": {"nodeSelectorTerms": [term]}},
    }
    return {"metadata": {"name": name}, "spec": {**base, **spec}}


def claim(volume_name: str | None = None, storage: str = "5Gi") -> dict:
    spec = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "local",
        "resources": {"requests": {"storage": storage}},
    }
    if volume_name:
        spec["volumeName"] = volume_name
    return {"metadata": {"name": "c"}, "spec": spec}


LOCAL = {
    "metadata": {"name": "local"},
    "provisioner": volumes.NO_PROVISIONER,
    "volumeBindingMode": volumes.WAIT_FOR_FIRST_CONSUMER,
}
ZONE = "topology.kubernetes.io/zone"


@pytest.mark.parametrize(
    ("expression", "allowed"),
    [
        ({"key": ZONE, "operator": "In", "values": ["z1"]}, {"a"}),
        ({"key": ZONE, "operator": "NotIn", "values": ["z1"]}, {"b", "c"}),
        ({"key": ZONE, "operator": "Exists"}, {"a", "b"}),
        ({"key": ZONE, "operator": "DoesNotExist"}, {"c"}),
        ({"key": "rank", "operator": "Gt", "values": ["1"]}, {"b"}),
        ({"key": "rank", "operator": "Lt", "values": ["2"]}, {"a"}),
    ],
)
def test_node_selector_operators(expression, allowed):
    nodes = [node("a", **{ZONE: "z1", "rank": "1"}), node("b", **{ZONE: "z2", "rank": "2"})]
    nodes.append(node("c"))
    bound = volume("v", {"matchExpressions": [expression]})
    where = volumes.topology(claim("v"), bound, None)
    assert where is not None
    assert {n["metadata"]["name"] for n in nodes if where.allows(n)} == allowed


def test_a_bound_claim_follows_its_volume_and_a_volume_without_affinity_allows_any_node():
    by_name = volume(
        "v", {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]}
    )
    where = volumes.topology(claim("v"), by_name, None)
    assert where is not None and [where.allows(node(n)) for n in "ab"] == [False, True]
    assert volumes.refusal(where, node("a")) == volumes.CONFLICT
    assert volumes.topology(claim("v"), {"metadata": {"name": "v"}, "spec": {}}, None) is None
    assert volumes.topology(None, None, None) is None


def test_an_unbound_local_claim_goes_where_a_free_volume_could_take_it():
    on = {
        n: {
            "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [n]}]
        }
        for n in "abcde"
    }
    candidates = [
        volume("fits", on["a"]),
        volume("too-small", on["b"], capacity={"storage": "1Gi"}),
        volume("taken", on["c"], claimRef={"name": "other"}),
        volume("other-class", on["d"], storageClassName="fast"),
        volume("read-only", on["e"], accessModes=["ReadOnlyMany"]),
    ]
    where = volumes.topology(claim(), None, LOCAL, candidates)
    assert where is not None
    assert [n for n in "abcde" if where.allows(node(n))] == ["a"]
    assert "fits" in where.why
    nowhere = volumes.topology(claim(storage="100Gi"), None, LOCAL, candidates)
    assert nowhere is not None and not nowhere.allows(node("a"))


def test_an_unbound_provisioned_claim_follows_allowed_topologies_and_immediate_ones_are_left_alone():
    zonal = {
        "metadata": {"name": "local"},
        "provisioner": "csi.example.com",
        "volumeBindingMode": volumes.WAIT_FOR_FIRST_CONSUMER,
        "allowedTopologies": [{"matchLabelExpressions": [{"key": ZONE, "values": ["z2"]}]}],
    }
    where = volumes.topology(claim(), None, zonal)
    assert where is not None
    assert [where.allows(node("a", **{ZONE: z})) for z in ("z1", "z2")] == [False, True]
    assert volumes.topology(claim(), None, {**zonal, "allowedTopologies": []}) is None
    assert volumes.topology(claim(), None, {**zonal, "volumeBindingMode": "Immediate"}) is None


@pytest.mark.parametrize(
    ("modes", "nodes", "pods", "refused"),
    [
        (["ReadWriteOnce"], 1, 2, False),  # one node mounts it for all its pods
        (["ReadWriteOnce"], 2, 2, True),
        (["ReadWriteOncePod"], 1, 2, True),  # one pod only
        (["ReadWriteOncePod"], 1, 1, False),
        (["ReadWriteOnce", "ReadWriteMany"], 4, 4, False),
        ([], 4, 4, False),  # unknown: left to the scheduler and kubelet
    ],
)
def test_a_claim_one_node_or_pod_mounts_is_refused_for_a_gang_that_spans_more(
    modes, nodes, pods, refused
):
    claim = {"metadata": {"name": "c"}, "spec": {"accessModes": modes}}
    message = volumes.access_refusal(claim, nodes, pods)
    assert (message is not None) is refused
    if refused:
        assert message is not None and "checkpoint.claimName c has accessModes" in message
