"""meshtrain: topology-aware 3D-parallel training on Kubernetes.

The root package holds what the operator and the trainer share (the
TrainingJob API model, the rank-layout arithmetic, the planner) and the command
line.  The operator lives in :mod:`meshtrain.operator`, the trainer in
:mod:`meshtrain.trainer`.
"""

__version__ = "0.2.0"
