"""Where a (re)started gang takes its state from: in-memory snapshots or storage checkpoints.

Memory when its newest complete step is at least the newest storage checkpoint's (it loads in
seconds and loses no more steps); storage otherwise, or when a snapshot is missing on every holder,
is damaged, does not fit the engine (another layout or model) or fails to load (storage then
overwrites every tensor and the trainer record); nothing when neither has a step.  A bad snapshot
never stops the job: when one failed half-way and storage has nothing, :class:`.memory.HalfLoaded`
tells the caller to rebuild the engine (a fresh start, the same on every rank).
"""

from __future__ import annotations

from typing import Any, Literal

from meshtrain.trainer.checkpointing import checkpointer, memory

Source = Literal["memory", "storage", "none"]


def prefer_memory(in_memory: int | None, on_storage: int | None) -> bool:
    """Whether to try memory first: it has a step, and storage has none newer."""
    return in_memory is not None and (on_storage is None or in_memory >= on_storage)


def restore(
    engine: Any, saver: checkpointer.Checkpointer, snapshots: memory.MemorySnapshots
) -> tuple[int | None, Source]:
    """Load the newest state (collective); its step and where it came from.

    :class:`.memory.HalfLoaded` (every rank): a snapshot failed half-way and storage has nothing
    to overwrite it with.
    """
    del engine  # both sources load into the engine they were built with
    in_memory = snapshots.available()
    on_storage = saver.locate()
    half_loaded: memory.HalfLoaded | None = None
    if prefer_memory(in_memory, on_storage):
        try:
            step = snapshots.restore()
        except memory.HalfLoaded as err:  # the same on every rank (agreed in restore)
            step, half_loaded = None, err
        if step is not None:
            saver.restored_elsewhere(snapshots.resumed)
            return step, "memory"
    step = saver.restore()  # every tensor, the RNG and the trainer record
    if step is None and half_loaded is not None:
        raise half_loaded
    return step, "storage" if step is not None else "none"
