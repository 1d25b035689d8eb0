"""The pipeline timeline picture of one measured step (``meshtrain timeline``).

Reads a run's event traces (:mod:`.trace`) and draws one step like the GPipe and Megatron figures:
a row per pipeline stage (its rank of replica 0 and tensor shard 0, aligned by the wall clock each
rank stamped), a block per forward and backward, idle time as gaps, and the gradient buckets on
rows of their own (docs/telemetry.md, "The timeline").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after matplotlib.use(): the backend must be chosen first

from meshtrain.trainer.telemetry import trace

FORWARD_COLOURS = ("#3b75af", "#8fb6dd", "#c4daef")
"""Forward blocks, by chunk (interleaved schedules have several)."""
BACKWARD_COLOURS = ("#e0823d", "#f3b27e", "#f8d4b5")
"""Backward blocks, by chunk."""
BUCKET_COLOUR = "#7d5ba6"
"""Data-parallel gradient buckets."""
IDLE_COLOUR = "#e6e6e6"
"""Row background: what shows through is idle time."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One drawn block: a compute of a micro-batch or a gradient bucket."""

    row: str
    """Row label, e.g. 'stage 0' or 'stage 0 all-reduce'."""
    kind: str
    """forward, backward or bucket."""
    start: float
    """Seconds since the earliest stage began the step."""
    end: float
    """Seconds since the earliest stage began the step."""
    label: str
    """Micro-batch number (compute) or bucket index."""
    chunk: int = 0
    """Model chunk of a compute block."""


@dataclasses.dataclass(frozen=True)
class StepView:
    """One step of one pipeline, ready to draw."""

    step: int
    title: str
    """Figure title with measured and theoretical bubble."""
    rows: list[str]
    """Row labels, top to bottom."""
    blocks: list[Block]
    seconds: float
    """Span of the step over all stages."""
    bubble: dict[int, float]
    """Measured bubble per stage."""
    bubble_theoretical: float
    """(p - 1) / (v * m + p - 1)."""


