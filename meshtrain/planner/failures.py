"""Planning for failures: a job's mean time between failures, its expected goodput, and the
checkpoint interval that maximises it (Young 1974, Daly 2006), for storage and in-memory checkpoints.

The model is Daly's ("A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22, 2006): failures arrive as a Poisson process of mean
interval ``M`` (also during a restart), a checkpoint costs ``delta`` seconds of blocked training,
a failure costs the restart ``R`` plus the work since the last checkpoint.  Computing ``tau``
seconds between checkpoints then takes ``M e^(R/M) (e^((tau+delta)/M) - 1)`` seconds of wall
time, so the expected goodput is ``tau / (M e^(R/M) (e^((tau+delta)/M) - 1))``.  Pure arithmetic,
no I/O (docs/planner.md, "Failures and the checkpoint interval").
"""

from __future__ import annotations

import dataclasses
import math

LLAMA3_INTERRUPTIONS = 466
"""Job interruptions in Llama 3 405B's pre-training (Meta, "The Llama 3 Herd of Models", 2024, §3.3.4)."""
LLAMA3_DAYS = 54
"""Days of the snapshot those interruptions were counted over (same source)."""
LLAMA3_GPUS = 16_384
"""H100 GPUs of that job (same source)."""

DEFAULT_FAILURE_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
"""Interruptions per GPU-hour, from Llama 3's figures: 466 / (54 d x 24 h x 16,384 GPUs) = 2.19e-5
(one every 2.8 hours on 16,384 GPUs; 45 hours on 1,024)."""

FAILURE_RATE_SOURCE = (
    "Meta, The Llama 3 Herd of Models (2024), 3.3.4: 466 job interruptions in 54 days "
    "on 16,384 H100 GPUs"
)
"""Where :data:`DEFAULT_FAILURE_RATE` comes from, as the report names it."""

DEFAULT_RESTART_SECONDS = 27.0
"""Failure to the next reported step of a full gang rebuild, measured in the sandbox (issue #34:
a rank of the example job killed at step 58, progress again 27 s later, most of it Python, torch
and process-group start-up): detection and restart; the example's checkpoint is a few MiB, so its
reload is in there too, and a large model's reload is added (:func:`plan_failures`)."""

DEFAULT_STORAGE_BANDWIDTH = 1e9
"""Bytes per second a checkpoint is written to storage at, all ranks together: an assumption (a
shared file system or bucket seen from one job), stated in the report; pass what you measured."""

HOST_COPY_BANDWIDTH = 25e9
"""Bytes per second of a device-to-host copy of a rank's state (pinned memory over PCIe Gen4 x16
moves about 25 GB/s): an assumption, stated in the report."""


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the failure plan starts from (the ``plan`` flags)."""

    failure_rate: float = DEFAULT_FAILURE_RATE
    """Failures per GPU-hour."""
    restart_seconds: float = DEFAULT_RESTART_SECONDS
    """Seconds from a failure to the process groups up again (detection and restart); the
    checkpoint's reload is predicted on top."""
    save_seconds: float | None = None
    """Measured seconds one storage checkpoint blocks training (None: predicted from the bytes)."""
    storage_bandwidth: float = DEFAULT_STORAGE_BANDWIDTH
    """Bytes per second of a storage checkpoint, all ranks together."""

    def check(self) -> None:
        """Raise ValueError naming the flag when a figure is out of range."""
        for flag, value, positive in (
            ("--failure-rate", self.failure_rate, True),
            ("--restart-seconds", self.restart_seconds, False),
            ("--storage-bandwidth", self.storage_bandwidth, True),
        ):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"{flag} must be a finite number {bound}, got {value}")
        if self.save_seconds is not None and not (
            math.isfinite(self.save_seconds) and self.save_seconds > 0
        ):
            raise ValueError(f"--save-seconds must be a finite number > 0, got {self.save_seconds}")


