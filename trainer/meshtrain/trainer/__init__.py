"""The meshtrain trainer: 3D-parallel GPT and Llama training that runs inside every pod.

Subpackages by concern (models, data, parallel, checkpointing, telemetry, ...), layered by an
import contract.  The model knows nothing of distribution; parallelism is applied from outside
(:mod:`meshtrain.trainer.parallel`).
"""
