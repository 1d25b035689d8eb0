"""Upper bounds on every size in a TrainingJob that drives the operator's work or memory.

One cluster-wide operator serves every tenant, so no single object may make it loop or
allocate without bound.  These numbers are the schema's ``maximum`` (rendered into the
CRD, checked by the API server) and :mod:`meshtrain.api.loading`'s, so ``kubectl apply``,
``meshtrain validate`` and ``meshtrain plan`` give one verdict.  They sit well above any
training run on record; raise one only together with a benchmark of the planning it drives.
"""

from __future__ import annotations

MAX_WORLD_SIZE = 65_536
"""GPUs (ranks) in one job: data x pipeline x tensor."""

MAX_DATA = MAX_WORLD_SIZE
"""Data-parallel degree."""

MAX_PIPELINE = 512
"""Pipeline stages."""

MAX_TENSOR = 64
"""Tensor-parallel degree (a tensor group stays inside one NVLink domain)."""
