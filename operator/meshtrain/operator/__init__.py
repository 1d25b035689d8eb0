"""The meshtrain operator: a kopf controller for TrainingJob resources.

Layers, each importing only those below it (an import-linter contract): ``command`` ->
``handlers`` -> ``reconciler`` -> ``placing`` -> ``gang_fit`` -> ``admitting`` | ``planning`` | ``cluster``
(API client, caches, writes) -> ``policy`` (pure decisions).
"""
