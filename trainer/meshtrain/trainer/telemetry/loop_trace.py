"""What a run's event trace (:mod:`.trace`) says about the step loop around the compute.

Pure, trace lines in and figures out: the seconds no recorded event covers, the tensor-parallel
calls, and the latency of pipeline messages still in flight.  Calibration's step-loop run and the
planner's validation bench read them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from meshtrain.trainer.telemetry import stepstats


def outside_events(events: list[dict[str, Any]]) -> float:
    """Seconds of a step's trace line, up to its last event's end, that no event covers."""
    if not events:
        return 0.0
    end = max(float(e["end"]) for e in events)
    return end - stepstats.union_seconds((float(e["start"]), float(e["end"])) for e in events)


def tp_calls(lines: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per op, the tensor-parallel collective calls of trace ``lines``: count, wall seconds and bytes summed.

    And of the calls that recorded the CPU their process spent over them
    (host clock, nothing asynchronous in flight): ``cpu_calls``,
    ``cpu_bytes`` and ``cpu_seconds``.
    """
    out: dict[str, dict[str, float]] = {}
    for line in lines:
        for event in line["events"]:
            if event["what"] == "collective" and event.get("group") == "tp":
                total = out.setdefault(
                    event["kind"],
                    dict.fromkeys(
                        ("calls", "seconds", "bytes", "cpu_calls", "cpu_bytes", "cpu_seconds"), 0.0
                    ),
                )
                total["calls"] += 1
                total["seconds"] += float(event["end"]) - float(event["start"])
                total["bytes"] += float(event.get("bytes", 0))
                if "cpu" in event:
                    total["cpu_calls"] += 1
                    total["cpu_bytes"] += float(event.get("bytes", 0))
                    total["cpu_seconds"] += float(event["cpu"])
    return out


MESSAGE_KINDS = {"forward": "activations", "backward": "gradients"}
"""What the message a compute event waited for carried, by the event's kind."""


IN_FLIGHT_WAIT_S = 1e-4
"""A receive wait longer than this found its message still in flight (one that had arrived takes about 10 us)."""


def message_latencies(lines: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Wall seconds each pipeline message still in flight when it was waited for took, by kind (``activations``/``gradients``).

    A stage's forward (backward) of micro-batch ``i`` waits for the forward
    (backward) of ``i`` on the stage before (after) it, with the same data-
    and tensor-parallel coordinates, in the same step.  Where the message was
    still in flight when its receiver asked for it (the receiver was waiting
    when the sender's action ended, or its wait lasted more than
    :data:`IN_FLIGHT_WAIT_S`), it arrived when the wait ended: its latency is
    the wait's end less the sender's action's end, both on the wall clock
    (each line's ``t0`` plus the event's offset): posting it, gloo's copies
    and the wake-up of the receiver, as the pipeline's critical path sees
    them.  A message already there says nothing about its latency and is left
    out, as are interleaved schedules (their chunks route messages between
    virtual stages).  The tensor-parallel ranks of a stage compute each action
    together, so a hop counts once, at the latest of their messages.
    """
    by_rank = {
        (line["step"], line["pp"], line["dp"], line["tp"]): line
        for line in lines
        if line.get("virtual_stages", 1) == 1
    }
    hops: dict[tuple[int, int, int, str, int], float] = {}
    for (step, stage, dp, tp), line in by_rank.items():
        waited: dict[str, Any] | None = None
        for event in line["events"]:
            if event["what"] == "wait" and event["kind"] == "recv":
                waited = event
                continue
            if event["what"] != "compute":
                continue
            kind, posted, waited = event["kind"], waited, None
            source = by_rank.get((step, stage - 1 if kind == "forward" else stage + 1, dp, tp))
            if posted is None or source is None:
                continue
            sent = _action_end(source, kind, event["microbatch"])
            if sent is None:
                continue
            started, ended = (line["t0"] + float(posted[k]) for k in ("start", "end"))
            if started <= sent or ended - started > IN_FLIGHT_WAIT_S:
                hop = (step, stage, dp, kind, event["microbatch"])
                hops[hop] = max(hops.get(hop, 0.0), ended - sent)
    out: dict[str, list[float]] = collections.defaultdict(list)
    for (_, _, _, kind, _), seconds in sorted(hops.items()):
        out[MESSAGE_KINDS[kind]].append(seconds)
    return dict(out)


def _action_end(line: dict[str, Any], kind: str, microbatch: int) -> float | None:
    """Wall-clock end of ``line``'s compute ``kind`` of ``microbatch`` (None: not in the line)."""
    for event in line["events"]:
        if (
            event["what"] == "compute"
            and event["kind"] == kind
            and event["microbatch"] == microbatch
        ):
            return float(line["t0"]) + float(event["end"])
    return None