def stage_traces(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """stage -> trace lines of its rank with dp = 0 and tp = 0."""
    out: dict[int, list[dict[str, Any]]] = {}
    for lines in trace.read_trace(log_dir).values():
        head = lines[0]
        if head["dp"] == 0 and head["tp"] == 0:
            out[head["pp"]] = lines
    if not out:
        raise FileNotFoundError(f"no event trace under {Path(log_dir) / trace.TRACE_DIR}")
    return dict(sorted(out.items()))


def pick_step(traces: dict[int, list[dict[str, Any]]], step: int | None = None) -> int:
    """``step`` if every stage has it, else the last step that every stage has."""
    common = set.intersection(*({line["step"] for line in lines} for lines in traces.values()))
    if not common:
        raise ValueError("the stages' traces share no step")
    if step is not None:
        if step not in common:
            raise ValueError(
                f"step {step} not in every stage's trace (have {min(common)}..{max(common)})"
            )
        return step
    return max(common)


def step_view(traces: dict[int, list[dict[str, Any]]], step: int) -> StepView:
    """The blocks of ``step``: compute rows per stage, then bucket rows per stage."""
    # The last line of that step: a restarted run appends to the same trace.
    lines = {
        stage: [line for line in lines if line["step"] == step][-1]
        for stage, lines in traces.items()
    }
    origin = min(line["t0"] for line in lines.values())
    blocks: list[Block] = []
    span = 0.0
    for stage, line in lines.items():
        shift = line["t0"] - origin
        span = max(span, shift + line["seconds"])
        for e in line["events"]:
            if e["what"] == "compute":
                blocks.append(
                    Block(
                        f"stage {stage}",
                        e["kind"],
                        shift + e["start"],
                        shift + e["end"],
                        str(e["microbatch"]),
                        e.get("chunk") or 0,
                    )
                )
            elif e["what"] == "collective" and e.get("group") == "dp" and "bucket" in e:
                blocks.append(
                    Block(
                        f"stage {stage} all-reduce",
                        "bucket",
                        shift + e["start"],
                        shift + e["end"],
                        f"b{e['bucket']}",
                    )
                )
    stages = list(lines)
    rows = [f"stage {s}" for s in stages]
    rows += [
        f"stage {s} all-reduce"
        for s in stages
        if any(b.row == f"stage {s} all-reduce" for b in blocks)
    ]
    head = next(iter(lines.values()))
    bubble = {s: line["bubble_ratio"] for s, line in lines.items()}
    theory = head["bubble_ratio_theoretical"]
    schedule = head["schedule"] + (
        f" v={head['virtual_stages']}" if head["virtual_stages"] > 1 else ""
    )
    measured = ", ".join(f"s{s} {b:.3f}" for s, b in bubble.items())
    title = (
        f"step {step} · {schedule} · p={head['stages']} m={head['micro_batches']}\n"
        f"bubble measured {measured}  |  theoretical {theory:.3f}"
    )
    return StepView(
        step=step,
        title=title,
        rows=rows,
        blocks=blocks,
        seconds=span,
        bubble=bubble,
        bubble_theoretical=theory,
    )


def draw(view: StepView, out: Path) -> Path:
    """Draw ``view`` as a PNG at ``out``."""
    height = 1.6 + 0.5 * len(view.rows)
    fig, ax = plt.subplots(figsize=(15, height), dpi=110)
    scale, unit = (1e3, "ms") if view.seconds < 10 else (1.0, "s")
    index = {row: i for i, row in enumerate(view.rows)}
    for i in index.values():
        ax.barh(i, view.seconds * scale, left=0, height=0.8, color=IDLE_COLOUR, edgecolor="none")
    for b in view.blocks:
        y = index[b.row]
        if b.kind == "bucket":
            colour, height_b = BUCKET_COLOUR, 0.5
        else:
            palette = FORWARD_COLOURS if b.kind == "forward" else BACKWARD_COLOURS
            colour, height_b = palette[min(b.chunk, len(palette) - 1)], 0.8
        width = (b.end - b.start) * scale
        ax.barh(
            y,
            width,
            left=b.start * scale,
            height=height_b,
            color=colour,
            edgecolor="black",
            linewidth=0.4,
        )
        if width > view.seconds * scale * 0.008:
            ax.text(
                (b.start + b.end) / 2 * scale,
                y,
                b.label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if b.kind != "bucket" and b.chunk == 0 else "black",
            )
    ax.set_yticks(range(len(view.rows)), view.rows)
    ax.invert_yaxis()
    ax.set_xlim(0, view.seconds * scale)
    ax.set_xlabel(f"time since the step began ({unit})")
    ax.set_title(view.title, fontsize=10)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for c in (FORWARD_COLOURS[0], BACKWARD_COLOURS[0], BUCKET_COLOUR, IDLE_COLOUR)
    ]
    ax.legend(
        handles,
        ["forward", "backward", "dp all-reduce\nbucket", "idle"],
        loc="center left",
        bbox_to_anchor=(1.005, 0.5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def render(log_dir: Path, out: Path, step: int | None = None) -> StepView:
    """Read ``log_dir``'s traces and draw ``step`` (default: the last complete one) at ``out``."""
    traces = stage_traces(Path(log_dir))
    view = step_view(traces, pick_step(traces, step))
    draw(view, out)
    return view


def main(args: argparse.Namespace) -> int:
    """``meshtrain timeline DIR -o timeline.png``: returns the exit status."""
    try:
        view = render(args.log_dir, args.output, args.step)
    except (FileNotFoundError, ValueError) as err:
        print(f"meshtrain timeline: {err}", file=sys.stderr)
        return 2
    print(
        f"{args.output}: step {view.step}, {len(view.blocks)} blocks; {view.title.splitlines()[1]}"
    )
    return 0
