"""Trainer state on disk: layout-independent DCP checkpoints, published atomically, resumed automatically.

:mod:`.store` (the directory protocol: temporary directory,
COMPLETE marker, atomic rename, discovery, pruning, damage detection),
:mod:`.sharded` (a rank's pieces of dense tensors for DCP), :mod:`.state`
(what a checkpoint holds and the DCP calls) and :mod:`.checkpointer` (when
to save, resume at start, fault injection for tests).

Not the training loop; the worker calls a :class:`.checkpointer.Checkpointer`.
"""
