"""Draws dashboard panels from a live Prometheus with matplotlib, where no Grafana is at hand.

    python dashboards/render.py --prometheus URL --var namespace=NS --var trainingjob=JOB \\
        [--dashboard meshtrain-training] [--panel TITLE ...] [--minutes 10] -o panels.png

A time-series panel becomes its targets' range queries drawn as lines (legends
filled from the series' labels, thresholds as dashed lines); a stat panel
becomes its last value in the threshold's colour.  Multi-select variables not
given default to ``.*`` (Grafana's "All").  The telemetry tests draw panels of
a real run with it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend must be chosen first

HERE = Path(__file__).resolve().parent
SCALES = {
    "percentunit": (100.0, "%"),
    "percent": (1.0, "%"),
    "bytes": (2.0**-20, "MiB"),
    "none": (1.0, ""),
}
"""Grafana unit -> (factor, axis label); others are drawn as they are, labelled with the unit."""


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    """The matrix of a range query (2 s resolution)."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "2"})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as answer:
        body = json.load(answer)
    if body.get("status") != "success":
        raise ValueError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Template variables and ``$__rate_interval`` replaced; unknown ones become ``.*``."""
    values = {"__rate_interval": "10s", **values}
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: values.get(m.group(1), ".*"), expr)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def _threshold_colour(panel: dict, value: float) -> str:
    colour = "black"
    for step in panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", []):
        if step["value"] is None or value >= step["value"]:
            colour = step["color"]
    return colour


def draw_panel(
    ax: Any, panel: dict, url: str, values: dict[str, str], start: float, end: float
) -> int:
    """Draw one panel on ``ax``; returns how many series it drew."""
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    factor, label = SCALES.get(unit, (1.0, unit.removeprefix("suffix:").strip()))
    drawn = 0
    ax.set_title(panel["title"], fontsize=10)
    for target in panel["targets"]:
        for series in query_range(url, substitute(target["expr"], values), start, end):
            times = [float(t) - end for t, _ in series["values"]]
            points = [float(v) * factor for _, v in series["values"]]
            if panel["type"] == "stat":
                ax.text(
                    0.5,
                    0.45,
                    f"{points[-1]:,.3g} {label}",
                    ha="center",
                    va="center",
                    fontsize=20,
                    color=_threshold_colour(panel, points[-1] / factor),
                    transform=ax.transAxes,
                )
                ax.plot(times, points, color="#cccccc")
                ax.set_yticks([])
            else:
                ax.plot(times, points, label=legend(target["legendFormat"], series["metric"]))
            drawn += 1
    if panel["type"] != "stat":
        steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
        for step in steps if panel["fieldConfig"]["defaults"].get("custom") else []:
            if step["value"] is not None:
                ax.axhline(
                    step["value"] * factor, color=step["color"], linestyle="--", linewidth=0.8
                )
        ax.set_ylabel(label)
        ax.set_xlabel("seconds before the end")
        if drawn:
            ax.legend(fontsize=7)
    return drawn


def render(
    url: str,
    dashboard: str,
    titles: list[str],
    values: dict[str, str],
    out: Path,
    *,
    end: float | None = None,
    minutes: float = 10.0,
) -> dict[str, int]:
    """Draw the panels named ``titles`` (all when empty) into one PNG; returns series drawn per panel."""
    board = json.loads((HERE / f"{dashboard}.json").read_text())
    panels = [
        p for p in board["panels"] if p["type"] != "row" and (not titles or p["title"] in titles)
    ]
    missing = set(titles) - {p["title"] for p in panels}
    if missing:
        raise ValueError(f"no panel {sorted(missing)} on {dashboard}")
    end = end or time.time()
    columns = min(3, len(panels))
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    drawn = {
        p["title"]: draw_panel(ax, p, url, values, end - 60 * minutes, end)
        for ax, p in zip(axes.flat, panels, strict=False)
    }
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{board['title']}  ({', '.join(f'{k}={v}' for k, v in values.items())})")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--dashboard", default="meshtrain-training", help="JSON file stem")
    parser.add_argument("--panel", action="append", default=[], help="panel title (repeatable)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--minutes", type=float, default=10.0, help="time range before now")
    parser.add_argument("-o", "--output", default="panels.png")
    args = parser.parse_args(argv)
    values = dict(v.split("=", 1) for v in args.var)
    drawn = render(
        args.prometheus, args.dashboard, args.panel, values, Path(args.output), minutes=args.minutes
    )
    print(f"{args.output}: " + ", ".join(f"{t} ({n} series)" for t, n in drawn.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
