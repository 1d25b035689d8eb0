"""The meshtrain operator: a kopf controller for TrainingJob resources.

Layers, each importing only those below it (an import-linter contract):
``command`` (the process) -> ``handlers`` (kopf's events) -> ``reconciler``
(one pass: observe, decide, act) -> ``placing`` (plans and creates gangs under
one lock) -> ``gang_fit`` (where a gang fits, read from the caches) ->
``admitting`` (memory verdicts, remembered) | ``cluster`` (API client, caches,
writes) -> ``policy`` (pure decisions).  Not the trainer: pods run
:mod:`meshtrain.trainer`.
"""
