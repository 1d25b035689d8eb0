"""A TrainingJob spec as a placement request: the bridge from :mod:`meshtrain.api.spec` to placement.

The bytes per step placement weighs come from the planner's communication model
(:func:`meshtrain.planner.comm.placement_traffic`), the one ``meshtrain plan`` reports and tests
hold equal to the bytes the trainer measures; the context ring's from
:func:`meshtrain.planner.context.placement_bytes`.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.placement import values
from meshtrain.planner import comm, context, precision


def nvlink_domain_label(job: api_spec.TrainingJobSpec) -> str | None:
    """The node label naming a pod's NVLink domain: ``topology.nvlinkDomainLabel``; for a DRA job
    without one, the clique its devices report (``DEVICE_CLIQUE_LABEL``, the node is the domain
    where they report none)."""
    label = job.topology.nvlink_domain_label
    if label is None and job.resources.dra is not None:
        return values.DEVICE_CLIQUE_LABEL
    return label


def request_from_spec(
    job: api_spec.TrainingJobSpec, held: frozenset[str] = frozenset()
) -> values.PlacementRequest:
    """The placement request of a (validated) TrainingJob spec.

    Placement happens on a GPU cluster, so ``precision: auto`` is priced as bf16
    autocast (fp32 master weights and gradients, fp32 residual stream between
    stages), which is how the trainer runs there.  A ``spec.topology.levels`` entry naming the
    NVLink-domain label is no fabric level: it says what the NVLink domain requires.  ``held``:
    labels of preferred levels whose ``waitSeconds`` still runs (``topology_hold``), required of
    the whole job for this plan.
    """
    trained_in = "fp32" if job.training.precision == "fp32" else "bf16"
    scheme = precision.scheme_for(trained_in)
    dp_bytes, pp_bytes = comm.placement_traffic(job, scheme)
    domain = nvlink_domain_label(job)
    levels = [
        values.FabricLevel(
            label=level.label,
            required=level.mode == "required" or level.label in held,
            held=level.mode != "required" and level.label in held,
            scope=level.scope,
        )
        for level in job.topology.levels
    ]
    return values.PlacementRequest(
        gpus_per_node=job.resources.gpus_per_node,
        layout=job.parallelism.layout,
        dp_bytes_per_step=dp_bytes,
        pp_bytes_per_step=pp_bytes,
        cp_bytes_per_step=context.placement_bytes(job, scheme),
        nvlink_domain_label=domain,
        levels=tuple(level for level in levels if level.label != domain),
        node_selector=dict(job.resources.node_selector),
        nvlink_domain_level=next((level for level in levels if level.label == domain), None),
    )
