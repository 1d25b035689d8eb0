"""``checkpoint.inMemory``: defaults, bounds, and the check that its snapshots fit the pod."""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from tests.builders import JobBuilder


def test_in_memory_checkpoints_are_off_by_default_with_a_peer() -> None:
    job = loading.parse_spec(JobBuilder().raw())
    assert job.checkpoint.in_memory.interval_steps == 0
    assert job.checkpoint.in_memory.peer is True


def test_in_memory_fields_take_camel_case() -> None:
    raw = JobBuilder().checkpoint(inMemory={"intervalSteps": 5, "peer": False}).raw()
    job = loading.parse_spec(raw)
    assert (job.checkpoint.in_memory.interval_steps, job.checkpoint.in_memory.peer) == (5, False)


@pytest.mark.parametrize(
    ("value", "words"),
    [(-1, "greater than or equal to 0"), (10**9, "less than or equal to 100000000")],
)
def test_in_memory_interval_is_bounded(value: int, words: str) -> None:
    raw = JobBuilder().checkpoint(inMemory={"intervalSteps": value}).raw()
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(raw)
    assert "checkpoint.inMemory.intervalSteps" in str(err.value) and words in str(err.value)
