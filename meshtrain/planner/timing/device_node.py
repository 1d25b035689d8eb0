"""A machine whose ranks each own a device: the GPUs of a node, priced in wall seconds.

Work at the device's achievable FLOP/s and cost per operation, collectives at the alpha-beta price
of their group's link (:mod:`.network`), the closed-form pipeline window, the step its critical
path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.planner import comm, device_rate
from meshtrain.planner.timing import machine, network, pipeline_window, stage_work


@dataclasses.dataclass(frozen=True)
class DeviceNode(machine.JobOnMachine):
    """A device per rank, priced in wall seconds (:class:`~.machine.Machine`)."""

    @property
    def prices(self) -> stage_work.Prices:
        """The device's FLOP/s, cost per operation and memory bandwidth, and its links."""
        kinds = network.links(self.profile)
        return stage_work.Prices(
            rank_flops=self.rank_flops,
            op_seconds=self.profile.op_overhead,
            memory_bandwidth=self.profile.memory_bandwidth,
            links=network.axis_links(self.job, kinds, self.pod_domains),
            domain_link=kinds["nvlink"],
        )

    @property
    def rank_flops(self) -> float:
        """The device's achievable FLOP/s for the job's step (compile, float8: :mod:`~meshtrain.planner.device_rate`)."""
        return device_rate.rank_flops(self.job, self.profile)

    def on_path(
        self, stage: stage_work.StageTime, stage_comm: comm.StageComm
    ) -> stage_work.StageTime:
        """The stage's work as priced: a device runs only its own rank."""
        return stage

    def seconds_on_path(self, priced: float) -> float:
        """Prices are wall seconds: work runs at them."""
        return priced

    def window(
        self, durations: Sequence[pipeline_window.StageDurations], send: float
    ) -> machine.Pipeline:
        """The closed form with each stage's own durations."""
        return machine.Pipeline(
            pipeline_window.window(
                self.job.parallelism.micro_batches,
                durations,
                send,
                self.job.parallelism.virtual_stages,
            )
        )

    def bound(self, work: Sequence[stage_work.StageTime], dependencies: float) -> machine.Bound:
        """The critical path: every rank has its own device."""
        return machine.Bound(step_seconds=dependencies)
