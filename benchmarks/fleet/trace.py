"""A seeded workload trace for the KWOK fleet: job arrivals, sizes (8 to 4,096 GPUs), durations and
failures, time-compressed, each job a TrainingJob whose pods fill 8-GPU nodes.

Source: Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters"
(Meta FAIR, HPCA 2025, arXiv:2410.21680): two multi-tenant A100 clusters, RSC-1 (16k GPUs) and
RSC-2 (8k GPUs), 11 months, over 4 million jobs and 150 million GPU-hours, kept above 80%
utilisation. The figures this generator takes from it:

- the shape of the size mix only: most jobs are small (one node) while most GPU-time goes to the
  few large ones.  :data:`SIZE_WEIGHTS` itself is our choice, not the paper's: a geometric mix,
  each power of two from 8 to 4,096 GPUs half as likely as the one below (so 8-GPU jobs are ~50%
  of jobs, yet jobs of 256 GPUs and more hold more than half the GPU-time, with
  :data:`DURATION_GROWTH`);
- its failure model: a job's nodes fail in series, MTTF = 1 / (nodes x r_f); the rate
  :data:`FAILURES_PER_NODE_DAY` is the one Meta's Llama 3 paper (Dubey et al. 2024, its Table 5)
  reports for a 16,384-GPU run: 419 unplanned interruptions in 54 days, i.e. 4.7e-4 per GPU-day,
  3.8e-3 per 8-GPU node-day;
- the 80%+ allocation those clusters run at (the run's target: 20 minutes above 80%).

Durations are log-normal (median :data:`MEDIAN_HOURS`, sigma :data:`DURATION_SIGMA`, growing with
size by :data:`DURATION_GROWTH` per doubling): our choice, shaped after the long-tailed durations the
Philly (Jeon et al., ATC'19) and PAI (Weng et al., NSDI'22) traces report, not a figure of theirs.
Cluster time is compressed by :attr:`Trace.compression` (default 60: a cluster hour is a wall minute).
With :attr:`Trace.time_limits` every job declares a time limit (``runPolicy.activeDeadlineSeconds``,
:data:`LIMIT_FACTORS`), as on a cluster whose queues require one, which lets the operator backfill
the nodes it reserves for a large gang.
Arrivals are Poisson at the rate that offers :attr:`Trace.load` times the fleet's GPUs, after a burst
at time 0 that fills :attr:`Trace.initial_fill` of it (so the run is above 80% within minutes).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from typing import Any

from benchmarks.fleet import kwok
from meshtrain.api import spec as api_spec
from tests.builders import JobBuilder

SIZES = tuple(8 * 2**i for i in range(10))
"""Job sizes in GPUs, 8 (one node) to 4,096 (512 nodes)."""
SIZE_WEIGHTS = tuple(0.5**i for i in range(len(SIZES)))
"""Relative frequency of each size: each doubling half as frequent (Kokolis et al.: most jobs small)."""
MEDIAN_HOURS = 1.0
"""Median duration of an 8-GPU job in cluster hours."""
DURATION_SIGMA = 1.0
"""Log-normal sigma of durations (a long tail: p99 ~10x the median)."""
DURATION_GROWTH = 1.25
"""Each doubling of size lengthens the median by this factor (large jobs run longer)."""
MAX_HOURS = 24.0
"""Durations are cut at a cluster day (jobs checkpoint and requeue beyond; Kokolis et al.)."""
FAILURES_PER_NODE_DAY = 419 / (16_384 / kwok.GPUS_PER_NODE) / 54
"""Unplanned interruptions per 8-GPU node per day (Llama 3's 16k-GPU run: 419 in 54 days)."""
MODEL = "1.3b"
"""The model every job trains (its size matters to the operator's memory admission only)."""
NAMESPACE = "fleet"
LEVELS = ({"label": kwok.BLOCK_LABEL}, {"label": kwok.RACK_LABEL})
"""The fleet's fabric levels as ``spec.topology.levels``, each preferred."""
LIMIT_FACTORS = (1.5, 4.0)
"""A job's declared limit is its run time (a failed attempt's included) times a factor drawn
uniformly from this range, rounded up to whole cluster hours: our choice, shaped after the finding
that users' run-time estimates are loose upper bounds (Mu'alem and Feitelson, IEEE TPDS 2001;
Tsafrir, Etsion and Feitelson, IEEE TPDS 2007), not a figure of theirs."""
HELD_SECONDS = 30 * 24 * 3600.0
"""How long the pods of :func:`held` run: longer than any run."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the trace."""

    name: str
    """The TrainingJob's name."""
    arrival: float
    """Wall seconds after the run starts when it is applied."""
    gpus: int
    """GPUs it asks (a multiple of 8: its pods fill nodes)."""
    run_seconds: float
    """Wall seconds its pods run once bound, on the attempt that succeeds."""
    fail_after: float | None
    """Wall seconds its first attempt runs before a pod fails (None: it never fails)."""
    limit_seconds: int | None = None
    """Its ``runPolicy.activeDeadlineSeconds`` in wall seconds (None: it declares none)."""

    @property
    def pods(self) -> int:
        return self.gpus // kwok.GPUS_PER_NODE

    def layout(self) -> dict[str, int]:
        """Tensor parallel within a node (8), pipeline across up to 4 nodes, data across the rest."""
        pipeline = min(4, self.pods)
        return {"tensor": kwok.GPUS_PER_NODE, "pipeline": pipeline, "data": self.pods // pipeline}

    def spec(self, levels: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """The TrainingJob spec: the layout, the fleet's topology labels (every level preferred,
        unless ``levels`` says otherwise), KWOK's lifecycle annotations."""
        builder = (
            JobBuilder(self.name, NAMESPACE)
            .layout(**self.layout(), gpus_per_node=kwok.GPUS_PER_NODE)
            .model(preset=MODEL)
            .topology(
                nvlinkDomainLabel=kwok.CLIQUE_LABEL,
                levels=levels or [dict(level) for level in LEVELS],
            )
            .pod(annotations=kwok.lifecycle_annotations(self.run_seconds, self.fail_after))
        )
        if self.limit_seconds is not None:
            builder.run_policy(activeDeadlineSeconds=self.limit_seconds)
        return builder.raw()

    def manifest(self, levels: list[dict[str, str]] | None = None) -> dict[str, Any]:
        return {
            "apiVersion": f"{api_spec.API_GROUP}/{api_spec.API_VERSION}",
            "kind": api_spec.KIND,
            "metadata": {"name": self.name, "namespace": NAMESPACE},
            "spec": self.spec(levels),
        }


@dataclasses.dataclass(frozen=True)
class Trace:
    """What to generate: the fleet it runs on, for how long, how loaded, how compressed."""

    shape: kwok.Shape
    """The fleet (its GPUs set the arrival rate; no job is larger than half of it)."""
    seed: int = 36
    """Seed of the generator: the same seed, the same jobs."""
    wall_seconds: float = 25 * 60
    """Wall seconds during which jobs arrive (the run then drains for a while)."""
    compression: float = 60.0
    """Cluster seconds per wall second."""
    load: float = 1.1
    """Offered GPU-time over the fleet's: above 1, a queue forms and the fleet stays full."""
    initial_fill: float = 0.9
    """Share of the fleet's GPUs asked at time 0 (jobs arriving together)."""
    time_limits: bool = False
    """Whether every job declares a time limit (:data:`LIMIT_FACTORS`); drawn apart from the rest,
    so the same seed gives the same jobs with or without."""


def _size(rng: random.Random, largest: int) -> int:
    sizes = [s for s in SIZES if s <= largest]
    return rng.choices(sizes, SIZE_WEIGHTS[: len(sizes)])[0]


def _cluster_hours(rng: random.Random, gpus: int) -> float:
    doublings = math.log2(gpus // SIZES[0])
    median = MEDIAN_HOURS * DURATION_GROWTH**doublings
    return min(MAX_HOURS, rng.lognormvariate(math.log(median), DURATION_SIGMA))


def _failure_hours(rng: random.Random, gpus: int) -> float:
    """Hours until one of the job's nodes fails (series model: exponential, rate nodes x r_f)."""
    rate_per_hour = gpus / kwok.GPUS_PER_NODE * FAILURES_PER_NODE_DAY / 24
    return rng.expovariate(rate_per_hour)


def mean_gpu_hours(largest: int) -> float:
    """Expected GPU-hours of one job (sizes up to ``largest``), from the model, not sampled."""
    sizes = [s for s in SIZES if s <= largest]
    weights = SIZE_WEIGHTS[: len(sizes)]
    total = 0.0
    for size, weight in zip(sizes, weights, strict=True):
        median = MEDIAN_HOURS * DURATION_GROWTH ** math.log2(size // SIZES[0])
        total += weight * size * median * math.exp(DURATION_SIGMA**2 / 2)
    return total / sum(weights)


def _limit_seconds(trace: Trace, index: int, run_seconds: float, fail_after: float | None) -> int:
    """Job ``index``'s declared limit in wall seconds (:data:`LIMIT_FACTORS`)."""
    rng = random.Random(f"{trace.seed}:limit:{index}")  # apart from the trace's own draws
    hour = 3600 / trace.compression
    hours = math.ceil(rng.uniform(*LIMIT_FACTORS) * (run_seconds + (fail_after or 0.0)) / hour)
    return max(1, round(hours * hour))


def jobs(trace: Trace) -> Iterator[Job]:
    """The trace's jobs in arrival order."""
    rng = random.Random(trace.seed)
    largest = min(SIZES[-1], trace.shape.gpus // 2)
    # GPU-seconds (cluster) offered per wall second at the given load, and the arrival rate giving it
    gpu_hours = mean_gpu_hours(largest)
    rate = trace.load * trace.shape.gpus * trace.compression / (gpu_hours * 3600)
    burst, asked, index, now = trace.initial_fill * trace.shape.gpus, 0.0, 0, 0.0
    while True:
        if asked >= burst:
            now += rng.expovariate(rate)
            if now > trace.wall_seconds:
                return
        gpus = _size(rng, largest)
        asked += gpus
        hours = _cluster_hours(rng, gpus)
        fails_at = _failure_hours(rng, gpus)
        run_seconds = hours * 3600 / trace.compression
        fail_after = fails_at * 3600 / trace.compression if fails_at < hours else None
        limit = _limit_seconds(trace, index, run_seconds, fail_after) if trace.time_limits else None
        yield Job(f"j{index:05d}-{gpus}", now, gpus, run_seconds, fail_after, limit)
        index += 1


def held(trace: Trace, count: int) -> list[Job]:
    """``count`` jobs of the trace's size mix, all arriving at once and never ending: on a fleet
    already full (``kwok.fill``) every one of them waits, for the operator's memory at rest."""
    every = jobs(dataclasses.replace(trace, initial_fill=1e9))
    return [
        dataclasses.replace(
            next(every), run_seconds=HELD_SECONDS, fail_after=None, limit_seconds=None
        )
        for _ in range(count)
    ]
