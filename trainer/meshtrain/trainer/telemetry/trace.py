"""The per-rank event trace, ``DIR/trace/rank-N.jsonl``, and optionally the step log.

:class:`TraceLog`, a sink, appends one line per step: the rank's coordinates, the job facts, the
wall-clock origin ``t0`` and every event in seconds since it (docs/telemetry.md, "Files").  Where
no engine writes the step log (benchmarks, tests), rank 0 appends it too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.telemetry import context, recording, steplog, stepstats

TRACE_DIR = "trace"
"""Directory of the per-rank event traces, relative to the log directory."""


def wall_offset(reads: int = 16) -> float:
    """``time.time()`` less ``time.perf_counter()``, from the tightest of ``reads`` bracketed reads.

    A rank descheduled between the two clock reads would shift every event
    of its trace by that pause against the other ranks' (calibration reads
    message latencies of a few hundred microseconds across ranks); the read
    whose bracketing perf_counter calls lie closest together is the one no
    pause split.
    """
    best = (float("inf"), 0.0)
    for _ in range(reads):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        best = min(best, (after - before, wall - (before + after) / 2))
    return best[1]


def trace_path(log_dir: Path, rank: int) -> Path:
    """Event trace of one rank."""
    return log_dir / TRACE_DIR / f"rank-{rank}.jsonl"


def event_record(e: recording.Event, origin: float) -> dict[str, Any]:
    """One event as JSON, times in seconds since ``origin``; absent fields left out."""
    out: dict[str, Any] = {
        "what": e.what,
        "kind": e.kind,
        "start": round(e.start - origin, 7),
        "end": round(e.end - origin, 7),
    }
    if e.what == "compute":
        out.update(microbatch=e.microbatch, chunk=e.chunk)
    elif e.what == "collective":
        out.update(group=e.group, bytes=e.nbytes)
        if e.bucket is not None:
            out["bucket"] = e.bucket
        if e.cpu_seconds is not None:
            out["cpu"] = round(e.cpu_seconds, 7)
    return out


class TraceLog:
    """Appends trace/rank-N.jsonl (every rank) and, with ``steps``, steps.jsonl (rank 0)."""

    def __init__(
        self,
        log_dir: Path,
        identity: context.RankIdentity,
        facts: stepstats.JobFacts,
        *,
        schedule: str,
        steps: bool = True,
    ) -> None:
        """``steps=False``: write only the trace (someone else writes steps.jsonl)."""
        self.log_dir = log_dir
        self._header = {
            "rank": identity.rank,
            "pp": identity.coords.pp,
            "dp": identity.coords.dp,
            "tp": identity.coords.tp,
            "schedule": schedule,
            "stages": facts.stages,
            "micro_batches": facts.micro_batches,
            "virtual_stages": facts.virtual_stages,
        }
        trace = trace_path(log_dir, identity.rank)
        trace.parent.mkdir(parents=True, exist_ok=True)
        self._trace = trace.open("a", encoding="utf-8")
        self._steps = steplog.StepLog(log_dir) if steps and identity.rank == 0 else None
        # perf_counter is per-boot monotonic; wall time aligns ranks (and pods) in the timeline.
        self._wall_offset = wall_offset()

    def publish(
        self,
        stats: stepstats.StepStats,
        events: Sequence[recording.Event],
        start: float,
        memory: context.MemorySample | None,
    ) -> None:
        line = {
            **self._header,
            "step": stats.step,
            "t0": start + self._wall_offset,
            "seconds": stats.seconds,
            "compute_seconds": stats.compute_seconds,
            "exposed_comm_seconds": stats.exposed_comm_seconds,
            "update_seconds": stats.update_seconds,
            "bubble_ratio": stats.bubble_ratio,
            "bubble_ratio_theoretical": stats.bubble_ratio_theoretical,
            "memory_bytes": memory.as_dict() if memory is not None else {},
            "events": [event_record(e, start) for e in sorted(events, key=lambda e: e.start)],
        }
        self._trace.write(json.dumps(line) + "\n")
        self._trace.flush()
        if self._steps is not None:
            record: dict[str, Any] = {**stats.log_record(), "time": time.time()}
            if memory is not None:
                record["memory_bytes"] = memory.as_dict()
            self._steps.write(record)

    def checkpoint_saved(self, step: int) -> None:
        """Checkpoints are the engine's log lines, not the step log's."""

    def health(
        self,
        step: int,
        *,
        eval_loss: float | None,
        skipped: str,
        noise_scale: float | None = None,
        epoch: int | None = None,
    ) -> None:
        """The worker's steps.jsonl record carries eval_loss and skipped (trainer/meshtrain/trainer/telemetry/steplog.py)."""

    def straggler_verdict(self, verdict: stragglers.Verdict) -> None:
        """The exporter and /progress carry the verdict."""

    def close(self) -> None:
        self._trace.close()
        if self._steps is not None:
            self._steps.close()


def read_trace(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its trace lines (one per step, in file order)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(log_dir) / TRACE_DIR).glob("rank-*.jsonl")):
        lines = [
            json.loads(line)
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        if lines:
            out[lines[0]["rank"]] = lines
    return out
