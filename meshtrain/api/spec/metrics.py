"""``spec.metrics``: the trainer's Prometheus exporter in every pod."""

from __future__ import annotations

from pydantic import Field

from meshtrain.api.spec import base

RENDEZVOUS_PORT = 29500
"""torchrun's rendezvous port in every pod (``meshtrain.operator.policy.naming.MASTER_PORT``),
which the exporters' ports must leave free."""


class Metrics(base.SpecModel):
    """The trainer's Prometheus exporter."""

    port: int = Field(
        9400, ge=1024, le=65535, description="Port of the Prometheus exporter in every pod."
    )
    peak_flops: float | None = Field(
        None,
        gt=0,
        description="Peak FLOP/s per device for MFU; empty uses the detected GPU's bf16 peak (or a measured CPU figure).",
    )
