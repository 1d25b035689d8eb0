"""Exit codes of a trainer rank and of ``meshtrain run``.

They are the contract between the trainer and the operator's failure policy
(``meshtrain.operator.policy.failure``): a permanent code fails the job at once,
any other restarts the gang from its last checkpoint.
"""

from __future__ import annotations

import json
import signal

SPEC = 2
"""The TrainingJob is invalid; permanent, restarting cannot help."""
DATA = 3
"""The dataset is missing or unusable."""
CHECKPOINT = 4
"""A checkpoint cannot be loaded (corrupt, foreign, another model shape) or saved (any error, on any
rank: every rank exits with it), or another live writer holds the job's checkpoint directory."""
LOSS_GUARD = 5
"""The loss guard skipped ``training.lossGuard.maxConsecutiveSkips`` updates in a row; permanent: a
restart would replay the same batches from the same checkpoint (the last good one is kept)."""
GANG_RESTART = 75
"""In-place recovery is refused or exhausted (``runPolicy.recovery.inPlaceLimit`` reached, a rank did
not rejoin within ``rejoinTimeoutSeconds``, pod 0's rendezvous store is gone): the supervisor exits
with it and the operator rebuilds the whole gang at once (counted against ``backoffLimit``). The
kubelet never restarts a container in place on it (75 is BSD's EX_TEMPFAIL: retryable, elsewhere)."""
FENCED = 76
"""The pod's rank slot was taken by another pod (a replacement the operator created for it while
it was thought lost; ``MESHTRAIN_POD_UID`` registered in the rendezvous store): its supervisor
stops its workers and exits with it, so a slot never has two live holders.  Not restarted in
place; the operator has already superseded the pod."""
DEVICE_ERROR = 78
"""A supervised rank's GPU failed under it (an uncorrectable ECC or NVLink error:
``meshtrain.trainer.recovery.device_fault``): a worker's code, never a pod's.  Its supervisor
recovers it in place like any failed rank, and counts it against that GPU."""
DEVICE_SUSPECT = 79
"""The same GPU of the pod failed with :data:`DEVICE_ERROR` twice within an hour, or once with
:data:`DEVICE_LOST`: its supervisor takes the GPU (or its node) for bad, stops its ranks and
exits with it.  The operator treats the pod as lost by its node: replaced alone on another node
while the other pods wait at the round, or the gang rebuilt without the node, which
``status.excludedNodes`` names at once either way (a disruption: not counted against
``backoffLimit``).  The kubelet never restarts a container in place on it."""
DEVICE_SUSPECT_WINDOW_S = 3600.0
"""Two device errors within this long on one GPU, or on one node across the job's pods and gangs,
take it for bad (:data:`DEVICE_SUSPECT`): a healthy GPU raises one about once in months."""
DEVICE_ERROR_CAUSE = f"exit {DEVICE_ERROR}"
"""The ``cause`` of a recovery record whose rank's GPU failed (the supervisor's words for 78)."""
DEVICE_ERROR_AT_ENV = "MESHTRAIN_DEVICE_ERROR_AT"
"""Set by the operator on a pod placed on a node where one of the job's GPUs failed within
:data:`DEVICE_SUSPECT_WINDOW_S`: the unix time of the newest such error (``status.deviceErrors``).
Its supervisor counts it as the first strike of the node, which no gang rebuild forgets."""
DEVICE_LOST = 80
"""A supervised rank's GPU is gone (NVML's "GPU is lost", the kernel log's "fallen off the bus"): a
worker's code, never a pod's.  Such a GPU does not come back without a reset of the device or the
node, so its supervisor takes it for bad at the first failure (in-place recovery on or off)
instead of replaying a step on it."""
STOPPED = 128 + signal.SIGTERM
"""A rank stopped on a signal, after saving its last step when the grace allowed; never 0, so a
stopped pod does not read as finished, and never read as the trainer giving up (75)."""
INTERRUPTED = 128 + signal.SIGINT
"""``meshtrain run`` was interrupted (Ctrl-C or SIGTERM) and stopped its ranks."""
PERMANENT: dict[int, str] = {
    SPEC: "the trainer rejected its configuration",
    DATA: "the dataset is missing or unusable",
    CHECKPOINT: "the checkpoint cannot be loaded or saved, or another job writes its directory",
    LOSS_GUARD: "the loss guard stopped training after too many skipped updates in a row "
    "(training.lossGuard; the last good checkpoint is kept)",
    126: "the container command is not executable",
    127: "the container command was not found in the image",
}
"""Exit codes after which restarting the gang cannot help, and what each means."""

