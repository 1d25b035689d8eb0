"""Fixtures the unit tests of in-place recovery share."""

from __future__ import annotations

import pytest

from meshtrain.trainer import launch
from meshtrain.trainer.recovery import rendezvous


@pytest.fixture
def store():
    """A real TCPStore hosted by this process, at generation 0 (a test module may define its own)."""
    found = rendezvous.connect("127.0.0.1", launch.free_port(), master=True, timeout_s=10)
    rendezvous.init_generation(found)
    return found
