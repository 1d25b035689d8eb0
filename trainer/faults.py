"""Fault injection for testing failure handling: ``MESHTRAIN_FAULT_INJECT=rank:step``.

:func:`maybe_fail`, called by the worker before each step; when
the variable names this rank and step, the process dies at once (exit code
:data:`EXIT_CODE`, no cleanup), as a crashed GPU or a killed pod would.

Not a chaos framework; one rank, one step, one way to die.
"""

from __future__ import annotations

import os
import sys

ENV = "MESHTRAIN_FAULT_INJECT"
EXIT_CODE = 17


def parse(value: str | None) -> tuple[int, int] | None:
    """``"3:2"`` -> (rank 3, step 2); empty -> None."""
    if not value:
        return None
    try:
        rank, step = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected RANK:STEP, e.g. 3:2") from None
    return rank, step


def maybe_fail(rank: int, step: int) -> None:
    """Die here if the fault-injection variable says so."""
    target = parse(os.environ.get(ENV))
    if target == (rank, step):
        sys.stderr.write(f"{ENV}: rank {rank} dies before step {step}\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
