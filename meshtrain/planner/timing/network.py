"""Time on the network: the link each process group uses and the alpha-beta price of a collective on it.

Hockney's alpha-beta model with the ring algorithms as analysed by Patarasuk and Yuan 2009 and
Thakur et al. 2005 (the formulas are on the functions below).  A group inside one NVLink domain
uses the domain's link (the profile's ``nvlink_*``), any other the fabric's (``nic_*``); a
calibrated profile's fits per op and group size replace the intra-host link's figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, profiles


@dataclasses.dataclass(frozen=True)
class Link:
    """A network path as the alpha-beta model sees it."""

    name: str
    """``nvlink`` (inside an NVLink domain) or ``fabric`` (between domains)."""
    bandwidth: float
    """Bytes/s per direction per rank (beta = 1 / bandwidth)."""
    latency: float
    """Seconds per message step (alpha)."""
    fits: tuple[profiles.CollectiveFit, ...] = ()
    """Measured alpha/beta by op and group size; they replace ``bandwidth`` and ``latency`` where present."""

    def for_op(self, op: str, members: int) -> Link:
        """This link as ``op`` over ``members`` ranks sees it (the closest measured fit, if any)."""
        fits = [f for f in self.fits if f.op == op]
        if not fits:
            return self
        best = min(fits, key=lambda f: (abs(f.members - members), -f.members))
        return Link(self.name, best.bandwidth, best.alpha)

    def preferring(self, fits: tuple[profiles.CollectiveFit, ...]) -> Link:
        """This link with ``fits`` in place of its own for the ops and group sizes they cover."""
        covered = {(f.op, f.members) for f in fits}
        return dataclasses.replace(
            self, fits=fits + tuple(f for f in self.fits if (f.op, f.members) not in covered)
        )


def links(
    profile: profiles.Profile, fits: tuple[profiles.CollectiveFit, ...] | None = None
) -> dict[str, Link]:
    """The two link kinds of a profile; the intra-host one carries ``fits`` (default: the calibration's)."""
    return {
        "nvlink": Link(
            "nvlink",
            profile.nvlink_bandwidth,
            profile.nvlink_latency,
            profile.collectives if fits is None else fits,
        ),
        "fabric": Link("fabric", profile.nic_bandwidth, profile.nic_latency),
    }


def axis_links(
    job: api_spec.TrainingJobSpec, kinds: dict[str, Link], pod_domains: Sequence[str] | None
) -> dict[str, Link]:
    """The link of each group axis (``dp``, ``tp``, ``pp``; ``cp`` with context), of ``kinds`` (:func:`links`), by :func:`group_links`."""
    return {axis: kinds[kind] for axis, kind in group_links(job, pod_domains).items()}


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


def ring_allreduce_seconds(nbytes: float, members: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce: ``2 (n-1) alpha`` per call plus ``2 (n-1)/n x M / B``."""
    if members <= 1:
        return 0.0
    n = members
    return calls * 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def ring_gather_seconds(nbytes: float, members: int, link: Link, calls: int = 1) -> float:
    """Ring all-gather or reduce-scatter of a full buffer of ``nbytes``: ``(n-1) alpha + (n-1)/n M / B``."""
    if members <= 1:
        return 0.0
    n = members
    return calls * (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def send_seconds(nbytes: float, link: Link, calls: int = 1) -> float:
    """Point-to-point messages: ``alpha`` per call plus ``M / B``."""
    return calls * link.latency + nbytes / link.bandwidth


def collective_seconds(collective: comm.Collective, link: Link) -> float:
    """Time of one :class:`~.comm.Collective` entry on ``link``."""
    link = link.for_op(collective.op, collective.members)
    if collective.op == "all_reduce":
        return ring_allreduce_seconds(collective.nbytes, collective.members, link, collective.calls)
    if collective.op in ("all_gather", "reduce_scatter"):
        return ring_gather_seconds(collective.nbytes, collective.members, link, collective.calls)
    return send_seconds(collective.nbytes, link, collective.calls)


def hierarchical_leg(
    job: api_spec.TrainingJobSpec, collective: comm.Collective, group_link: Link, nvlink: Link
) -> tuple[comm.Collective, Link]:
    """The members and link a collective really runs over.

    Under ``allReduce: hierarchical`` a dp reduce-scatter or all-gather runs
    among the ``k`` ranks of a node (NVLink) and the dp all-reduce among the
    ``d / k`` nodes on the dp group's link; everything else is unchanged.
    """
    par = job.parallelism
    if par.all_reduce != "hierarchical" or collective.group != "dp" or collective.after_backward:
        return collective, group_link
    k = comm.dp_ranks_per_node(job)
    if collective.op in ("reduce_scatter", "all_gather"):
        return dataclasses.replace(collective, members=k), nvlink
    return dataclasses.replace(collective, members=max(par.data // k, 1)), group_link


def group_links(
    job: api_spec.TrainingJobSpec, pod_domains: Sequence[str] | None = None
) -> dict[str, str]:
    """Which link kind each group axis uses: ``nvlink`` if every group of the axis stays in one domain.

    ``pod_domains[i]`` names the NVLink domain of pod ``i`` (its node, or its
    clique); without it every pod is its own domain (one node per pod).
    """
    grid = job.parallelism.layout
    per_node = job.resources.gpus_per_node
    domains = (
        list(pod_domains) if pod_domains is not None else [f"pod-{i}" for i in range(job.pods)]
    )
    spans = {
        axis: any(
            len({domains[grid.pod_of(r, per_node)] for r in group}) > 1
            for group in grid.all_groups(axis)
        )
        for axis in ("dp_cp", "tp", "pp", "cp")
    }
    # gradients are summed over data x context ranks (the dp_cp groups): the planner's "dp" axis
    spans["dp"] = spans.pop("dp_cp")
    axes = ("dp", "tp", "pp", "cp") if grid.context > 1 else ("dp", "tp", "pp")
    return {axis: "fabric" if spans[axis] else "nvlink" for axis in axes}
