"""Trainer state on disk and in memory: layout-independent DCP checkpoints, published atomically,
resumed automatically; in-memory snapshots for fast restarts.

:mod:`.checkpointer` decides when to save and resumes at start, :mod:`.state` is what a checkpoint
holds, :mod:`.sharded` maps a rank's pieces to dense tensors, :mod:`.store` is the directory
protocol and :mod:`.owner` holds the job's own directory against other writers.  :mod:`.memory`
keeps each rank's snapshot in its pod's /dev/shm and a peer's (:mod:`.snapshot_file` its file,
:mod:`.peer_copy` the transfers), and :mod:`.recovery` picks memory or storage at a start
(docs/checkpoints.md).
"""
