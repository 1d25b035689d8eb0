"""Step time on a CPU host whose cores the job's ranks share: CPU work over the cores available.

On a GPU every rank owns its device; on a CPU host (``meshtrain run``, gloo)
the ranks and everything else running there share a few cores, and the
Linux scheduler gives the cores to whichever threads are runnable.  A rank
waiting in the bubble or in a collective needs no core, so the others use
it: pricing every rank at ``cores / ranks`` of a core *and* adding its waits
counts the cores twice.  Two bounds hold instead:

* **work**: the step cannot end before the cores have done every rank's CPU
  seconds — compute at the block's FLOPs per CPU second, the per-operation
  cost, the CPU each collective costs its members, the optimizer — so
  ``step >= sum over ranks of CPU seconds / available cores``;
* **dependencies**: nor before the schedule's critical path (pipeline fill
  and drain, collectives, the exposed reduction, the optimizer) with each
  rank running at the cores it could have alone
  (``min(threads per rank, available cores)``).

The step is the larger.  Every figure is CPU time measured by
``--calibrate`` (load-independent); the one figure that depends on other
tenants is the cores available to the job (``Profile.available_cores``, what
the job's ranks received while all computed at calibration; a caller who
knows better replaces it).  Pure.
"""

from __future__ import annotations

import dataclasses

from meshtrain.planner import profiles


def ring_steps(op: str, members: int) -> int:
    """Message steps of one call: ``2(n-1)`` for all-reduce, 1 for a send, ``n-1`` otherwise."""
    if op == "all_reduce":
        return 2 * (members - 1)
    return 1 if op == "send" else members - 1


def bus_factor(op: str, members: int) -> float:
    """Bus bytes per payload byte (nccl-tests): ``2(n-1)/n`` all-reduce, 1 send, ``(n-1)/n`` otherwise."""
    if op == "all_reduce":
        return 2 * (members - 1) / members
    return 1.0 if op == "send" else (members - 1) / members


def cpu_cost_fit(fit: profiles.CollectiveFit) -> profiles.CollectiveFit:
    """A fit whose ring formula gives a member's CPU seconds: ``calls x cpu_call + payload / cpu_bandwidth``.

    Unmeasured CPU figures keep the wall-time fit (a member may spend the
    whole call on a core: an upper bound).
    """
    if fit.cpu_call_seconds <= 0 or fit.cpu_bandwidth <= 0:
        return fit
    return dataclasses.replace(
        fit,
        alpha=fit.cpu_call_seconds / ring_steps(fit.op, fit.members),
        bandwidth=fit.cpu_bandwidth * bus_factor(fit.op, fit.members),
    )


def cpu_work_profile(profile: profiles.Profile) -> profiles.Profile:
    """``profile`` with CPU-second figures in place of wall-time ones: operations, collectives."""
    return dataclasses.replace(
        profile,
        op_overhead=profile.core_op_overhead or profile.op_overhead,
        collectives=tuple(cpu_cost_fit(f) for f in profile.collectives),
    )


def available_cores(profile: profiles.Profile) -> float:
    """Cores the job's ranks can use together: measured at calibration, else all of them."""
    measured = profile.available_cores
    return min(measured, float(profile.cores)) if measured > 0 else float(profile.cores)


def threads_per_rank(profile: profiles.Profile, ranks: int) -> int:
    """Threads each rank runs: ``cores // ranks``, at least one (as ``meshtrain run`` sets ``OMP_NUM_THREADS``)."""
    return max(1, profile.cores // max(1, ranks))


def rank_speed(profile: profiles.Profile, ranks: int) -> float:
    """Cores one rank runs on when it is the one runnable: its threads, at most the available cores."""
    return min(float(threads_per_rank(profile, ranks)), available_cores(profile))
