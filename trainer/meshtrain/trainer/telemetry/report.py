"""Pictures of a run without Grafana: ``meshtrain report DIR -o report.html`` (or ``.png``).

Reads a run's ``steps.jsonl`` (every attempt's: :func:`.steplog.attempts`) and event traces
(:mod:`.trace`) and draws loss, throughput, MFU, each stage's step split, collective and per-rank
times and the last step's timeline, as one self-contained HTML page or one picture, with the
restarts marked (docs/telemetry.md, "A run's report").
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after matplotlib.use(): the backend must be chosen first
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from meshtrain.trainer.telemetry import goodput, run_attempts, steplog, timeline, trace

SPLIT_COLOURS = {
    "compute": "#3b75af",
    "exposed communication": "#e0823d",
    "bubble": "#c9c9c9",
    "optimizer update": "#4c9a4c",
    "other": "#8c6bb1",
}
GROUP_COLOURS = {"dp": "#3b75af", "tp": "#e0823d", "pp": "#4c9a4c"}
T = TypeVar("T")


class ReportError(ValueError):
    """The directory holds no run this command can draw."""


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run's log directory holds."""

    log_dir: Path
    steps: list[dict[str, Any]]
    """Every attempt's steps, one record per step (the last record wins for a step a resumed run repeated)."""
    traces: dict[int, list[dict[str, Any]]]
    """rank -> its trace lines, one per step."""
    goodput: goodput.Account | None = None
    """The run's goodput from steps.jsonl and recoveries.jsonl (None: not read)."""
    attempts: tuple[run_attempts.Attempt, ...] = ()
    """The run's attempts, oldest first (one: it never restarted)."""


def _expected(log_dir: Path) -> str:
    return (
        f"{log_dir} holds no meshtrain run: expected {steplog.FILENAME} and "
        f"{trace.TRACE_DIR}/rank-N.jsonl, written by `meshtrain run --log-dir DIR` or by the "
        "trainer pods under <checkpoint.path>/<namespace>/<name>/logs"
    )


STEP_KEYS = {"step", "loss", "step_seconds", "tokens_per_second"}
"""What every step record holds."""


def _records(path: Path, required: set[str]) -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(
                f"{path}:{number} is not JSON ({err.msg}): not a meshtrain log"
            ) from err
        if not isinstance(record, dict) or not required <= set(record):
            missing = (
                sorted(required - set(record)) if isinstance(record, dict) else sorted(required)
            )
            raise ReportError(
                f"{path}:{number} is not a meshtrain record (no {', '.join(missing)})"
            )
        out.append(record)
    return out


