"""Parallelism applied from outside the model: mesh, tensor, pipeline and data parallel.

:func:`meshtrain.trainer.parallel.parallelize.parallelize` composes them (its
comments explain the order).  :mod:`.schedules` is pure (no processes);
clipping by the global gradient norm (:mod:`.clipping`) and the bytes of the
state a rank holds (:mod:`.state_bytes`) live here because they depend on how
the model is sharded.  Nothing here builds the model or loops over steps.
"""
