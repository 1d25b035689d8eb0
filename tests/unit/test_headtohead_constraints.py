"""The head to head gives both sides the same constraints: per trace job, what Kueue's batch Job
asks (its TAS annotations, read back as Kueue reads them) equals what meshtrain's TrainingJob asks
(its spec parsed by the real spec model and turned into the planner's request)."""

from __future__ import annotations

from benchmarks.fleet import headtohead, kueue_tas, kwok, trace
from meshtrain.api import loading
from meshtrain.planner import placement_request

SHAPES = (kwok.Shape(nodes=256), kwok.Shape(nodes=128), kwok.Shape(nodes=1024))


def _kueue(asked: dict[str, str]) -> tuple[str | None, str | None, int]:
    """(required level, stage slice level, slice size) of a pod template's TAS annotations."""
    size = int(asked.get(kueue_tas.SLICE_SIZE, "0"))
    return asked.get(kueue_tas.REQUIRED), asked.get(kueue_tas.SLICE_REQUIRED), size


def _meshtrain(raw: dict[str, object]) -> tuple[str | None, str | None, int]:
    """(lowest level the job is required in, lowest level each stage is, pods per stage) of a
    TrainingJob spec, as the planner receives it."""
    request = placement_request.request_from_spec(loading.parse_spec(raw))
    every = list(request.levels)
    if request.nvlink_domain_level is not None:
        every.append(request.nvlink_domain_level)
    job = [level.label for level in every if level.required and level.scope == "job"]
    stage = [level.label for level in every if level.required and level.scope == "stage"]
    return (
        job[-1] if job else None,
        stage[-1] if stage else None,
        request.stage_pods if stage else 0,
    )


def test_each_job_asks_meshtrain_what_it_asks_kueue() -> None:
    kinds = set()
    for shape in SHAPES:
        jobs = list(trace.jobs(trace.Trace(shape, wall_seconds=8 * 60)))
        sizes = headtohead.domain_gpus(shape)
        levels = headtohead.same_levels(jobs, shape)
        for job in jobs:
            spec = loading.parse_spec(job.spec())
            asked = kueue_tas.annotations(spec, kueue_tas.fabric_for(spec, sizes))
            ours = _meshtrain(job.spec(levels[job.name]))
            assert ours == _kueue(asked), (shape, job.name, asked, levels[job.name])
            kinds.add((ours[0] is not None, ours[1]))
    # stages required in the NVLink domain, a rack and a block, and one-stage jobs required whole
    assert {stage for _, stage in kinds} >= {kwok.CLIQUE_LABEL, kwok.RACK_LABEL, kwok.BLOCK_LABEL}
    assert (True, None) in kinds


def test_all_preferred_is_the_old_spec() -> None:
    job = next(trace.jobs(trace.Trace(kwok.Shape(nodes=256))))
    assert _meshtrain(job.spec()) == (None, None, 0)
