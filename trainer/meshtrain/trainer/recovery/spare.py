"""``python -m meshtrain.trainer.recovery.spare``: a warm process that becomes a rank's worker.

Imports torch and the trainer's heavy modules first, then waits on stdin for its assignment
(:func:`.spares.assign`) and runs :func:`meshtrain.trainer.worker.main` as that rank.  A GPU
failing under the rank ends it with :data:`exitcodes.DEVICE_ERROR`, which its supervisor counts
against that GPU, or with :data:`exitcodes.DEVICE_LOST` for a GPU gone, which it takes for bad at
once (:mod:`.device_fault`).
"""

from __future__ import annotations

import sys
import traceback

import torch

from meshtrain.api import exitcodes
from meshtrain.trainer import worker
from meshtrain.trainer.parallel import mesh
from meshtrain.trainer.recovery import device_fault, spares


def main() -> int:
    torch.zeros(1).add_(1)  # the first op's lazy initialisation, before the assignment
    assignment = spares.read_assignment()
    if assignment is None:
        return 0
    env, argv = assignment
    spares.become(env)
    try:
        return worker.main(argv)
    except RuntimeError as err:
        if not device_fault.is_device_error(err):
            raise
        traceback.print_exc()
        lost = device_fault.is_device_lost(err)
        code = exitcodes.DEVICE_LOST if lost else exitcodes.DEVICE_ERROR
        what = "is gone" if lost else "failed under this rank"
        print(f"meshtrain worker: the GPU {what}: exit {code}", file=sys.stderr, flush=True)
        return code


if __name__ == "__main__":
    mesh.exit_now(main())