CONTAINER_DIED: dict[int, str] = {
    1: "an uncaught error ended the supervisor (Python's code for an unhandled exception)",
    128 + signal.SIGILL: "killed by SIGILL (an illegal instruction in native code)",
    128
    + signal.SIGABRT: "killed by SIGABRT (native code aborted: a failed CUDA, NCCL or C++ check)",
    128 + signal.SIGBUS: "killed by SIGBUS (a bus error: often /dev/shm exhausted)",
    128 + signal.SIGFPE: "killed by SIGFPE (an arithmetic fault in native code)",
    128 + signal.SIGKILL: "killed by SIGKILL (a kill -9, the runtime, or the OOM killer)",
    128 + signal.SIGSEGV: "killed by SIGSEGV (a segmentation fault in native code)",
}
"""The trainer container's exit codes that mean "this container died" while its pod and node are
fine: the kubelet restarts the container in place on them (``restartPolicyRules``, built-in
trainer with ``runPolicy.recovery.inPlace``).  Never 0 (done), a :data:`PERMANENT` code, or
:data:`GANG_RESTART`, :data:`STOPPED` (143: the pod is being stopped; its rank saved) and
:data:`INTERRUPTED`: those end the container for good and the operator decides.  An OOM kill
(137, reason ``OOMKilled``) is restarted too, but the operator rebuilds the gang on it (the same
step would run out of memory again), counted against ``backoffLimit`` as before."""

MESSAGE_LIMIT = 3000
"""Characters of the trainer's message kept in a failure report (the kubelet keeps 4096 bytes)."""


MAX_DEVICE_ERROR_RANKS = 64
"""Ranks a failure report lists under ``deviceErrorRanks``."""


def failure_report(code: int, message: str, device_error_ranks: tuple[int, ...] = ()) -> str:
    """The termination message a rank leaves when it exits with ``code``.

    torchrun exits 1 whatever code a worker exits with, so the pod's exit code
    loses the class; the kubelet still reports this file's content as the
    container's ``state.terminated.message``, which the operator reads back
    with :func:`read_failure_report`.  ``device_error_ranks``: the ranks whose GPU failed
    (:data:`DEVICE_ERROR`) just before the pod left, for the operator's memory of its node
    (:func:`reported_device_error_ranks`).
    """
    document: dict[str, object] = {"exitCode": code, "message": message[-MESSAGE_LIMIT:]}
    if device_error_ranks:
        document["deviceErrorRanks"] = list(device_error_ranks[:MAX_DEVICE_ERROR_RANKS])
    return json.dumps(document) + "\n"


def reported_device_error_ranks(text: str | None) -> tuple[int, ...]:
    """The ranks a :func:`failure_report` says failed with a device error (none when it says
    none, or is not one)."""
    try:
        document = json.loads(text or "")
    except ValueError:
        return ()
    ranks = document.get("deviceErrorRanks") if isinstance(document, dict) else None
    if not isinstance(ranks, list):
        return ()
    valid = (r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r >= 0)
    return tuple(valid)[:MAX_DEVICE_ERROR_RANKS]


def read_failure_report(text: str | None) -> tuple[int, str] | None:
    """(exit code, message) of a termination message written by :func:`failure_report`, else None."""
    try:
        document = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(document, dict) or not isinstance(document.get("exitCode"), int):
        return None
    return document["exitCode"], str(document.get("message") or "")
