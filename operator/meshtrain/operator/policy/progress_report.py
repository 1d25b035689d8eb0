"""The strict schema of rank 0's progress document: the tenant's bytes -> a document the status may hold.

A pod's ``GET /progress`` answer and its termination message are written by a tenant's program,
so they are read as hostile: at most :data:`BODY_LIMIT` bytes of UTF-8 JSON, one object, no
duplicate keys, no ``NaN``/``Infinity``, every known field checked for type and range (finite
numbers, integers within JSON's exact range, bounded strings and lists), unknown fields dropped.
A field that breaks the schema is left out with a short note naming it; nothing raises.  A
NaN or a 20-digit integer would otherwise make the API server refuse the whole status write.
Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from meshtrain.api import limits
from meshtrain.api.spec import kube_names

BODY_LIMIT = 4096
"""Most bytes of one document: the trainer's largest stays under it (docs/telemetry.md)."""

MAX_NESTING = 8
"""Arrays and objects inside one another a document may open (the trainer's go 6 deep, counted
as :func:`_nesting_exceeds` counts: ``{"recovery": [{"nodes": [{"ranks": [...]}]}]}``)."""

MAX_INTEGER = 2**53 - 1
"""Largest integer a field may hold: JSON's exact range, well inside the status' int64."""

MAX_STRAGGLERS = 16
"""Most entries of ``stragglers`` (the trainer sends its slowest 16)."""

MAX_TIME_LENGTH = 40
"""Longest ``updated_at`` (RFC 3339 with fractions and an offset is 35 characters)."""

UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A job UID as the API server (and ``meshtrain run``) makes them, RFC 4122 (``resumed_from_uid``)."""

MAX_NOTES = 4
"""Most notes kept about one document; the rest are counted."""

NOTE_QUOTE = 32
"""Characters of a tenant's key quoted in a note."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the schema kept of one document, and why it dropped the rest."""

    document: dict[str, Any] | None
    """The known fields that passed, by the trainer's names; None: not a progress document at all."""
    notes: tuple[str, ...] = ()
    """Short reasons for what was dropped (at most :data:`MAX_NOTES`, each naming the field)."""


