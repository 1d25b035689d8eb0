"""``meshtrain plan --search``: the fastest valid layouts for a world size, ranked by predicted step time.

:func:`layouts` lists the layouts of a world size (docs/planner.md, "Layout search") and
:func:`candidates` keeps those the spec's own rules accept; each must also fit the profile's memory
and, with nodes, be placed by the operator's placement.
With ``measure`` (``--search --calibrate``), the best :data:`MEASURED_GRIDS` grids have their step
loop measured on their own layout before the final ranking; the caller hands that callable in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import estimate, profiles


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout and what the planner predicts for it."""

    parallelism: dict[str, Any]
    """The ``parallelism`` fields that differ from the job (camelCase), plus ``training.microBatch``."""
    label: str
    """Layout, schedule, micro-batches and ZeRO stage in one line."""
    step_seconds: float
    """Predicted step time."""
    peak_bytes: float
    """Memory of the worst stage per device."""
    headroom_bytes: float
    """Device memory left on the worst stage."""
    bubble: float
    """Predicted idle share of stage 0."""
    nodes: tuple[str, ...] = ()
    """Node per pod when a cluster was given."""
    grid_measured: bool = False
    """Priced with a step loop measured on its own (dp, pp, tp) grid (``--search --calibrate``)."""


MeasureLayout = Callable[[api_spec.TrainingJobSpec, profiles.Profile], profiles.Profile]
"""``meshtrain.trainer.calibration.measure.measure_step_loop``: a profile with a layout's own step-loop figures."""

MEASURED_GRIDS = 3
"""Distinct (dp, pp, tp) grids whose step loop a measuring search runs before its final ranking."""

Scored = tuple[float, float, dict[str, Any], estimate.Plan]
"""Step seconds, worst stage's memory, the spec change and its plan."""


