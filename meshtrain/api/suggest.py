"""Did-you-mean: the known names closest to a misspelt one (``learningrate`` -> ``learningRate``).

Pure string work on bounded input, so an error message can name the fix: a name that differs
only in case, underscores or dashes is the answer, else the closest by :mod:`difflib`'s ratio.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from meshtrain.api import limits

MAX_SUGGESTIONS = 3
"""Names a suggestion offers at most."""
CUTOFF = 0.6
"""Least :class:`difflib.SequenceMatcher` ratio (0..1) of a name worth suggesting (difflib's default)."""


def _folded(name: str) -> str:
    """``name`` without case, underscores or dashes: ``learning_rate`` and ``LearningRate`` alike."""
    return name.casefold().replace("_", "").replace("-", "")


def closest(name: str, known: Iterable[str], limit: int = MAX_SUGGESTIONS) -> list[str]:
    """The names of ``known`` closest to ``name``, best first.

    A known name that differs only in case, underscores or dashes is the answer alone
    (``learningrate`` and ``learning_rate`` -> ``learningRate``); else the closest by
    :func:`difflib.get_close_matches` (ratio at least :data:`CUTOFF`).  A name longer
    than :data:`~meshtrain.api.limits.MAX_QUOTED` characters (hostile, never a field) has none.
    """
    if len(name) > limits.MAX_QUOTED:
        return []
    candidates = sorted(set(known) - {name})
    folded = _folded(name)
    same = [k for k in candidates if _folded(k) == folded]
    if same:
        return same[:limit]
    by_folded: dict[str, list[str]] = {}
    for candidate in candidates:
        by_folded.setdefault(_folded(candidate), []).append(candidate)
    near = difflib.get_close_matches(folded, list(by_folded), n=limit, cutoff=CUTOFF)
    return [k for key in near for k in by_folded[key]][:limit]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``did you mean learningRate?`` (or ``A or B``), or '' when nothing is close."""
    names = closest(name, known)
    if not names:
        return ""
    return f"did you mean {' or '.join(names)}?"
