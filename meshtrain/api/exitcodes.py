"""Exit codes of a trainer rank and of ``meshtrain run``.

They are the contract between the trainer and the operator's failure policy
(``meshtrain.operator.failure``): a permanent code fails the job at once,
any other restarts the gang from its last checkpoint.
"""

from __future__ import annotations

import signal

SPEC = 2
"""The TrainingJob is invalid; permanent, restarting cannot help."""
DATA = 3
"""The dataset is missing or unusable."""
CHECKPOINT = 4
"""A checkpoint exists but cannot be loaded (corrupt, foreign, another model shape)."""
STOPPED = 128 + signal.SIGTERM
"""A rank stopped on a signal after saving its last step; never 0, so a stopped pod does not read as finished."""
INTERRUPTED = 128 + signal.SIGINT
"""``meshtrain run`` was interrupted (Ctrl-C or SIGTERM) and stopped its ranks."""