def load(log_dir: Path) -> Run:
    """Read a run's log directory; :class:`ReportError` says what is missing or foreign."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise ReportError(f"{log_dir} is not a directory")
    steps_file = log_dir / steplog.FILENAME
    trace_files = sorted((log_dir / trace.TRACE_DIR).glob("rank-*.jsonl"))
    kept = next((log_dir / steplog.ATTEMPTS_DIR).glob(steplog.ATTEMPT_PATTERN), None)
    if not steps_file.is_file() and not trace_files and kept is None:
        raise ReportError(_expected(log_dir))
    if not steps_file.is_file() and kept is None:
        raise ReportError(
            f"{steps_file} is missing: the traces alone do not say loss or throughput"
        )
    attempts = steplog.attempts(log_dir, lambda path: _records(path, STEP_KEYS))
    by_step = {r["step"]: r for attempt in attempts for r in attempt}
    if not by_step:
        raise ReportError(f"{steps_file} is empty: the run finished no step yet")
    traces = {}
    for path in trace_files:
        lines = _records(path, {"rank", "pp", "dp", "tp", "step", "seconds", "events"})
        if lines:
            traces[lines[0]["rank"]] = list({line["step"]: line for line in lines}.values())
    return Run(
        log_dir=log_dir,
        steps=[by_step[s] for s in sorted(by_step)],
        traces=traces,
        goodput=goodput.account_of(log_dir),
        attempts=tuple(run_attempts.of(attempts)),
    )


def _steady(values: list[T]) -> list[T]:
    """Values without the first step (start-up: compilation, allocation, the first rendezvous)."""
    return values[1:] if len(values) > 1 else values


def draw_loss(ax: Axes, run: Run) -> None:
    ax.plot([r["step"] for r in run.steps], [r["loss"] for r in run.steps], color="#3b75af")
    for attempt in run.attempts[1:]:  # each restart, at the first step it trained
        ax.axvline(attempt.first_step - 0.5, color="#b22222", linestyle="--", linewidth=0.8)
    restarts = f" ({len(run.attempts) - 1} restart(s) dashed)" if len(run.attempts) > 1 else ""
    ax.set(title=f"Training loss{restarts}", xlabel="step", ylabel="loss")


def draw_throughput(ax: Axes, run: Run) -> None:
    steps = [r["step"] for r in run.steps]
    rates = [r["tokens_per_second"] for r in run.steps]
    ax.plot(steps, rates, color="#3b75af", linewidth=0.8, alpha=0.6, label="per step")
    window = max(1, len(rates) // 20)
    smooth = [
        statistics.median(rates[max(0, i - window) : i + window + 1]) for i in range(len(rates))
    ]
    ax.plot(steps, smooth, color="#1f3f66", label=f"median of {2 * window + 1} steps")
    ax.set(title="Throughput", xlabel="step", ylabel="tokens/s")
    ax.legend(fontsize=8)


def draw_mfu(ax: Axes, run: Run) -> None:
    with_mfu = [r for r in run.steps if "mfu" in r]
    ax.plot([r["step"] for r in with_mfu], [100 * r["mfu"] for r in with_mfu], color="#4c9a4c")
    ax.set(title="Model FLOPs utilisation", xlabel="step", ylabel="MFU (%)")


def stage_split(run: Run) -> dict[int, dict[str, float]]:
    """Mean seconds per step of each stage (its dp = 0, tp = 0 rank) by part; the parts sum to the step."""
    out = {}
    for stage, lines in sorted(_stage_lines(run).items()):
        parts: dict[str, list[float]] = defaultdict(list)
        for line in _steady(lines):
            update = line.get("update_seconds", 0.0)
            window = line["seconds"] - update
            known = {
                "compute": line.get("compute_seconds", 0.0),
                "exposed communication": line.get("exposed_comm_seconds", 0.0),
                "bubble": line.get("bubble_ratio", 0.0) * window,
                "optimizer update": update,
            }
            known["other"] = max(0.0, line["seconds"] - sum(known.values()))
            for part, seconds in known.items():
                parts[part].append(seconds)
        out[stage] = {part: statistics.fmean(values) for part, values in parts.items()}
    return out


def _stage_lines(run: Run) -> dict[int, list[dict[str, Any]]]:
    return {
        lines[0]["pp"]: lines
        for lines in run.traces.values()
        if lines[0]["dp"] == 0 and lines[0]["tp"] == 0
    }


def draw_step_split(ax: Axes, run: Run) -> None:
    split = stage_split(run)
    labels = [f"stage {s}" for s in split]
    left = [0.0] * len(split)
    for part, colour in SPLIT_COLOURS.items():
        widths = [1e3 * parts[part] for parts in split.values()]
        ax.barh(labels, widths, left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set(title="Step time split (mean over steps after the first)", xlabel="ms per step")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(SPLIT_COLOURS))


def collective_seconds(run: Run) -> dict[str, dict[int, float]]:
    """group -> step -> collective seconds per rank (mean over the ranks that took part)."""
    totals: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for lines in run.traces.values():
        for line in lines:
            per_group: dict[str, float] = defaultdict(float)
            for e in line["events"]:
                if e["what"] == "collective":
                    per_group[e.get("group") or "?"] += e["end"] - e["start"]
            for group, seconds in per_group.items():
                totals[group][line["step"]].append(seconds)
    return {
        group: {step: statistics.fmean(v) for step, v in sorted(steps.items())}
        for group, steps in sorted(totals.items())
    }


def draw_collectives(ax: Axes, run: Run) -> None:
    for group, by_step in collective_seconds(run).items():
        ax.plot(
            list(by_step),
            [1e3 * s for s in by_step.values()],
            label=group,
            color=GROUP_COLOURS.get(group),
        )
    ax.set(title="All-reduce time per step by group", xlabel="step", ylabel="ms (mean over ranks)")
    ax.legend(fontsize=8)


def rank_times(run: Run) -> dict[int, tuple[float, float]]:
    """rank -> (mean step seconds, mean compute seconds), steps after the first."""
    return {
        rank: (
            statistics.fmean(line["seconds"] for line in _steady(lines)),
            statistics.fmean(line.get("compute_seconds", 0.0) for line in _steady(lines)),
        )
        for rank, lines in sorted(run.traces.items())
    }


def draw_ranks(ax: Axes, run: Run) -> None:
    times = rank_times(run)
    ranks = list(times)
    ax.bar([r - 0.2 for r in ranks], [1e3 * s for s, _ in times.values()], 0.4, label="step")
    ax.bar([r + 0.2 for r in ranks], [1e3 * c for _, c in times.values()], 0.4, label="compute")
    ax.set_xticks(
        ranks, [f"{r}\npp{run.traces[r][0]['pp']} dp{run.traces[r][0]['dp']}" for r in ranks]
    )
    ax.set(title="Per-rank times (mean)", xlabel="rank", ylabel="ms per step")
    ax.legend(fontsize=8)


CHARTS: list[tuple[str, Callable[[Axes, Run], None], bool]] = [
    ("loss", draw_loss, False),
    ("throughput", draw_throughput, False),
    ("mfu", draw_mfu, False),
    ("step-split", draw_step_split, True),
    ("collectives", draw_collectives, True),
    ("ranks", draw_ranks, True),
]
"""(name, draw function, needs traces)."""


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _charts(run: Run) -> list[tuple[str, Callable[[Axes, Run], None]]]:
    return [(name, draw) for name, draw, needs in CHARTS if run.traces or not needs]


def summary(run: Run) -> list[tuple[str, str]]:
    """(what, value) rows of the report's table."""
    first, last = run.steps[0], run.steps[-1]
    steady = _steady(run.steps)
    rows = [
        ("layout", str(last.get("layout", "?"))),
        ("steps", f"{first['step']} .. {last['step']} ({len(run.steps)} recorded)"),
        ("loss", f"{first['loss']:.4f} -> {last['loss']:.4f}"),
        (
            "tokens/s (median, after step 1)",
            f"{statistics.median(r['tokens_per_second'] for r in steady):,.0f}",
        ),
        (
            "step time (median, after step 1)",
            f"{1e3 * statistics.median(r['step_seconds'] for r in steady):.1f} ms",
        ),
        ("ranks with a trace", str(len(run.traces))),
        *run_attempts.summary_rows(list(run.attempts)),
    ]
    if all("mfu" in r for r in steady):
        rows.insert(
            4,
            (
                "MFU (mean, after step 1)",
                f"{100 * statistics.fmean(r['mfu'] for r in steady):.2f} %",
            ),
        )
    return rows


