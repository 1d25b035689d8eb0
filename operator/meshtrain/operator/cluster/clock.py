"""The operator's wall clock, in UTC: the time a pass decides at and its writes are stamped with.

The policy never reads it: each pass hands it the time.
"""

from __future__ import annotations

import datetime


def now() -> datetime.datetime:
    """The current time, in UTC."""
    return datetime.datetime.now(datetime.UTC)
