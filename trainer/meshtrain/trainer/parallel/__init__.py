"""Parallelism applied from outside the model: mesh, tensor, pipeline and data parallel.

:func:`meshtrain.trainer.parallel.parallelize.parallelize` composes them (its
docstring explains the order).  :mod:`.schedules` is pure (no processes);
:mod:`.recording` is the one interface through which the engine reports
timings to telemetry, and :mod:`.clocks` takes those times (host seconds on
CPU, CUDA events on a GPU).  Nothing here builds the model or loops over steps.
"""
