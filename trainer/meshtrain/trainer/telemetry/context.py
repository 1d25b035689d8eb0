"""Plain values shared by the telemetry modules: who a rank is, what it holds, where a step goes.

:class:`RankIdentity` (the labels of every metric, from the operator's environment variables),
:class:`MemorySample`, and the :class:`Sink` protocol of the exporter, the progress document and
the trace.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Protocol

from meshtrain.api import layout as layout_mod
from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.telemetry import recording, stepstats

JOB_ENV = "MESHTRAIN_JOB_NAME"
"""Environment variable naming the TrainingJob (set by the operator)."""
NAMESPACE_ENV = "MESHTRAIN_NAMESPACE"
"""Environment variable naming the job's namespace (set by the operator)."""
POD_ENV = "MESHTRAIN_POD_NAME"
"""Environment variable naming the pod (downward API; falls back to HOSTNAME)."""
NODE_ENV = "MESHTRAIN_NODE_NAME"
"""Environment variable naming the node the pod runs on (downward API ``spec.nodeName``)."""


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """Who this process is: the labels on every metric it exports."""

    job: str
    """TrainingJob name."""
    namespace: str
    """Kubernetes namespace of the job."""
    pod: str
    """Pod (node slot) running this rank."""
    rank: int
    """Global rank."""
    local_rank: int
    """Rank within the pod (exporter port offset)."""
    coords: layout_mod.RankCoords
    """(pp, dp, tp) coordinates of the rank."""
    node: str = ""
    """Node running the pod (empty outside Kubernetes); only the straggler metrics carry it."""
    in_cluster: bool = False
    """Running in a pod the operator built (``KUBERNETES_SERVICE_HOST`` and the operator's
    ``MESHTRAIN_NODE_NAME`` set): Prometheus' service discovery gives ``namespace`` and ``pod``,
    so the exporter leaves them out."""

    def labels(self) -> dict[str, str]:
        """Prometheus labels: trainingjob, namespace and pod (local runs only), rank, dp, pp, tp.

        ``trainingjob`` as the operator's series name the job: ``job`` is Prometheus' own target
        label (the scrape job), which an exporter must not set; in a pod, ``namespace`` and
        ``pod`` are target labels too (exporter convention: leave them to service discovery).
        """
        where = {} if self.in_cluster else {"namespace": self.namespace, "pod": self.pod}
        return {
            "trainingjob": self.job,
            **where,
            "rank": str(self.rank),
            "dp": str(self.coords.dp),
            "pp": str(self.coords.pp),
            "tp": str(self.coords.tp),
        }

    @classmethod
    def from_env(
        cls,
        layout: layout_mod.ParallelLayout,
        rank: int,
        local_rank: int | None = None,
        env: dict[str, str] | None = None,
    ) -> RankIdentity:
        """Identity from the operator's environment variables (defaults for local runs)."""
        env = dict(os.environ) if env is None else env
        if local_rank is None:
            local_rank = int(env.get("LOCAL_RANK", rank))
        return cls(
            job=env.get(JOB_ENV) or "local",
            namespace=env.get(NAMESPACE_ENV) or env.get("POD_NAMESPACE") or "local",
            pod=env.get(POD_ENV)
            or env.get("POD_NAME")
            or env.get("HOSTNAME")
            or socket.gethostname(),
            rank=rank,
            local_rank=local_rank,
            coords=layout.coords(rank),
            node=env.get(NODE_ENV, ""),
            in_cluster=bool(env.get("KUBERNETES_SERVICE_HOST") and env.get(NODE_ENV)),
        )


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """Bytes held by this rank at the end of a step."""

    peak_allocated: int
    """CUDA max_memory_allocated on GPU; the process' peak resident set (ru_maxrss) on CPU."""
    parameters: int | None = None
    """Parameter storage of the model chunks this rank owns (None: nothing watched)."""
    gradients: int | None = None
    """Gradient storage at step end: reducer buckets (shards under ZeRO-2) or ``.grad``."""
    optimizer: int | None = None
    """Optimizer state storage (AdamW moments; this rank's shard under ZeRO-1/2)."""

    def as_dict(self) -> dict[str, int]:
        """kind -> bytes, for the kinds that were measured (the trace's ``memory_bytes``)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def components(self) -> dict[str, int]:
        """The ``component`` label values of ``meshtrain_memory_bytes`` that were measured."""
        return {k: v for k, v in self.as_dict().items() if k != "peak_allocated"}


class Sink(Protocol):
    """Where a step's summary goes."""

    def publish(
        self,
        stats: stepstats.StepStats,
        events: Sequence[recording.Event],
        start: float,
        memory: MemorySample | None,
    ) -> None:
        """One finished step; ``start`` is its perf_counter origin."""

    def checkpoint_saved(self, step: int) -> None:
        """A complete checkpoint of ``step`` exists."""

    def health(
        self,
        step: int,
        *,
        eval_loss: float | None,
        skipped: str,
        noise_scale: float | None = None,
        epoch: int | None = None,
    ) -> None:
        """After step ``step``: its validation loss (None: not evaluated), why its update was skipped ('')
        the gradient noise scale (None: not measured) and the epoch of its batch (None: not in epochs)."""

    def straggler_verdict(self, verdict: stragglers.Verdict) -> None:
        """The straggler detector's verdict after a step (the same on every rank)."""

    def close(self) -> None:
        """Release files and sockets."""