FAILURE_COLUMNS = ("tier", "cause", "resumed after", "steps lost", *goodput.PHASES, "lost")
"""The per-failure table's columns after the failure's time."""


def _seconds(value: float) -> str:
    return f"{value:,.1f} s"


def goodput_rows(account: goodput.Account | None) -> list[tuple[str, str]]:
    """(what, value) rows of the goodput section (none when no step record has a time)."""
    if account is None or account.ratio is None:
        return []
    lost = account.lost_seconds
    return [
        ("goodput", f"{account.ratio:.2%}"),
        ("productive step time", _seconds(account.productive_seconds)),
        ("wall time", _seconds(account.wall_seconds)),
        ("start-up before the first step", _seconds(account.startup_seconds)),
        *((f"lost to failures: {phase}", _seconds(lost[phase])) for phase in goodput.PHASES),
        ("other (later start-ups, checkpoints, evaluation)", _seconds(account.other_seconds)),
        ("failures", str(account.failure_count)),
    ]


def failure_rows(account: goodput.Account | None) -> list[list[str]]:
    """One row per failure (the newest :data:`goodput.MAX_FAILURES`): when, tier, cause, the loss."""
    if account is None:
        return []
    return [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(f.failed_at)),
            f.tier,
            f.cause,
            f"step {f.resumed_step}",
            str(f.lost_steps),
            *(_seconds(f.seconds[phase]) for phase in goodput.PHASES),
            _seconds(f.lost_seconds),
        ]
        for f in account.failures
    ]


