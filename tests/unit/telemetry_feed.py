"""A synthetic pipeline for the telemetry tests: exact event times, no processes.

:func:`simulate_step` plays one optimizer step of a balanced
pipeline (the real schedules from :mod:`meshtrain.trainer.parallel.schedules`)
with chosen forward/backward/bucket durations and returns, per stage, the
events a recorder would have received, in the same clock.  :func:`feed`
replays them into recorders.

Not the engine.  It checks the arithmetic of the telemetry, not
the training.
"""

from __future__ import annotations

from meshtrain.trainer.parallel import schedules
from meshtrain.trainer.telemetry import recording


def simulate_step(
    schedule: str,
    p: int,
    m: int,
    v: int = 1,
    *,
    fwd: float = 1.0,
    bwd: float = 2.0,
    buckets: int = 0,
    bucket_seconds: float = 0.0,
    bucket_bytes: int = 1 << 20,
    tail: float = 0.0,
) -> tuple[list[list[recording.Event]], float]:
    """Per-stage events of one step starting at t=0, and the step's wall seconds.

    Chunk times are ``fwd / v`` and ``bwd / v``.  After a stage's last
    backward, ``buckets`` data-parallel all-reduces of ``bucket_seconds`` each
    run back to back; then, as in the engine, the gradient-norm all-reduce
    over the pipeline group (p > 1) waits for the slowest stage; ``tail``
    seconds (optimizer update) end the step.
    """
    lists = [schedules.actions(schedule, p, m, s, v) for s in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    cursor, clock = [0] * p, [0.0] * p
    events: list[list[recording.Event]] = [[] for _ in range(p)]
    while any(cursor[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if cursor[s] == len(lists[s]):
                continue
            a = lists[s][cursor[s]]
            j = schedules.virtual_stage(s, a.chunk, p)
            if a.kind == "forward":
                needs = [("forward", a.microbatch, j - 1)] if j > 0 else []
            else:
                needs = [("forward", a.microbatch, j)] + (
                    [("backward", a.microbatch, j + 1)] if j < last else []
                )
            if all(n in done for n in needs):
                start = max([clock[s]] + [done[n] for n in needs])
                end = start + (fwd if a.kind == "forward" else bwd) / v
                done[(a.kind, a.microbatch, j)] = end
                if start > clock[s]:
                    events[s].append(recording.Event("wait", "recv", clock[s], start))
                events[s].append(
                    recording.Event(
                        "compute", a.kind, start, end, microbatch=a.microbatch, chunk=a.chunk
                    )
                )
                clock[s] = end
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("deadlock in the synthetic pipeline")
    for s in range(p):
        t = clock[s]
        for b in range(buckets):
            events[s].append(
                recording.Event(
                    "collective",
                    "all_reduce",
                    t,
                    t + bucket_seconds,
                    group="dp",
                    nbytes=bucket_bytes,
                    bucket=b,
                )
            )
            t += bucket_seconds
        clock[s] = t
    end = max(clock)
    if p > 1:
        for s in range(p):
            events[s].append(
                recording.Event("collective", "all_reduce", clock[s], end, group="pp", nbytes=8)
            )
    return events, end + tail


def feed(
    recorder: recording.StepRecorder,
    step: int,
    events: list[recording.Event],
    seconds: float,
    origin: float = 0.0,
    loss: float = 2.0,
    tokens: int = 1024,
) -> None:
    """Replay one stage's events of a step into ``recorder``, shifted by ``origin``."""
    recorder.step_start(step, origin)
    for e in events:
        if e.what == "compute":
            recorder.compute(
                e.kind, e.microbatch or 0, e.chunk or 0, origin + e.start, origin + e.end
            )
        elif e.what == "wait":
            recorder.wait(e.kind, origin + e.start, origin + e.end)
        else:
            recorder.collective(
                e.group, e.kind, e.nbytes, origin + e.start, origin + e.end, bucket=e.bucket
            )
    recorder.step_end(step, loss, tokens, seconds)
