"""Every exit status of the ``meshtrain`` command line, in one place (docs/planner.md links here).

A script or CI step can tell "the job does not fit" from "the file is invalid" without reading
the output.  ``meshtrain run`` passes its ranks' codes through: those are the trainer's contract
with the operator (:mod:`meshtrain.api.exitcodes`), listed in :data:`RUN`.
"""

from __future__ import annotations

from meshtrain.api import exitcodes as rank_codes

OK = 0
"""Done: the file is valid, the job fits, the run finished."""
UNEXPECTED = 1
"""An uncaught error (Python's own code for a traceback): a bug to report, never a verdict."""
INVALID = 2
"""The input is refused: an invalid TrainingJob (``validate``, ``plan``, ``run``), an unknown
profile, a malformed cluster file, an unreachable cluster, a bad option value; argparse's own
usage errors are 2 too."""
DOES_NOT_FIT = 3
"""``meshtrain plan``: the job does not fit, a pipeline stage needs more memory per device than the
profile has (the operator's memory admission would refuse it; the report says which stage)."""

UNSCHEDULABLE = 4
"""``meshtrain plan --cluster``/``--from-cluster``: the job fits in memory but the operator's
placement cannot put its gang on those nodes now (the report says why)."""
NO_LAYOUT = 5
"""``plan --search`` found no layout that passes the rules and fits (and, with a cluster, can be placed)."""

MISSING_EXTRA = 69
"""The command needs an extra that is not installed (BSD's EX_UNAVAILABLE; the message names the
``pip install 'meshtrain[EXTRA]'`` to run)."""

CODES: dict[int, str] = {
    OK: "success (for plan: the job fits)",
    UNEXPECTED: "an uncaught error (a traceback): a bug to report",
    INVALID: "invalid input: the job, a profile, a cluster file or an option",
    DOES_NOT_FIT: "plan: the job does not fit in device memory",
    UNSCHEDULABLE: "plan --cluster/--from-cluster: the gang cannot be placed on those nodes",
    NO_LAYOUT: "plan --search: no layout passes the rules and fits",
    MISSING_EXTRA: "the command needs an extra that is not installed (pip install 'meshtrain[EXTRA]')",
}
"""The command line's own codes and what each means."""

RUN: dict[int, str] = {
    rank_codes.SPEC: "run: a rank rejected its configuration",
    rank_codes.DATA: "run: the dataset is missing or unusable",
    rank_codes.CHECKPOINT: "run: a checkpoint cannot be loaded or saved",
    rank_codes.LOSS_GUARD: "run: the loss guard stopped training",
    rank_codes.INTERRUPTED: "run: interrupted (Ctrl-C or SIGTERM); the ranks saved their last step",
}
"""``meshtrain run``'s codes beyond :data:`CODES`: the failed rank's own (these and any other)."""