def grid(change: dict[str, Any]) -> tuple[int, ...]:
    """The (data, pipeline, tensor) degrees of a layout change, and its context degree where above 1."""
    context = change.get("context", 1)
    return (change["data"], change["pipeline"], change["tensor"]) + (
        (context,) if context > 1 else ()
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Pipeline schedules tried, in this order; one stage skips gpipe, which is 1f1b there."""


def layouts(job: api_spec.TrainingJobSpec, world: int) -> Iterator[dict[str, Any]]:
    """Spec changes (camelCase ``parallelism`` keys, ``microBatch``) of every layout of ``world`` ranks
    that keeps the job's global batch, valid or not: :func:`candidates` keeps those the rules accept.

    The context degree is the fourth, tried where the sequence splits into ``2 x context`` chunks
    (ring attention's load balancing); a change names it only where it is above 1 or the job's is.
    """
    for tensor in _divisors(world):
        for context in context_degrees(job, world // tensor):
            for pipeline in _divisors(world // (tensor * context)):
                data = world // (tensor * context * pipeline)
                for split in _batch_splits(job, data, pipeline):
                    change = {"data": data, "pipeline": pipeline, "tensor": tensor, **split}
                    if context > 1 or job.parallelism.context > 1:
                        change["context"] = context
                    yield change


CONTEXT_MIN_TOKENS = 1024
"""Fewest tokens of a sequence per context rank the search tries: below it a ring step's attention
(``(s / c)^2`` work against ``s / c`` bytes) is too small to hide its transfer, and Megatron-Core
and TorchTitan use context parallelism for long sequences only."""


def context_degrees(job: api_spec.TrainingJobSpec, ranks: int) -> list[int]:
    """Context degrees among the divisors of ``ranks`` whose ``2 x context`` chunks split the job's
    sequence, each rank keeping at least :data:`CONTEXT_MIN_TOKENS` of it (1 always)."""
    seq = job.model.shape().seq_len
    return [
        c
        for c in _divisors(ranks)
        if c == 1 or (seq % (2 * c) == 0 and seq // c >= CONTEXT_MIN_TOKENS)
    ]


def _batch_splits(
    job: api_spec.TrainingJobSpec, data: int, pipeline: int
) -> Iterator[dict[str, Any]]:
    """Micro-batch sizes, schedules and ZeRO stages of ``data`` replicas of ``pipeline`` stages
    that keep the job's global batch (none when ``data`` does not divide it)."""
    sequences = job.global_batch
    if sequences % data:
        return
    per_replica = sequences // data
    sizes = {b for b in (job.training.micro_batch, 1, 2, 4, 8, 16) if b <= per_replica}
    for micro_batch in sorted(sizes):
        if per_replica % micro_batch:
            continue
        for schedule in SCHEDULES[1:] if pipeline == 1 else SCHEDULES:
            for zero in (0, 1, 2) if data > 1 else (0,):
                yield {
                    "microBatches": per_replica // micro_batch,
                    "schedule": schedule,
                    "zeroStage": zero,
                    # one chunk per rank unless interleaved, whatever the job declares
                    "virtualStages": 2 if schedule == "interleaved-1f1b" else 1,
                    "microBatch": micro_batch,
                }


def candidates(
    job: api_spec.TrainingJobSpec, world: int
) -> Iterator[tuple[dict[str, Any], api_spec.TrainingJobSpec]]:
    """Each of :func:`layouts` that passes the spec's own rules, with its spec.

    The rules alone prune (tensor dividing gpusPerNode and the heads, the layers
    split over the stages, interleaving's rounds, ...): the search states none again.
    """
    raw = job.model_dump(by_alias=True, exclude_none=True)
    for change in layouts(job, world):
        try:
            yield change, _with_layout(raw, change)
        except loading.SpecError:
            continue


def _with_layout(raw: dict[str, Any], change: dict[str, Any]) -> api_spec.TrainingJobSpec:
    """The spec ``raw`` (a job's camelCase dump) with ``change`` applied, through every rule."""
    parallelism = {k: v for k, v in change.items() if k != "microBatch"}
    return loading.parse_spec(
        {
            **raw,
            "parallelism": {**raw["parallelism"], **parallelism},
            "training": {**raw["training"], "microBatch": change["microBatch"]},
        },
        "search candidate",
    )


def label(change: dict[str, Any]) -> str:
    """``dp2·pp2·tp1 1f1b m=4 b=4 ZeRO-1`` (``dp2·pp2·cp2·tp1 ...`` with context)."""
    context = f"·cp{change['context']}" if change.get("context", 1) > 1 else ""
    return (
        f"dp{change['data']}·pp{change['pipeline']}{context}·tp{change['tensor']} {change['schedule']}"
        f" m={change['microBatches']} b={change['microBatch']} ZeRO-{change['zeroStage']}"
    )


def search(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    *,
    world: int,
    nodes: Sequence[placement.Node] | None = None,
    limit: int = 10,
    recipe: str = "meshtrain",
    measure: MeasureLayout | None = None,
) -> list[Candidate]:
    """The ``limit`` fastest valid, memory-feasible (and, with nodes, placeable) layouts."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    scored: list[Scored] = []
    for change, candidate in candidates(job, world):
        plan = estimate.make_plan(candidate, profile, recipe=recipe)
        if not plan.memory.fits:
            continue
        scored.append((plan.time.step_seconds, plan.memory.worst.total, change, plan))
    scored.sort(key=lambda item: (item[0], item[1]))
    # Only a CPU host's profile has step-loop figures to measure (a GPU's are the datasheet's).
    by_grid: dict[tuple[int, ...], profiles.Profile] = {}
    if measure is not None and profile.cpu_time_model:
        scored, by_grid = _measured_ranking(scored, profile, measure, recipe)
    if (
        nodes is not None
    ):  # place the best until enough are placeable; price their links by the placement
        placed: list[Scored] = []
        for _, _, change, plan in scored:
            on_nodes = estimate.make_plan(
                plan.job, by_grid.get(grid(change), profile), recipe=recipe, nodes=nodes
            )
            if on_nodes.placement is None or on_nodes.placement.unschedulable_reason:
                continue
            placed.append(
                (on_nodes.time.step_seconds, on_nodes.memory.worst.total, change, on_nodes)
            )
            if len(placed) == 3 * limit:
                break
        scored = sorted(placed, key=lambda item: (item[0], item[1]))
    return [
        Candidate(
            parallelism=change,
            label=label(change),
            step_seconds=seconds,
            peak_bytes=peak,
            headroom_bytes=plan.memory.headroom,
            bubble=plan.time.bubble_stage0,
            nodes=plan.placement.nodes if plan.placement else (),
            grid_measured=grid(change) in by_grid,
        )
        for seconds, peak, change, plan in scored[:limit]
    ]


def _measured_ranking(
    scored: list[Scored], profile: profiles.Profile, measure: MeasureLayout, recipe: str
) -> tuple[list[Scored], dict[tuple[int, ...], profiles.Profile]]:
    """``scored`` ranked again until its :data:`MEASURED_GRIDS` best grids are all measured, and their profiles.

    Each round measures the best layout of every unmeasured grid among the
    best, prices that grid's candidates again and re-sorts: a grid that
    falls behind lets another one in, which is measured in turn (at most
    twice :data:`MEASURED_GRIDS` grids in all).
    """
    ranked = scored
    by_grid: dict[tuple[int, ...], profiles.Profile] = {}
    while len(by_grid) < 2 * MEASURED_GRIDS:
        best: dict[tuple[int, ...], estimate.Plan] = {}
        for *_, change, plan in ranked:
            if len(best) == MEASURED_GRIDS:
                break
            best.setdefault(grid(change), plan)
        budget = 2 * MEASURED_GRIDS - len(by_grid)
        unmeasured = [(key, plan) for key, plan in best.items() if key not in by_grid][:budget]
        if not unmeasured:
            break
        by_grid |= {key: measure(plan.job, profile) for key, plan in unmeasured}
        ranked = sorted(
            (
                _priced(plan, by_grid.get(grid(change)), change, recipe)
                for *_, change, plan in scored
            ),
            key=lambda item: (item[0], item[1]),
        )
    return ranked, by_grid


def _priced(
    plan: estimate.Plan,
    grid_profile: profiles.Profile | None,
    change: dict[str, Any],
    recipe: str,
) -> Scored:
    """A scored candidate, priced again with its grid's measured profile where there is one."""
    if grid_profile is not None:
        plan = estimate.make_plan(plan.job, grid_profile, recipe=recipe)
    return plan.time.step_seconds, plan.memory.worst.total, change, plan
