"""What the step-time model asks of a machine, whatever its kind: :class:`Machine`.

:mod:`.step_time` prices each stage's work at the machine's :class:`~.stage_work.Prices` and
composes the step from its answers.  One implementation per kind, chosen once from the profile:
:class:`.device_node.DeviceNode` (a device per rank), :class:`.core_share.CoreShareHost` (a CPU
host's ranks, each a device at its share of the cores) and :class:`.cpu_host.CpuHost` (ranks
sharing a host's cores, priced in CPU seconds).  What only a shared host has comes back as the
bound's ``host`` part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, profiles
from meshtrain.planner.timing import pipeline_window, shared_host, stage_work


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The pipeline part of one step as a machine runs it."""

    window: pipeline_window.Window
    """From the step's start until the last stage finishes its last backward."""
    after_window: float = 0.0
    """Critical-path seconds of a rank's own work that follow the window and the stages' tails (a CPU host's step loop left over)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """The step, and what it asks of a host whose cores the ranks share."""

    step_seconds: float
    """Predicted wall time of one step."""
    host: shared_host.HostLoad | None = None
    """The shared host's load (None: each rank has its own device)."""


@dataclasses.dataclass(frozen=True)
class JobOnMachine:
    """A job's ranks on the machine a profile describes: what each kind of machine is built from."""

    job: api_spec.TrainingJobSpec
    """The job whose ranks run there."""
    profile: profiles.Profile
    """The machine's figures."""
    pod_domains: Sequence[str] | None = None
    """NVLink domain (or host) of each pod (None: every pod its own)."""


class Machine(Protocol):
    """One kind of machine as a job's ranks use it."""

    @property
    def prices(self) -> stage_work.Prices:
        """What a rank's work costs: its FLOP/s, an operation, memory traffic, the link of each group."""
        ...

    @property
    def rank_flops(self) -> float:
        """Matmul FLOP/s one rank computes at on the schedule's critical path."""
        ...

    def on_path(
        self, stage: stage_work.StageTime, stage_comm: comm.StageComm
    ) -> stage_work.StageTime:
        """A stage's priced work as seconds on the critical path, waits included."""
        ...

    def seconds_on_path(self, priced: float) -> float:
        """Critical-path seconds of work priced at ``priced`` (a pipeline message, a closing all-reduce)."""
        ...

    def window(self, durations: Sequence[pipeline_window.StageDurations], send: float) -> Pipeline:
        """The pipeline window from each stage's critical-path seconds per micro-batch and one message's."""
        ...

    def bound(self, work: Sequence[stage_work.StageTime], dependencies: float) -> Bound:
        """The step: the critical path ``dependencies``, or longer where all ranks' priced ``work`` needs it."""
        ...
