"""Trainer state on disk: layout-independent DCP checkpoints, published atomically, resumed automatically.

:mod:`.checkpointer` decides when to save and resumes at start, :mod:`.state` is what a checkpoint
holds, :mod:`.sharded` maps a rank's pieces to dense tensors and :mod:`.store` is the directory
protocol (docs/checkpoints.md).
"""