@dataclasses.dataclass(frozen=True)
class Interval:
    """One kind of checkpoint: its costs, its best interval and the goodput expected."""

    kind: str
    """``storage`` or ``memory``."""
    save_seconds: float
    """Seconds one checkpoint blocks training (delta)."""
    save_source: str
    """How ``save_seconds`` was found (measured, or the bytes and bandwidth it was predicted from)."""
    restart_seconds: float
    """Seconds from a failure to training again (R): the restart plus ``reload_seconds``."""
    reload_seconds: float
    """The reload part of R, predicted: the whole checkpoint read from storage, or a rank's shard
    copied back from host memory."""
    young_seconds: float
    """Young's interval sqrt(2 delta M), seconds of training between checkpoints."""
    daly_seconds: float
    """Daly's higher-order interval, seconds of training between checkpoints."""
    steps: int
    """Daly's interval in whole steps at the planned step time (at least 1)."""
    goodput: float
    """Expected goodput checkpointing every ``steps`` steps."""
    configured_steps: int | None
    """The spec's interval (None: not set, or 0 = none but the last)."""
    configured_goodput: float | None
    """Expected goodput at the spec's interval (None: no interval set)."""


@dataclasses.dataclass(frozen=True)
class FailurePlan:
    """A job's failures and what checkpoints save of its time."""

    failure_rate: float
    """Failures per GPU-hour assumed."""
    gpus: int
    """GPUs of the job (its world size)."""
    mtbf_seconds: float
    """The job's mean time between failures: 3600 / (rate x gpus)."""
    step_seconds: float
    """Planned step time the intervals are counted in."""
    storage: Interval
    """Checkpoints to storage (``checkpoint.intervalSteps``)."""
    memory: Interval
    """Checkpoints to host memory and a peer (``checkpoint.inMemory``)."""
    source: str = FAILURE_RATE_SOURCE
    """Where the failure rate comes from (the default's publication, or ``--failure-rate``)."""


def mtbf_seconds(failure_rate: float, gpus: int) -> float:
    """Mean seconds between failures of a job of ``gpus`` GPUs at ``failure_rate`` per GPU-hour."""
    if failure_rate <= 0 or gpus < 1:
        raise ValueError(f"need a positive failure rate and GPU count, got {failure_rate}, {gpus}")
    return 3600.0 / (failure_rate * gpus)


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum: sqrt(2 delta M) seconds of work between checkpoints."""
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37), seconds of work between checkpoints.

    ``sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta`` for ``delta < 2M``,
    else ``M``.  It reduces to Young's ``sqrt(2 delta M)`` as ``delta / M`` goes to 0.
    """
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_goodput(interval: float, delta: float, restart: float, mtbf: float) -> float:
    """Useful over wall time with ``interval`` seconds of work between checkpoints (Daly's model)."""
    if interval <= 0:
        return 0.0
    exponent = (interval + delta) / mtbf + restart / mtbf
    if exponent > 700:  # e^700 overflows soon after: nothing is ever finished
        return 0.0
    wall = mtbf * math.exp(restart / mtbf) * math.expm1((interval + delta) / mtbf)
    return interval / wall


def plan_interval(
    kind: str,
    delta: float,
    save_source: str,
    restart: float,
    *,
    reload: float,
    least_seconds: float = 0.0,
    mtbf: float,
    step_seconds: float,
    configured_steps: int | None,
) -> Interval:
    """The best interval of one kind of checkpoint, in seconds and in whole steps (at least one,
    and at least ``least_seconds``)."""
    best = daly_interval(delta, mtbf)
    steps = max(1, round(best / step_seconds), math.ceil(least_seconds / step_seconds))
    configured = configured_steps if configured_steps else None
    return Interval(
        kind=kind,
        save_seconds=delta,
        save_source=save_source,
        restart_seconds=restart + reload,
        reload_seconds=reload,
        young_seconds=young_interval(delta, mtbf),
        daly_seconds=best,
        steps=steps,
        goodput=expected_goodput(steps * step_seconds, delta, restart + reload, mtbf),
        configured_steps=configured,
        configured_goodput=(
            expected_goodput(configured * step_seconds, delta, restart + reload, mtbf)
            if configured
            else None
        ),
    )


