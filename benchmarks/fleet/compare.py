"""What the head to head reports of each system's run: fabric bytes per step by level on the actual
binding, time to start and utilisation, per job and per job size.

Pure: the bytes are :func:`meshtrain.placement.fabric_cost.bound` (the placement's cost model) on
the nodes each pod was bound to, for the job's own placement request (its spec's model, layout and
levels).  A byte is counted at the highest level its two pods' nodes differ at: ``spine`` between
blocks, ``block`` between racks (leaves) of one block, ``leaf`` between NVLink domains of one rack,
``nvlink`` inside one.  Cross-leaf bytes are ``block + spine`` (they leave the leaf switch),
cross-block bytes are ``spine``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks.fleet import observe
from meshtrain.api import spec as api_spec
from meshtrain.placement import fabric_cost, values
from meshtrain.planner import placement_request

SWITCHES = ("leaf", "block", "spine")
"""The fabric levels bytes are reported at, bottom up."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """One job's bytes per step by the switch level they cross."""

    nvlink: float
    """Bytes between pods of one NVLink domain (never on the fabric)."""
    leaf: float
    """Bytes between NVLink domains of one rack: through its leaf switch."""
    block: float
    """Bytes between racks of one block: through the block's switches."""
    spine: float
    """Bytes between blocks: through the spine."""

    @property
    def cross_leaf(self) -> float:
        """Bytes that leave their leaf switch."""
        return self.block + self.spine

    @property
    def cross_block(self) -> float:
        """Bytes that leave their block."""
        return self.spine


def bound(
    job: api_spec.TrainingJobSpec, nodes: Iterable[values.Node], binding: Sequence[str]
) -> Bound:
    """Bytes per step of ``job`` with pod i on node ``binding[i]``, by level.

    ``job.topology`` must name the fabric levels (block, then rack) and may name an NVLink
    domain label; without one the node is the domain.
    """
    request = placement_request.request_from_spec(job)
    if len(request.levels) != 2:
        raise ValueError(
            f"the head to head prices two fabric levels (block, rack), got {request.levels}"
        )
    priced = fabric_cost.bound(request, nodes, binding)
    block, rack = (level.label for level in request.levels)
    domain = request.nvlink_domain_label or values.HOSTNAME_LABEL
    crossed = priced.level_bytes
    return Bound(
        nvlink=crossed[values.NVLINK],
        leaf=crossed[domain],
        block=crossed[rack],
        spine=crossed[block],
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one system did with one job."""

    gpus: int
    """GPUs the job asks."""
    start_seconds: float | None
    """Seconds from submission to all its pods running (None: never within the run)."""
    bytes: Bound | None
    """Its bytes per step on the binding (None: never fully bound)."""


def by_size(
    meshtrain: Mapping[str, Outcome], kueue: Mapping[str, Outcome]
) -> dict[str, dict[str, Any]]:
    """Per job size: starts and time to start of each system; bytes per step over the jobs both
    systems bound (mean per job), and whether meshtrain is lower on cross-leaf and cross-block."""
    rows: dict[str, dict[str, Any]] = {}
    for size in sorted({o.gpus for o in meshtrain.values()}):
        names = [name for name, o in meshtrain.items() if o.gpus == size]
        both = [n for n in names if meshtrain[n].bytes is not None and kueue[n].bytes is not None]
        row: dict[str, Any] = {"jobs": len(names), "bound_by_both": len(both)}
        for system, outcomes in (("meshtrain", meshtrain), ("kueue", kueue)):
            starts = [s for n in names if (s := outcomes[n].start_seconds) is not None]
            entry: dict[str, Any] = {
                "started": len(starts),
                "start_seconds": observe.percentiles(starts),
            }
            for field in ("leaf", "block", "spine", "cross_leaf", "cross_block"):
                per_job = [getattr(outcomes[n].bytes, field) for n in both]
                entry[f"{field}_bytes_per_step"] = statistics.fmean(per_job) if per_job else None
            row[system] = entry
        if both:
            ours, theirs = row["meshtrain"], row["kueue"]
            row["meshtrain_lower"] = {
                field: ours[f"{field}_bytes_per_step"] <= theirs[f"{field}_bytes_per_step"]
                for field in ("cross_leaf", "cross_block")
            }
        rows[str(size)] = row
    return rows


def utilisation(
    samples: Sequence[tuple[float, int, int]], gpus: int, start: float, end: float
) -> float:
    """Mean allocated share of ``gpus`` over ``[start, end]`` (samples: time, allocated, waiting),
    each sample holding until the next."""
    inside = [(at, held) for at, held, _ in samples if start <= at <= end]
    if len(inside) < 2:
        return 0.0
    area = sum(held * (later - at) for (at, held), (later, _) in zip(inside, inside[1:]))
    return area / (gpus * (inside[-1][0] - inside[0][0]))
