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
STOPPED = 128 + signal.SIGTERM
"""A rank stopped on a signal after saving its last step; never 0, so a stopped pod does not read as finished."""
INTERRUPTED = 128 + signal.SIGINT
"""``meshtrain run`` was interrupted (Ctrl-C or SIGTERM) and stopped its ranks."""
GANG_RESTART = 75
"""The supervisor gave up recovering in place (``runPolicy.recovery.inPlaceLimit`` reached, a rejoin
timed out, the rendezvous store is gone, or in-place recovery is off): rebuild the gang; retryable."""

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

MESSAGE_LIMIT = 3000
"""Characters of the trainer's message kept in a failure report (the kubelet keeps 4096 bytes)."""


def failure_report(code: int, message: str) -> str:
    """The termination message a rank leaves when it exits with ``code``.

    torchrun exits 1 whatever code a worker exits with, so the pod's exit code
    loses the class; the kubelet still reports this file's content as the
    container's ``state.terminated.message``, which the operator reads back
    with :func:`read_failure_report`.
    """
    return json.dumps({"exitCode": code, "message": message[-MESSAGE_LIMIT:]}) + "\n"


def read_failure_report(text: str | None) -> tuple[int, str] | None:
    """(exit code, message) of a termination message written by :func:`failure_report`, else None."""
    try:
        document = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(document, dict) or not isinstance(document.get("exitCode"), int):
        return None
    return document["exitCode"], str(document.get("message") or "")
