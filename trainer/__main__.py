"""``python -m meshtrain.trainer``: run one training rank (see :mod:`meshtrain.trainer.worker`)."""

import sys

from meshtrain.trainer import worker

if __name__ == "__main__":
    sys.exit(worker.main())
