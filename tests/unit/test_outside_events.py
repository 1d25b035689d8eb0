"""calibrate.outside_events: the step loop's seconds between a rank's recorded events."""

from __future__ import annotations

import pytest

from meshtrain.trainer import calibrate


def test_outside_events_counts_the_uncovered_seconds_up_to_the_last_event() -> None:
    events = [
        {"what": "compute", "kind": "forward", "start": 0.5, "end": 2.0},
        {"what": "wait", "kind": "recv", "start": 1.5, "end": 3.0},  # overlaps the forward
        {"what": "compute", "kind": "backward", "start": 4.0, "end": 6.0},
        {"what": "collective", "kind": "all_reduce", "start": 6.5, "end": 7.0},
    ]
    # uncovered: [0, 0.5], [3, 4], [6, 6.5] -> 0.5 + 1 + 0.5
    assert calibrate.outside_events(events) == pytest.approx(2.0)
    assert calibrate.outside_events([]) == 0.0
