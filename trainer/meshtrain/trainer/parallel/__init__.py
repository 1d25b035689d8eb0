"""Parallelism applied from outside the model: mesh, tensor, pipeline and data parallel, ZeRO.

:func:`meshtrain.trainer.parallel.parallelize.parallelize` composes them (its comments explain the
order).  Clipping by the global norm and the bytes of state a rank holds live here too, because
they depend on how the model is sharded.
"""
