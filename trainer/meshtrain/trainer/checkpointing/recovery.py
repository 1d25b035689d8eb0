"""Where a (re)started gang takes its state from: in-memory snapshots or storage checkpoints.

Memory when its newest complete step is at least the newest storage checkpoint's (it loads in
seconds and loses no more steps); storage otherwise, or when a snapshot is missing on every holder
or does not fit the engine (another layout or model); nothing when neither has a step.
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
    """Load the newest state (collective); its step and where it came from."""
    del engine  # both sources load into the engine they were built with
    in_memory = snapshots.available()
    on_storage = saver.locate()
    if prefer_memory(in_memory, on_storage):
        step = snapshots.restore()
        if step is not None:
            saver.restored_elsewhere(snapshots.resumed)
            return step, "memory"
    step = saver.restore()
    return step, "storage" if step is not None else "none"
