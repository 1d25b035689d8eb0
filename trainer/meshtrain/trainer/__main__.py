"""``python -m meshtrain.trainer``: run one training rank (see :mod:`meshtrain.trainer.worker`)."""

from meshtrain.trainer import worker
from meshtrain.trainer.parallel import mesh

if __name__ == "__main__":
    mesh.exit_now(worker.main())