@dataclasses.dataclass(frozen=True)
class JobState:
    """What the planner knows of a job's state, for the save times."""

    gpus: int
    """World size."""
    pods: int
    """Pods of the job (a peer copy needs two)."""
    step_seconds: float
    """Planned step time."""
    state_bytes: float
    """Bytes of one whole checkpoint: every parameter's weights and optimizer state, once."""
    rank_bytes: float
    """Bytes of the largest rank's shard of it (what one rank copies to host and to its peer)."""
    nic_bandwidth: float
    """Bytes per second between pods (the peer copy)."""
    storage_interval_steps: int
    """``checkpoint.intervalSteps`` (0: only at the end)."""
    memory_interval_steps: int | None
    """``checkpoint.inMemory.intervalSteps`` (None or 0: off)."""
    async_save: bool = True
    """``checkpoint.asyncSave``: a save blocks only for the host copy, the write runs behind."""


def storage_save(state: JobState, assumed: Assumptions) -> tuple[float, str, float]:
    """(seconds a storage checkpoint blocks training, how that was found, the least seconds
    between two: an asynchronous write must finish before the next save starts)."""
    write = state.state_bytes / assumed.storage_bandwidth
    written = (
        f"{state.state_bytes / 2**30:.2f} GiB of weights and optimizer state at "
        f"{assumed.storage_bandwidth / 1e9:g} GB/s (--storage-bandwidth)"
    )
    if assumed.save_seconds is not None:
        return assumed.save_seconds, "measured (--save-seconds)", 0.0
    if not state.async_save:
        return write, f"predicted: {written}", 0.0
    copy = state.rank_bytes / HOST_COPY_BANDWIDTH
    return (
        copy,
        f"predicted: asyncSave blocks for the host copy of {state.rank_bytes / 2**30:.2f} GiB per "
        f"rank at {HOST_COPY_BANDWIDTH / 1e9:g} GB/s; the write of {written} takes "
        f"{write:.3g} s behind it, the least interval",
        write,
    )


def plan_failures(state: JobState, assumed: Assumptions) -> FailurePlan:
    """Expected goodput and best checkpoint intervals of a job under ``assumed`` failures."""
    assumed.check()
    mtbf = mtbf_seconds(assumed.failure_rate, state.gpus)
    storage_delta, storage_source, least = storage_save(state, assumed)
    peer = state.pods >= 2
    host = state.rank_bytes / HOST_COPY_BANDWIDTH
    transfer = state.rank_bytes / state.nic_bandwidth if peer else 0.0
    memory_source = (
        f"predicted: {state.rank_bytes / 2**30:.2f} GiB per rank to host at "
        f"{HOST_COPY_BANDWIDTH / 1e9:g} GB/s"
        + (
            f" + to a peer pod at {state.nic_bandwidth / 1e9:g} GB/s"
            if peer
            else " (one pod: no peer copy)"
        )
    )
    return FailurePlan(
        failure_rate=assumed.failure_rate,
        source=(
            FAILURE_RATE_SOURCE
            if assumed.failure_rate == DEFAULT_FAILURE_RATE
            else "--failure-rate"
        ),
        gpus=state.gpus,
        mtbf_seconds=mtbf,
        step_seconds=state.step_seconds,
        storage=plan_interval(
            "storage",
            storage_delta,
            storage_source,
            assumed.restart_seconds,
            reload=state.state_bytes / assumed.storage_bandwidth,
            least_seconds=least,
            mtbf=mtbf,
            step_seconds=state.step_seconds,
            configured_steps=state.storage_interval_steps,
        ),
        memory=plan_interval(
            "memory",
            host + transfer,
            memory_source,
            assumed.restart_seconds,
            reload=host,
            mtbf=mtbf,
            step_seconds=state.step_seconds,
            configured_steps=state.memory_interval_steps,
        ),
    )
