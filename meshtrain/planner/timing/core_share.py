"""A CPU host without CPU-time figures: each rank priced as a device with its share of the cores.

A CPU profile that calibration has not given CPU-time figures (``core_flops``) has the FLOP/s one
rank measured while some number of ranks computed at once (``flops_by_ranks``), or only a peak.
Each rank is then a :class:`~.device_node.DeviceNode` whose FLOP/s is scaled to the share of the
host's cores it gets (:func:`flops_per_rank`); the host reports its oversubscription.  With CPU-time
figures the host is a :class:`~.cpu_host.CpuHost` instead (docs/planner.md, "CPU hosts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.planner import profiles
from meshtrain.planner.timing import device_node, machine, shared_host, stage_work


def _core_share(profile: profiles.Profile, ranks: int) -> float:
    """Cores' worth of compute one of ``ranks`` ranks gets: its ``cores // ranks`` threads, time-shared."""
    threads = max(1, profile.cores // ranks)
    return threads * min(1.0, profile.cores / (ranks * threads))


def flops_per_rank(profile: profiles.Profile, ranks: int) -> float:
    """Matmul FLOP/s of one rank when ``ranks`` ranks share the host's cores.

    From the measurement with the nearest rank count, scaled by the rank's
    share of the cores (each rank runs ``cores // ranks`` threads, as
    ``meshtrain run`` and the pods set ``OMP_NUM_THREADS``; past the core
    count ranks time-share).  Without a measurement or a core count: the
    achievable FLOP/s.
    """
    if not profile.flops_by_ranks or not profile.cores:
        return profile.achievable_flops
    ranks = max(1, ranks)
    nearest = min(profile.flops_by_ranks, key=lambda r: (abs(r - ranks), r))
    return (
        profile.flops_by_ranks[nearest]
        * _core_share(profile, ranks)
        / _core_share(profile, nearest)
    )


@dataclasses.dataclass(frozen=True)
class CoreShareHost(device_node.DeviceNode):
    """A CPU host's ranks, each a device at its share of the cores, priced in wall seconds (:class:`~.machine.Machine`)."""

    @property
    def rank_flops(self) -> float:
        """The FLOP/s one rank gets with every rank of the job on the host."""
        return flops_per_rank(self.profile, shared_host.ranks(self.job))

    def bound(self, work: Sequence[stage_work.StageTime], dependencies: float) -> machine.Bound:
        """The critical path (each rank's share of the cores is in its prices), and the host's oversubscription."""
        return machine.Bound(
            step_seconds=dependencies,
            host=shared_host.HostLoad(shared_host.oversubscription(self.job, self.profile)),
        )