class _Refused(ValueError):
    """The body is not one JSON object (the message says why)."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number JSON allows")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Refused(f"duplicate key {_quote(key)}")
        found[key] = value
    return found


def _quote(text: str) -> str:
    return repr(text[:NOTE_QUOTE] + ("..." if len(text) > NOTE_QUOTE else ""))


def _integer(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INTEGER:
        return value
    return None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and abs(value) > MAX_INTEGER:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _positive(value: Any) -> float | None:
    number = _finite(value)
    return number if number is not None and number > 0 else None


def _not_negative(value: Any) -> float | None:
    number = _finite(value)
    return number if number is not None and number >= 0 else None


def _uid(value: Any) -> str | None:
    if not isinstance(value, str) or not UID.fullmatch(value):
        return None
    return value


def _time(value: Any) -> str | None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TIME_LENGTH:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return value if parsed.tzinfo is not None else None


def _flagged(value: Any) -> dict[str, Any] | None:
    """One flagged rank: ``{rank, slowdown, since_step}`` (``since_step`` optional)."""
    if not isinstance(value, Mapping):
        return None
    rank, slowdown = _integer(value.get("rank")), _positive(value.get("slowdown"))
    if rank is None or slowdown is None:
        return None
    entry: dict[str, Any] = {"rank": rank, "slowdown": slowdown}
    if "since_step" in value:
        since = _integer(value["since_step"])
        if since is None:
            return None
        entry["since_step"] = since
    return entry


def _flagged_list(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list) or len(value) > MAX_STRAGGLERS:
        return None
    entries = [_flagged(item) for item in value]
    return None if any(e is None for e in entries) else [e for e in entries if e is not None]


MAX_RECOVERIES = 4
"""Most recovery records of ``recovery`` (the trainer sends its newest 2)."""
MAX_CAUSE = 120
"""Longest ``cause`` of a recovery record."""
MAX_RECORD_RANKS = 16
"""Most ranks a recovery record lists, in ``ranks`` or under one of its ``nodes``."""
RECOVERY_TIERS = ("process", "container", "pod", "torchrun", "gang")
RECOVERY_SOURCES = ("memory", "storage", "none")
_RECORD_NUMBERS = {
    "failedAt": _not_negative,
    "detectedAt": _not_negative,
    "rejoinedAt": _not_negative,
    "restoredAt": _not_negative,
    "firstStepAt": _not_negative,
    "resumedStep": _integer,
    "lostSteps": _integer,
}


def _recovery_record(value: Any) -> dict[str, Any] | None:
    """One in-place recovery record (camelCase, ``meshtrain.trainer.telemetry.recoveries``):
    ``generation``, ``tier`` and ``cause`` required; the rest checked, or left out when null."""
    if not isinstance(value, Mapping):
        return None
    generation, tier, cause = value.get("generation"), value.get("tier"), value.get("cause")
    if _integer(generation) is None or tier not in RECOVERY_TIERS or not isinstance(cause, str):
        return None
    entry: dict[str, Any] = {"generation": generation, "tier": tier, "cause": cause[:MAX_CAUSE]}
    ranks = value.get("ranks")
    if isinstance(ranks, list) and len(ranks) <= MAX_RECORD_RANKS:
        entry["ranks"] = [r for r in (_integer(r) for r in ranks) if r is not None]
    for key, check in _RECORD_NUMBERS.items():
        if value.get(key) is not None:
            checked = check(value[key])
            if checked is None:
                return None
            entry[key] = checked
    if value.get("source") is not None:
        if value["source"] not in RECOVERY_SOURCES:
            return None
        entry["source"] = value["source"]
    nodes = _record_nodes(value.get("nodes"))  # absent from trainers older than stop 60
    if nodes is not None:
        entry["nodes"] = nodes
    return entry


def _record_nodes(value: Any) -> list[dict[str, Any]] | None:
    """A record's ``nodes`` (where its failed ranks ran, as their pods' supervisors said): at most
    ``limits.MAX_RECOVERY_NODES`` entries, each a Node's name and at most :data:`MAX_RECORD_RANKS`
    ranks; None for anything else, which leaves the record without it (:func:`_dropped_nodes`
    notes it).  Whether the job held such a node is judged where a record is used
    (``device_errors``)."""
    if not isinstance(value, list) or len(value) > limits.MAX_RECOVERY_NODES:
        return None
    found = []
    for item in value:
        node = item.get("node") if isinstance(item, Mapping) else None
        ranks = item.get("ranks") if isinstance(item, Mapping) else None
        if not kube_names.is_node_name(node) or not isinstance(ranks, list):
            return None
        valid = [_integer(r) for r in ranks[: MAX_RECORD_RANKS + 1]]
        if not ranks or len(ranks) > MAX_RECORD_RANKS or None in valid:
            return None
        found.append({"node": node, "ranks": valid})
    return found


def _dropped_nodes(sent: Any, kept: Any) -> list[str]:
    """A note for each recovery record kept without the ``nodes`` it was sent with."""
    if not isinstance(sent, list) or not isinstance(kept, list) or len(sent) != len(kept):
        return []
    return [
        f"recovery[{i}].nodes: out of the schema, ignored"
        for i, (raw, entry) in enumerate(zip(sent, kept))
        if isinstance(raw, Mapping) and raw.get("nodes") is not None and "nodes" not in entry
    ]


def _recovery_list(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list) or len(value) > MAX_RECOVERIES:
        return None
    entries = [_recovery_record(item) for item in value]
    return None if any(e is None for e in entries) else [e for e in entries if e is not None]


COUNTED_TIERS = ("process", "container", "pod", "torchrun")
"""Tiers of ``recovery_counts``: the in-place recoveries the job's store counted, cumulative
(``torchrun``: a custom trainer's, its torchrun agent's ``TORCHELASTIC_RESTART_COUNT`` on pod 0)."""


def _recovery_counts(value: Any) -> dict[str, int] | None:
    if not isinstance(value, Mapping) or not set(value) <= set(COUNTED_TIERS):
        return None
    counts = {tier: _integer(value[tier]) for tier in value}
    return None if None in counts.values() else {k: v for k, v in counts.items() if v is not None}


GOODPUT_PHASES = ("detection", "restart", "reload", "recompute")
"""The lost-time phases of ``goodput.lost_seconds`` (the trainer's ``telemetry.goodput.PHASES``)."""


GOODPUT_SLACK = (1.01, 1.0)
"""productive + lost may pass wall by 1% + 1 s (the trainer rounds to milliseconds, and a failure's
times come from the failed pod's clock) before the figures are refused as inconsistent."""


def _goodput(value: Any) -> dict[str, Any] | None:
    """``{ratio, productive_seconds, wall_seconds, lost_seconds: {phase: seconds}}``: every number
    finite and not negative, productive + lost at most wall (:data:`GOODPUT_SLACK`), no other key;
    the ratio sent at most 1 (or null), but the one kept derived: productive over wall (null at no
    wall time)."""
    if not isinstance(value, Mapping) or set(value) != {
        "ratio",
        "productive_seconds",
        "wall_seconds",
        "lost_seconds",
    }:
        return None
    sent = value["ratio"]  # checked, then derived from the seconds rather than taken
    if sent is not None and ((checked := _not_negative(sent)) is None or checked > 1):
        return None
    lost = value["lost_seconds"]
    if not isinstance(lost, Mapping) or set(lost) != set(GOODPUT_PHASES):
        return None
    seconds = {key: _not_negative(value[key]) for key in ("productive_seconds", "wall_seconds")}
    phases = {phase: _not_negative(lost[phase]) for phase in GOODPUT_PHASES}
    if None in seconds.values() or None in phases.values():
        return None
    productive, wall = seconds["productive_seconds"] or 0.0, seconds["wall_seconds"] or 0.0
    scale, slack = GOODPUT_SLACK
    if productive + sum(p or 0.0 for p in phases.values()) > wall * scale + slack:
        return None
    return {
        "ratio": min(1.0, productive / wall) if wall > 0 else None,
        **seconds,
        "lost_seconds": phases,
    }


_NULL = object()
"""A field's checker found null, which the field allows."""


def _nullable(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: _NULL if value is None else check(value)


FIELDS: Mapping[str, Callable[[Any], Any]] = {
    "step": _integer,
    "loss": _nullable(_finite),
    "tokens_per_second": _nullable(_not_negative),
    "last_checkpoint_step": _nullable(_integer),
    "updated_at": _nullable(_time),
    "eval_loss": _nullable(_finite),
    "skipped_updates": _integer,
    "straggler": _nullable(_flagged),
    "stragglers": _flagged_list,
    "gradient_noise_scale": _nullable(_positive),
    "resumed_from_uid": _nullable(_uid),
    "recovery": _recovery_list,
    "recovery_counts": _recovery_counts,
    "goodput": _nullable(_goodput),
}
"""The trainer's fields (``meshtrain.trainer.telemetry.progress.FIELDS``) and their checks: a
checked value, or None when the value breaks the schema."""


def parse(body: bytes) -> Reading:
    """The fields of ``body`` that pass the schema (``document`` None when it is no JSON object)."""
    if len(body) > BODY_LIMIT:
        return Reading(None, (f"the document has more than {BODY_LIMIT} bytes",))
    try:
        text = body.decode("utf-8")
        if _nesting_exceeds(text, MAX_NESTING):
            return Reading(
                None, (f"not a progress document: nested too deep (over {MAX_NESTING})",)
            )
        raw = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    except _Refused as err:
        return Reading(None, (f"not a progress document: {err}",))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return Reading(None, ("not a progress document: not UTF-8 JSON, or nested too deep",))
    if not isinstance(raw, dict):
        return Reading(
            None, (f"not a progress document: a JSON {type(raw).__name__}, not an object",)
        )
    return _checked(raw)


def _nesting_exceeds(text: str, limit: int) -> bool:
    """Whether JSON ``text`` opens more than ``limit`` arrays or objects inside one another.

    Checked before parsing: the parser's own guard is the interpreter's recursion limit, which
    other libraries in the process raise (torch's compiler does), so it cannot be the bound.
    """
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _checked(raw: Mapping[str, Any]) -> Reading:
    document: dict[str, Any] = {}
    notes: list[str] = []
    for key, check in FIELDS.items():
        if key not in raw:
            continue
        value = check(raw[key])
        if value is None:
            notes.append(f"{key}: {type(raw[key]).__name__} out of the schema, ignored")
        else:
            document[key] = None if value is _NULL else value
    notes.extend(_dropped_nodes(raw.get("recovery"), document.get("recovery")))
    unknown = [key for key in raw if key not in FIELDS]
    if unknown:
        named = ", ".join(_quote(key) for key in unknown[:2])
        notes.append(f"{len(unknown)} unknown field(s) ignored: {named}")
    if len(notes) > MAX_NOTES:
        notes[MAX_NOTES - 1 :] = [f"and {len(notes) - MAX_NOTES + 1} more field(s) ignored"]
    return Reading(document, tuple(notes))


MAX_BACKOFF_SECONDS = 300.0
"""Longest wait between two polls of a job whose pod keeps failing them."""


def wait_after(failures: int, every: float) -> float:
    """Seconds from one poll of a job to its next: ``every``, doubled per poll in a row that failed.

    Per job, so a pod that answers slowly or badly costs the operator at most one request per
    wait, and a fixed pod is read at the normal rate again after its first good answer.
    """
    return min(every * 2.0 ** min(failures, 16), max(every, MAX_BACKOFF_SECONDS))
