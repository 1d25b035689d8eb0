"""The meshtrain operator: a kopf controller for TrainingJob resources.

Pure policy (placement, resource builders, conditions, lifecycle decisions)
lives in its own modules; the kopf handlers and the Kubernetes client module
are the only places that do I/O.  Not the trainer: pods run
:mod:`meshtrain.trainer`.
"""
