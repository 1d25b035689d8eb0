"""A fabric level required per pipeline stage (``scope: stage``): the domain tree in whole stages.

Stage k of a gang is its run of pods ``[k*s, (k+1)*s)`` (``s`` = :attr:`~.values.PlacementRequest.stage_pods`).
:func:`whole_stages` cuts every domain of the stage-scoped level down to the whole stages it
holds and sums them upwards, so :func:`meshtrain.placement.plan`'s fill, which splits a run above
that level only among children by their capacity, hands each domain of the level whole stages
(every capacity above it a multiple of ``s``).  :func:`unsatisfiable` says why none fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtrain.placement import topology, values


def whole_stages(domain: topology.Domain, depth: int, stage: int) -> topology.Domain | None:
    """``domain``'s tree with each domain at ``depth`` holding only whole stages of ``stage`` pods
    (its free slots rounded down to a multiple), domains holding none dropped; None if none is left.

    Below ``depth`` the tree is the same (a stage is laid out there as any run of pods).
    """
    if domain.depth == depth:
        cap = domain.cap // stage * stage
        if cap == 0:
            return None
        if cap == domain.cap:
            return domain
        return topology.Domain(domain.value, domain.depth, domain.children, cap, domain.node)
    kept = [whole_stages(child, depth, stage) for child in domain.children]
    children = [child for child in kept if child is not None]
    if not children:
        return None
    return topology.Domain(
        domain.value, domain.depth, children, sum(child.cap for child in children), None
    )


def _at(root: topology.Domain, depth: int) -> list[topology.Domain]:
    """The domains at ``depth`` (the root's descendants, in tree order)."""
    frontier = [root]
    while frontier and frontier[0].depth < depth:
        frontier = [child for domain in frontier for child in domain.children]
    return frontier


def _stages_in(domain: topology.Domain, depth: int, stage: int) -> int:
    """Whole stages the domains at ``depth`` inside ``domain`` hold together."""
    return sum(inner.cap // stage for inner in _at(domain, depth))


def unsatisfiable(
    request: values.PlacementRequest,
    root: topology.Domain,
    levels: Sequence[values.FabricLevel],
    depth: int,
    job_depth: int,
) -> values.Unschedulable:
    """TopologyUnsatisfiable naming the stage-scoped level at ``depth``, the stage size in pods and
    how many stages the free domains could hold (inside the best domain of the job-scoped level
    at ``job_depth``, when it lies above)."""
    stage, count = request.stage_pods, request.layout.pipeline
    level = levels[depth - 1].label
    domains = _at(root, depth)
    held = [domain.cap // stage for domain in domains]
    need = (
        f"needs {count} pipeline stages of {stage} pods of {request.gpus_per_node} GPUs, each stage "
        f"inside one {level} domain (required per stage)"
    )
    said = (
        f"; the free {level} domains could hold {sum(held)} such stages ({len(domains)} domains "
        f"with free slots, the largest holds {max(held, default=0)}); {root.cap} free pod slots "
        "cluster-wide"
    )
    if 0 < job_depth < depth:
        outer = levels[job_depth - 1].label
        best = max(_stages_in(domain, depth, stage) for domain in _at(root, job_depth))
        why = levels[job_depth - 1].why_one_domain
        said = f", all in one {outer} domain ({why}){said}; the best {outer} domain holds {best}"
    return values.Unschedulable(reason=values.TOPOLOGY_UNSATISFIABLE, message=need + said)