def goodput_text(account: goodput.Account | None) -> list[str]:
    """The goodput section as lines of text (what ``meshtrain report`` also prints)."""
    rows = goodput_rows(account)
    if not rows:
        return []
    lines = [f"{what}: {value}" for what, value in rows]
    for row in failure_rows(account):
        lines.append(
            f"  {row[0]} UTC {row[1]} ({row[2]}), resumed after {row[3]}, {row[4]} step(s) lost: "
            + ", ".join(f"{p} {v}" for p, v in zip(goodput.PHASES, row[5:9], strict=True))
        )
    return lines


def _goodput_html(account: goodput.Account | None) -> str:
    rows = goodput_rows(account)
    if not rows:
        return ""
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    failures = failure_rows(account)
    listed = ""
    if failures:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in ("failed at (UTC)", *FAILURE_COLUMNS))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
            for row in failures
        )
        listed = f'<table id="failures"><tr>{head}</tr>{body}</table>'
    return f'<h2>Goodput</h2><table id="goodput">{table}</table>{listed}'


def _attempts_html(run: Run) -> str:
    """The attempts table of a run that restarted (empty for one attempt)."""
    if len(run.attempts) < 2:
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in run_attempts.COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
        for row in run_attempts.table(list(run.attempts))
    )
    return f'<h2>Attempts</h2><table id="attempts"><tr>{head}</tr>{body}</table>'


def write_html(run: Run, out: Path) -> Path:
    """The self-contained HTML report."""
    figures = []
    for name, draw in _charts(run):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        draw(ax, run)
        fig.tight_layout()
        figures.append((name, base64.b64encode(_png(fig)).decode()))
    if run.traces:
        traces = timeline.stage_traces(run.log_dir)
        with tempfile.TemporaryDirectory() as scratch:
            picture = Path(scratch) / "timeline.png"
            timeline.draw(timeline.step_view(traces, timeline.pick_step(traces)), picture)
            figures.append(("timeline", base64.b64encode(picture.read_bytes()).decode()))
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary(run)
    )
    images = "".join(
        f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{data}"></figure>'
        for name, data in figures
    )
    note = (
        ""
        if run.traces
        else "<p>No trace/rank-N.jsonl: per-stage and per-rank charts left out.</p>"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>meshtrain report: {html.escape(str(run.log_dir))}</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}"
        "th{text-align:left;padding-right:2em}img{max-width:100%}</style></head><body>"
        f"<h1>meshtrain report</h1><p>{html.escape(str(run.log_dir))}</p>"
        f"<table>{rows}</table>{_attempts_html(run)}{_goodput_html(run.goodput)}{note}{images}"
        "</body></html>\n"
    )
    out.write_text(page, encoding="utf-8")
    return out


def write_png(run: Run, out: Path) -> Path:
    """Every chart in one picture, two per row."""
    charts = _charts(run)
    rows = (len(charts) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.8 * rows), squeeze=False)
    for ax, (_, draw) in zip(axes.flat, charts, strict=False):
        draw(ax, run)
    for ax in list(axes.flat)[len(charts) :]:
        ax.axis("off")
    fig.suptitle(f"meshtrain report: {run.log_dir}")
    fig.tight_layout()
    out.write_bytes(_png(fig))
    return out


def main(args: argparse.Namespace) -> int:
    """``meshtrain report DIR -o report.html``: returns the exit status."""
    try:
        run = load(Path(args.log_dir))
    except ReportError as err:
        print(f"meshtrain report: {err}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    (write_png if out.suffix.lower() == ".png" else write_html)(run, out)
    print(f"{out}: {len(run.steps)} steps, {len(run.traces)} rank trace(s)")
    for what, value in run_attempts.summary_rows(list(run.attempts)):
        print(f"{what}: {value}")
    for line in goodput_text(run.goodput):
        print(line)
    return 0
