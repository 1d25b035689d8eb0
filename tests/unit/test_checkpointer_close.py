"""Checkpointer.close(): a save in flight ends before the directory is given up, and the
background thread stops (an old generation's thread never writes under a released directory)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from meshtrain.api import loading
from meshtrain.trainer.checkpointing import checkpointer, store
from tests.builders import JobBuilder


class _Heartbeat:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def release(self) -> None:
        self.events.append("released")


def _saver(tmp_path, events: list[str]) -> checkpointer.Checkpointer:
    job = loading.parse_spec(JobBuilder.cpu_run().raw())
    saver = checkpointer.Checkpointer(types.SimpleNamespace(spec=job), root=tmp_path)
    saver.holding = types.SimpleNamespace(heartbeat=_Heartbeat(events))  # type: ignore[assignment]
    return saver


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_close_waits_for_the_save_in_flight_then_releases(tmp_path, fails: bool) -> None:
    events: list[str] = []
    saver = _saver(tmp_path, events)
    started = threading.Event()

    def save() -> int:
        started.set()
        time.sleep(0.3)
        events.append("written")
        if fails:
            raise store.CheckpointError("a peer was lost under the save")
        return 4

    saver._in_flight = saver._worker.submit(save)
    started.wait(5)
    saver.close()  # a failed save is logged, never raised from close
    assert events == ["written", "released"]
    with pytest.raises(RuntimeError):  # the background thread is stopped
        saver._worker.submit(lambda: 0)
