"""``python -m meshtrain.trainer.recovery.spare``: a warm process that becomes a rank's worker.

Imports torch and the trainer's heavy modules first, then waits on stdin for its assignment
(:func:`.spares.assign`) and runs :func:`meshtrain.trainer.worker.main` as that rank.
"""

from __future__ import annotations

import torch

from meshtrain.trainer import worker
from meshtrain.trainer.parallel import mesh
from meshtrain.trainer.recovery import spares


def main() -> int:
    torch.zeros(1).add_(1)  # the first op's lazy initialisation, before the assignment
    assignment = spares.read_assignment()
    if assignment is None:
        return 0
    env, argv = assignment
    spares.become(env)
    return worker.main(argv)


if __name__ == "__main__":
    mesh.exit_now(main())
