"""``spec.topology.levels[].scope``: stage-scoped required levels in the spec, their two rules, the
request the planner gets, and what ``meshtrain validate`` prints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from meshtrain.api import elastic, loading, rules
from meshtrain.planner import placement_request
from tests.builders import JobBuilder

RACK = "example.com/rack"


def _job(level: dict[str, str], data: int = 2, tensor: int = 8, per_node: int = 8) -> JobBuilder:
    return (
        JobBuilder("staged")
        .layout(data=data, pipeline=2, tensor=tensor, gpus_per_node=per_node)
        .model(preset="1.3b")
        .topology(levels=[{"label": "example.com/block"}, {"label": RACK, **level}])
    )


def _problems(builder: JobBuilder) -> list[rules.Problem]:
    with pytest.raises(loading.SpecError) as refused:
        loading.parse_spec(builder.raw())
    return list(refused.value.problems)


def test_the_scope_defaults_to_job_and_reaches_the_placement_request():
    spec = loading.parse_spec(_job({"mode": "required"}).raw())
    assert spec.topology.levels[1].scope == "job"
    staged = loading.parse_spec(_job({"mode": "required", "scope": "stage"}).raw())
    request = placement_request.request_from_spec(staged)
    assert [(lv.label, lv.required, lv.scope) for lv in request.levels][1] == (
        RACK,
        True,
        "stage",
    )
    assert request.stage_pods == 2


def test_stage_scope_with_a_preference_is_refused_naming_what_to_write():
    (problem,) = _problems(_job({"scope": "stage"}))
    assert problem.path == "spec.topology.levels"
    assert "spec.topology.levels[1]" in problem.message and "mode: required" in problem.message
    assert "drop scope" in problem.message


def test_stage_scope_where_stages_share_pods_is_refused():
    # dp1 x tp4 per stage on pods of 8 GPUs: each pod holds ranks of two stages
    (problem,) = _problems(_job({"mode": "required", "scope": "stage"}, data=1, tensor=4))
    assert problem.path == "spec.topology.levels"
    assert "1 x 1 x 4 = 4" in problem.message and "gpusPerNode=8" in problem.message
    assert "use scope job" in problem.message


def test_elastic_sizes_keep_whole_pod_stages_under_stage_scope():
    # tensor 4 on pods of 8: an even data degree fills a stage's pods, an odd one does not (dp3
    # fills whole pods, 3 x 2 x 4 = 24 ranks, but its stages share one)
    builder = _job({"mode": "required", "scope": "stage"}, data=4, tensor=4).checkpoint(
        claimName="ckpt"
    )
    spec = loading.parse_spec(builder.run_policy(elastic={"minData": 2, "maxData": 4}).raw())
    assert [size.data for size in elastic.sizes(spec)] == [4, 2]
    (problem,) = _problems(builder.run_policy(elastic={"minData": 1, "maxData": 4}))
    assert problem.path == "spec.runPolicy.elastic.minData" and "scope stage" in problem.message


def test_validate_prints_both_problems(tmp_path):
    path = tmp_path / "job.yaml"
    builder = _job({"scope": "stage"}, data=1, tensor=4)
    path.write_text(yaml.safe_dump({**builder.manifest(), "metadata": {"name": "staged"}}))
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout
    assert result.stderr.count("spec.topology.levels") >= 2, result.stderr
    assert "mode: required" in result.stderr and "use scope job" in result.stderr


def test_a_level_naming_the_nvlink_domain_is_its_requirement_not_a_fabric_level():
    clique = "nvidia.com/gpu.clique"
    levels = [{"label": RACK}, {"label": clique, "mode": "required", "scope": "stage"}]
    builder = _job({}).topology(nvlinkDomainLabel=clique, levels=levels)
    request = placement_request.request_from_spec(loading.parse_spec(builder.raw()))
    assert [level.label for level in request.levels] == [RACK]
    assert request.nvlink_domain_level is not None
    assert (request.nvlink_domain_level.label, request.nvlink_domain_level.scope) == (
        clique,
        "stage",
    )
    (problem,) = _problems(builder.topology(levels=levels[::-1]))
    assert problem.path == "spec.topology.levels" and "as the last level" in problem.message
