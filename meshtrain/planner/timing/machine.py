"""What the step-time model asks of a machine, whatever its kind: :class:`Machine`.

:mod:`.step_time` prices each stage's work at the machine's :class:`~.stage_work.Prices` and
composes the step from its answers.  One implementation per kind, chosen once from the profile:
:class:`.device_node.DeviceNode` (a device per rank) and :class:`.cpu_host.CpuHost` (ranks
sharing a host's cores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, profiles
from meshtrain.planner.timing import pipeline_window, stage_work


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The pipeline part of one step as a machine runs it."""

    window: pipeline_window.Window
    """From the step's start until the last stage finishes its last backward."""
    step_loop: float = 0.0
    """Priced seconds of a rank's step loop that run inside the window (the rest follows it)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """The step, and the machine's capacity where that bounds it."""

    step_seconds: float
    """Predicted wall time of one step."""
    cpu_seconds: float = 0.0
    """CPU seconds of all ranks in one step, where the cores they share bound the step (0 elsewhere)."""
    available_cores: float = 0.0
    """Cores the ranks share (0 where each rank has its own device)."""
    rank_cpu_seconds: tuple[float, ...] = ()
    """CPU seconds of one rank of each stage in one step, step loop included (empty elsewhere)."""


@dataclasses.dataclass(frozen=True)
class JobOnMachine:
    """A job's ranks on the machine a profile describes: what each kind of machine is built from."""

    job: api_spec.TrainingJobSpec
    """The job whose ranks run there."""
    profile: profiles.Profile
    """The machine's figures."""
    pod_domains: Sequence[str] | None = None
    """NVLink domain (or host) of each pod (None: every pod its own)."""

    @property
    def oversubscription(self) -> float:
        """Threads the ranks of one host run over its cores (1 without a core count, as on a GPU)."""
        return host_oversubscription(self.job, self.profile)


class Machine(Protocol):
    """One kind of machine as a job's ranks use it."""

    @property
    def prices(self) -> stage_work.Prices:
        """What a rank's work costs: its FLOP/s, an operation, memory traffic, the link of each group."""
        ...

    @property
    def speed(self) -> float:
        """Priced seconds of work a rank does per second on the schedule's critical path."""
        ...

    @property
    def oversubscription(self) -> float:
        """Threads the ranks of one host run over its cores (1 without a core count)."""
        ...

    @property
    def step_loop_seconds(self) -> float:
        """Priced seconds a rank's step loop costs per step beyond its tensor work (0: not measured)."""
        ...

    def on_path(
        self, stage: stage_work.StageTime, stage_comm: comm.StageComm
    ) -> stage_work.StageTime:
        """A stage's priced work as seconds on the critical path, waits included."""
        ...

    def window(self, durations: Sequence[pipeline_window.StageDurations], send: float) -> Pipeline:
        """The pipeline window from each stage's critical-path seconds per micro-batch and one message's."""
        ...

    def bound(self, work: Sequence[stage_work.StageTime], dependencies: float) -> Bound:
        """The step: the critical path ``dependencies``, or longer where all ranks' priced ``work`` needs it."""
        ...


def ranks_per_host(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> int:
    """Ranks sharing one host: a pod's ``gpusPerNode``; on a CPU profile (``cores``) every rank, as ``meshtrain run`` starts them."""
    return job.world_size if profile.cores else job.resources.gpus_per_node


def host_oversubscription(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> float:
    """Threads of one host's ranks over its cores (each rank runs ``max(1, cores // ranks)`` threads)."""
    if not profile.cores:
        return 1.0
    ranks = ranks_per_host(job, profile)
    threads = max(1, profile.cores // ranks)
    return max(1.0, ranks * threads / profile.cores)
