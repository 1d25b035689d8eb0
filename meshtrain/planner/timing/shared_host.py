"""What the job's ranks sharing one CPU host's cores have in common, whatever prices their work.

On a CPU profile (one with ``cores``) every rank of the job runs on the one host, as ``meshtrain
run`` starts them, each with ``max(1, cores // ranks)`` threads; past the core count they
time-share.  :class:`HostLoad` is what a step asks of that host: the part of a plan only the
machines whose ranks share a host (:mod:`.core_share`, :mod:`.cpu_host`) fill.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api import spec as api_spec
from meshtrain.planner import profiles


@dataclasses.dataclass(frozen=True)
class CpuWork:
    """All ranks' CPU work in one step against the cores they share (a host priced in CPU seconds)."""

    cpu_seconds: float
    """CPU seconds of all ranks in one step."""
    available_cores: float
    """Cores the ranks share; ``cpu_seconds / available_cores`` bounds the step."""
    rank_cpu_seconds: tuple[float, ...]
    """CPU seconds of one rank of each stage in one step, the step loop included."""


@dataclasses.dataclass(frozen=True)
class HostLoad:
    """What one step asks of the host whose cores the job's ranks share."""

    oversubscription: float
    """Threads the ranks run over the host's cores (above 1 they time-share)."""
    work: CpuWork | None = None
    """The ranks' CPU work against the cores, where the profile prices CPU time (None: priced by core share)."""


def ranks(job: api_spec.TrainingJobSpec) -> int:
    """Ranks sharing the host: every rank of the job, as ``meshtrain run`` starts them."""
    return job.world_size


def threads_per_rank(profile: profiles.Profile, ranks: int) -> int:
    """Threads each rank runs: ``cores // ranks``, at least one (as ``meshtrain run`` sets ``OMP_NUM_THREADS``)."""
    return max(1, profile.cores // max(1, ranks))


def oversubscription(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> float:
    """Threads of the host's ranks over its cores, at least 1."""
    count = ranks(job)
    return max(1.0, count * threads_per_rank(profile, count) / profile.cores)
