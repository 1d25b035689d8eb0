"""The TAS annotations a TrainingJob becomes as a Kueue batch Job (benchmarks/fleet/kueue_tas.py)."""

from __future__ import annotations

import pytest

from benchmarks.fleet import kueue_tas
from meshtrain.api import loading
from tests.builders import JobBuilder

BLOCK, RACK = "cloud.provider.com/topology-block", "cloud.provider.com/topology-rack"
CLIQUE, HOST = "nvidia.com/gpu.clique", kueue_tas.HOSTNAME
SIZES = {BLOCK: 256, RACK: 32, CLIQUE: 16, HOST: 8}
"""GPUs per domain: blocks of 8 racks of 2 cliques of 2 nodes of 8 GPUs."""


def spec(data: int, pipeline: int, tensor: int = 8, per_node: int = 8, clique: bool = False):
    builder = JobBuilder().layout(
        data=data, pipeline=pipeline, tensor=tensor, gpus_per_node=per_node
    )
    builder = builder.model({"layers": 8, "hidden": 64, "heads": 8, "vocab": 256, "seqLen": 32})
    levels = [{"label": BLOCK}, {"label": RACK}]
    topology = {"levels": levels, **({"nvlinkDomainLabel": CLIQUE} if clique else {})}
    return loading.parse_spec(builder.topology(**topology).raw())


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        # a stage of 2 pods (16 GPUs) fits a rack: each stage a required slice, the job prefers racks
        (
            spec(2, 4),
            {kueue_tas.PREFERRED: RACK, kueue_tas.SLICE_REQUIRED: RACK, kueue_tas.SLICE_SIZE: "2"},
        ),
        # with NVLink domains of 16 GPUs spanning nodes, the same stage asks for one domain
        (
            spec(2, 4, clique=True),
            {
                kueue_tas.PREFERRED: CLIQUE,
                kueue_tas.SLICE_REQUIRED: CLIQUE,
                kueue_tas.SLICE_SIZE: "2",
            },
        ),
        # a stage of 4 pods fits a rack, not a clique
        (
            spec(4, 2, clique=True),
            {kueue_tas.PREFERRED: RACK, kueue_tas.SLICE_REQUIRED: RACK, kueue_tas.SLICE_SIZE: "4"},
        ),
        # one stage: the whole PodSet is the slice, required in a rack
        (spec(4, 1), {kueue_tas.REQUIRED: RACK}),
        # a 64-GPU stage fits no rack but a block: each stage a required slice of one block
        (
            spec(8, 2),
            {
                kueue_tas.PREFERRED: BLOCK,
                kueue_tas.SLICE_REQUIRED: BLOCK,
                kueue_tas.SLICE_SIZE: "8",
            },
        ),
        # a 512-GPU stage fits no block: the job only prefers the lowest level
        (spec(64, 2), {kueue_tas.PREFERRED: RACK}),
        # a stage of one pod is never split: no slice, the job prefers the stage's domain
        (spec(1, 4, clique=True), {kueue_tas.PREFERRED: CLIQUE}),
        # stages of 4 GPUs share 8-GPU pods: no slice can be a stage
        (spec(1, 4, tensor=4), {kueue_tas.PREFERRED: RACK}),
    ],
)
def test_stage_slices_where_a_domain_holds_a_stage(job, expected) -> None:
    fabric = kueue_tas.fabric_for(job, SIZES)
    assert kueue_tas.annotations(job, fabric) == expected
    if kueue_tas.SLICE_REQUIRED in expected:  # Kueue refuses a slice level above the PodSet's
        levels = fabric.levels
        assert levels.index(expected[kueue_tas.SLICE_REQUIRED]) >= levels.index(
            expected[kueue_tas.PREFERRED]
        )


def test_the_batch_job_is_one_indexed_pod_per_node_slot() -> None:
    job = spec(2, 4)
    body = kueue_tas.batch_job("j", "ns", "q", job, kueue_tas.fabric_for(job, SIZES))
    assert body["metadata"]["labels"] == {kueue_tas.QUEUE_NAME_LABEL: "q"}
    assert (body["spec"]["completions"], body["spec"]["parallelism"]) == (8, 8)
    assert body["spec"]["completionMode"] == "Indexed" and body["spec"]["suspend"] is True
    [container] = body["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "8"}


def test_a_level_without_a_size_is_refused() -> None:
    with pytest.raises(ValueError, match="no size for the levels"):
        kueue_tas.fabric_for(spec(2, 4, clique=True), {BLOCK: 256, RACK: 32, HOST: 8})


def test_pod_nodes_reads_each_index_once_all_are_known() -> None:
    def pod(index: str, node: str | None, selector: str | None = None) -> dict:
        spec = {"nodeName": node} if node else {"nodeSelector": {HOST: selector}}
        return {"metadata": {"labels": {kueue_tas.COMPLETION_INDEX: index}}, "spec": spec}

    assert kueue_tas.pod_nodes([pod("1", "b"), pod("0", None, "a")], 2) == ["a", "b"]
    assert kueue_tas.pod_nodes([pod("1", "b")], 2) is None
    assert kueue_tas.pod_nodes([pod("0", "a"), pod("7", "z")], 1) == ["a"]
