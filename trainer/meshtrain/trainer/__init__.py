"""The meshtrain trainer: 3D-parallel GPT training that runs inside every pod.

The model knows nothing of distribution; parallelism is applied from outside
(:mod:`meshtrain.trainer.parallel`).  Not the operator, and no Kubernetes calls.
"""
