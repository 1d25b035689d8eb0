"""The torchrun tier of in-place recovery, for a custom trainer (``spec.trainer.type: custom``).

A custom trainer keeps its own command (``[torchrun, /app/train.py]``).  When the job opts in
(``runPolicy.recovery.torchrunElastic`` with ``inPlace`` and ``inPlaceLimit`` above 0), its command
is torchrun (:func:`is_torchrun`) and the gang has at most :data:`MAX_PODS` pods, the operator makes that torchrun
elastic through torchrun's own environment defaults: every torchrun flag reads ``PET_<FLAG>``
when the command does not give it, so the user's command stays as written and a flag it gives
wins.  The gang meets in a c10d rendezvous whose store pod 0's agent hosts on the same
``MASTER_ADDR:MASTER_PORT`` as before, under a rendezvous id per gang attempt, and each agent
restarts its workers up to ``inPlaceLimit`` times.  A worker that fails makes its agent stop its
workers and open a new rendezvous round; the other agents see the waiting node and restart
theirs: every worker process starts again (a cold Python and torch start) and resumes from the
program's own checkpoint, and no pod is deleted.  Past the limit torchrun exits 1 and the
operator rebuilds the gang, as before.  Pure: environment only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import base
from meshtrain.operator.policy import identity, naming

ENV_BACKEND = "PET_RDZV_BACKEND"
ENV_ENDPOINT = "PET_RDZV_ENDPOINT"
ENV_ID = "PET_RDZV_ID"
ENV_CONF = "PET_RDZV_CONF"
ENV_MAX_RESTARTS = "PET_MAX_RESTARTS"
ENV_OWN_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""1: the workers' process groups meet in a store rank 0's worker hosts on a new port each round,
not in the agents' rendezvous store, whose unprefixed keys outlive a round (torch 2.15's
``env://`` on the agent's store adds no per-round prefix: a restarted round read the previous
round's gloo addresses and failed to connect, measured by tests/trainer/test_torchrun_tier.py)."""

BACKEND = "c10d"
"""torchrun's rendezvous whose rounds outlive a worker group (``static`` has one round only)."""
HOST_POD = 0
"""The pod whose agent hosts the rendezvous store (``MASTER_ADDR`` names it)."""
READ_TIMEOUT_S = 600
"""How long an agent waits for the store (pod 0's agent may start later, after its image pull):
the static rendezvous's own wait, which a custom trainer had before this tier."""


MAX_PODS = 10
"""Largest gang whose torchrun node ranks equal the pod indexes.  c10d's rendezvous ranks its
agents by their sorted ``_NodeDesc(addr=socket.getfqdn(), pid, local_id)``
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, ``_mark_rendezvous_complete``), not
by join order nor ``--node-rank``; the pods' FQDNs are ``<job>-r<attempt>-<index>.<service>...``,
which sort as 0, 1, 10, 2, ... from 11 pods up: node rank != pod index would permute the ranks
across the placement plan's NVLink domains and leaves.  Larger gangs keep the gang rebuild."""
TORCHRUN_MODULE = "torch.distributed.run"


def is_torchrun(command: Sequence[str]) -> bool:
    """Whether ``command`` starts torchrun: ``torchrun ...`` (any directory) or
    ``python[3[.N]] -m torch.distributed.run ...``."""
    if not command:
        return False
    program = command[0].rsplit("/", 1)[-1]
    if program == "torchrun":
        return True
    return re.fullmatch(r"python(\d+(\.\d+)?)?", program) is not None and list(command[1:3]) == [
        "-m",
        TORCHRUN_MODULE,
    ]


def enabled(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the custom trainer's torchrun restarts its workers in place: opted in
    (``torchrunElastic``), ``inPlace``, a budget above 0, a torchrun command and at most
    :data:`MAX_PODS` pods (the built-in trainer has its supervisor instead, ``kubelet_tier``)."""
    recovery = spec.run_policy.recovery
    return (
        spec.trainer.type == "custom"
        and recovery.torchrun_elastic
        and recovery.in_place
        and recovery.in_place_limit > 0
        and is_torchrun(spec.trainer.command)
        and spec.pods <= MAX_PODS
    )


IGNORED = "TorchrunElasticIgnored"
"""Reason of the Warning Event of a gang whose ``torchrunElastic`` cannot apply (:func:`ignored`)."""


def ignored(spec: api_spec.TrainingJobSpec) -> str | None:
    """Why a job that asks for the tier (``torchrunElastic``) gets the gang rebuild instead, for a
    Warning Event; None when the tier applies, was not asked for, or ``inPlace``/``inPlaceLimit``
    turn in-place restarts off (the job's own choice)."""
    recovery = spec.run_policy.recovery
    if not recovery.torchrun_elastic or enabled(spec):
        return None
    field = "runPolicy.recovery.torchrunElastic"
    if spec.trainer.type != "custom":
        return f"{field} is for trainer.type custom; the built-in trainer has its supervisor"
    if not is_torchrun(spec.trainer.command):
        return (
            f"{field} is ignored: trainer.command[0]={base.quoted(spec.trainer.command[0])} does "
            f"not start torchrun (torchrun ... or python -m {TORCHRUN_MODULE} ...); failures "
            "rebuild the gang"
        )
    if spec.pods > MAX_PODS:
        return (
            f"{field} is ignored: the gang has {spec.pods} pods, more than {MAX_PODS} (torchrun's "
            "c10d ranks nodes by sorted host name, which then differs from the pod index); "
            "failures rebuild the gang"
        )
    return None


def rendezvous_id(job: identity.JobRef, attempt: int) -> str:
    """torchrun's ``--rdzv-id``: the job's UID and the gang attempt (a rebuilt gang never meets
    the agents of the one it replaces)."""
    return f"{job.uid or job.name}-{attempt}"


def elastic_env(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec, attempt: int, index: int
) -> dict[str, str | int]:
    """torchrun's flags for pod ``index`` of gang ``attempt`` as ``PET_*`` variables: none when
    not :func:`enabled` (torchrun's static rendezvous, no restarts, as before)."""
    if not enabled(spec):
        return {}
    host = naming.master_addr(job.name, job.namespace, attempt)
    is_host = int(index == HOST_POD)  # never guessed from hostnames: one store per gang
    return {
        ENV_BACKEND: BACKEND,
        ENV_ENDPOINT: f"{host}:{naming.MASTER_PORT}",
        ENV_ID: rendezvous_id(job, attempt),
        ENV_CONF: f"is_host={is_host},read_timeout={READ_TIMEOUT_S}",
        ENV_MAX_RESTARTS: spec.run_policy.recovery.in_place_limit,
        ENV_OWN_STORE: 1,
    }
