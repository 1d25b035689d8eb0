"""A machine whose ranks share a host's cores: CPU work over the cores available.

A rank waiting in the bubble or in a collective needs no core and the others use it, so pricing
each rank at ``cores / ranks`` of a core *and* adding its waits would count the cores twice.  The
step is the larger of two bounds instead (:meth:`CpuHost.bound`): all ranks' CPU seconds over the
available cores, and the critical path with each rank at the cores it could have alone
(docs/planner.md, "CPU hosts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, profiles
from meshtrain.planner.timing import (
    machine,
    network,
    pipeline_replay,
    pipeline_window,
    shared_host,
    stage_work,
)


def cpu_cost_fit(fit: profiles.CollectiveFit) -> profiles.CollectiveFit:
    """A fit whose ring formula gives a member's CPU seconds: ``calls x cpu_call + payload / cpu_bandwidth``.

    Unmeasured CPU figures keep the wall-time fit (a member may spend the
    whole call on a core: an upper bound).
    """
    if fit.cpu_call_seconds <= 0 or fit.cpu_bandwidth <= 0:
        return fit
    return dataclasses.replace(
        fit,
        alpha=fit.cpu_call_seconds / network.ring_steps(fit.op, fit.members),
        bandwidth=fit.cpu_bandwidth * network.bus_factor(fit.op, fit.members),
    )


def available_cores(profile: profiles.Profile) -> float:
    """Cores the job's ranks can use together: measured at calibration, else all of them.

    The one figure of the model that depends on other tenants; every other is CPU time, which
    does not change with the load.
    """
    measured = profile.available_cores
    return min(measured, float(profile.cores)) if measured > 0 else float(profile.cores)


def rank_speed(profile: profiles.Profile, ranks: int) -> float:
    """Cores one rank runs on when it is the one runnable: its threads, at most the available cores."""
    return min(float(shared_host.threads_per_rank(profile, ranks)), available_cores(profile))


def sharing(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> pipeline_replay.Sharing:
    """How the job's ranks share a CPU host's cores, from the cores they receive together (``available_cores``)."""
    threads = shared_host.threads_per_rank(profile, shared_host.ranks(job))
    return pipeline_replay.Sharing(available_cores(profile), threads)


@dataclasses.dataclass(frozen=True)
class CpuHost(machine.JobOnMachine):
    """Ranks sharing a host's cores, priced in CPU seconds (:class:`~.machine.Machine`).

    Every rank of the job shares the host, as ``meshtrain run`` starts them;
    the figures are the CPU seconds the profile's calibration measured.
    """

    @property
    def prices(self) -> stage_work.Prices:
        """CPU seconds: the block's FLOPs per CPU second, an operation's, each collective's per member."""
        profile = self.profile
        kinds = network.links(profile, fits=tuple(cpu_cost_fit(f) for f in profile.collectives))
        links = network.axis_links(self.job, kinds, self.pod_domains)
        # The CPU of a tensor-parallel call as the trainer's own calls cost it in calibration.
        links["tp"] = links["tp"].preferring(
            tuple(
                cpu_cost_fit(f)
                for f in profile.tp_collectives
                if f.cpu_call_seconds > 0 and f.cpu_bandwidth > 0
            )
        )
        return stage_work.Prices(
            rank_flops=profile.core_flops,
            op_seconds=profile.core_op_overhead or profile.op_overhead,
            memory_bandwidth=profile.memory_bandwidth,
            links=links,
            domain_link=kinds["nvlink"],
        )

    @property
    def speed(self) -> float:
        """Cores a rank on the critical path runs at: those it has when it is the one runnable."""
        return rank_speed(self.profile, shared_host.ranks(self.job))

    @property
    def rank_flops(self) -> float:
        """The block's FLOPs per CPU second at the rank's speed."""
        return self.profile.core_flops * self.speed

    @property
    def oversubscription(self) -> float:
        """Threads of the host's ranks over its cores (:func:`~.shared_host.oversubscription`)."""
        return shared_host.oversubscription(self.job, self.profile)

    def on_path(
        self, stage: stage_work.StageTime, stage_comm: comm.StageComm
    ) -> stage_work.StageTime:
        """CPU seconds at the rank's speed; with a core per rank, tensor-parallel calls at their wall time.

        A blocked tensor-parallel collective idles its core for its wall
        time; with more ranks than cores another rank runs meanwhile (the
        work bound covers the core).
        """
        stage = stage.scaled(1 / self.speed)
        if self.oversubscription > 1.0:
            return stage
        return dataclasses.replace(stage, tp=max(stage.tp, self._wall_tp_seconds(stage_comm)))

    def seconds_on_path(self, priced: float) -> float:
        """CPU seconds at the rank's speed."""
        return priced / self.speed

    def _wall_tp_seconds(self, stage_comm: comm.StageComm) -> float:
        """A stage's tensor-parallel collectives at the calibrated wall time of a call.

        Each one blocks its rank until every member has arrived and been
        woken: the wall time of a call that follows compute, not the CPU the
        call costs, is what the step waits; the trainer's own calls in
        calibration's step-loop run where they were timed
        (``tp_collectives``), else the micro-benchmark's.
        """
        kind = network.group_links(self.job, self.pod_domains)["tp"]
        link = network.links(self.profile)[kind].preferring(self.profile.tp_collectives)
        return sum(
            network.collective_seconds(c, link) for c in stage_comm.collectives if c.group == "tp"
        )

    def window(
        self, durations: Sequence[pipeline_window.StageDurations], send: float
    ) -> machine.Pipeline:
        """A pipeline's window replayed with the cores shared (the closed form without one, or interleaved).

        The step loop runs between a stage's actions: inside the window, and
        not compute.  Calibration measures the share of it outside every
        event (``step_loop_between_share``); the rest runs inside the
        actions, and what is left of it follows the window.  Each message
        costs its calibrated wall latency where calibration timed the
        trainer's own messages, else ``send``.
        """
        par = self.job.parallelism
        virtual = self.job.parallelism.virtual_stages
        if par.pipeline == 1 or virtual != 1:
            return machine.Pipeline(
                pipeline_window.window(par.micro_batches, durations, send, virtual),
                after_window=self._step_loop_after(0.0),
            )
        profile, speed = self.profile, self.speed
        loop = profile.rank_step_cpu_seconds
        share = min(1.0, max(0.0, profile.step_loop_between_share))
        actions = 2 * par.micro_batches
        between = loop * share / actions
        inside = loop * (1 - share) / actions
        measured = (profile.activation_message_seconds, profile.gradient_message_seconds)
        activations, gradients = (seconds if seconds > 0 else send for seconds in measured)
        replayed = pipeline_replay.replay(
            par.schedule,
            par.micro_batches,
            [
                pipeline_window.StageDurations(
                    d.forward * speed + inside, d.backward * speed + inside
                )
                for d in durations
            ],
            pipeline_replay.Messages(activations, gradients),
            sharing(self.job, profile),
            replicas=par.data * par.tensor,
            between=between,
        )
        return machine.Pipeline(
            replayed, after_window=self._step_loop_after((between + inside) * actions)
        )

    def _step_loop_after(self, inside: float) -> float:
        """Critical-path seconds of a rank's step loop after the window, ``inside`` CPU seconds of it having run within."""
        return (self.profile.rank_step_cpu_seconds - inside) / self.speed

    def bound(self, work: Sequence[stage_work.StageTime], dependencies: float) -> machine.Bound:
        """The larger of the critical path and all ranks' CPU seconds over the cores available."""
        par = self.job.parallelism
        loop = self.profile.rank_step_cpu_seconds
        rank_cpu = tuple(st.busy + st.dp + st.optimizer + loop for st in work)
        cpu_seconds = par.data * par.tensor * sum(rank_cpu)
        cores = available_cores(self.profile)
        return machine.Bound(
            step_seconds=max(dependencies, cpu_seconds / cores),
            host=shared_host.HostLoad(
                self.oversubscription, shared_host.CpuWork(cpu_seconds, cores, rank_cpu)
            ),
        )
