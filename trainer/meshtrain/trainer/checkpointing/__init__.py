"""Trainer state on disk: layout-independent DCP checkpoints, published atomically, resumed automatically.

:mod:`.checkpointer` decides when to save and resumes at start, :mod:`.state` is what a checkpoint
holds, :mod:`.sharded` maps a rank's pieces to dense tensors, :mod:`.store` is the directory
protocol and :mod:`.owner` holds the job's own directory against other writers (docs/checkpoints.md).
"""
