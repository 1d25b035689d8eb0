"""CLI start-up: wall time of ``meshtrain --help``, ``--version`` and ``validate``, against the floor.

Issue 37 asks that ``meshtrain --help`` and ``meshtrain validate`` start in under 1 s on this
machine (:data:`TARGET_S`).  Each command runs ``--runs`` times as a fresh process (the installed
console script, as a user types it); the table gives the median and the spread, side by side with
the interpreter's own start (``python -c pass``, the floor) and with the CLI as it was before it
became light (:data:`BEFORE`: its main.py imported the operator's flags, and with them kopf's side
and the Kubernetes client, for every command).  The 1-minute load average before and after is
recorded: the machine is shared, and a loaded host stretches every row alike.

It writes ``benchmarks/results/cli_startup-<host>.json`` and exits 1 when a median misses the target.

Run: ``python benchmarks/bench_cli_startup.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "manifests/examples/tiny-cpu.yaml"
TARGET_S = 1.0
"""Issue 37's target for ``--help`` and ``validate`` (median wall seconds)."""
TARGETED = ("meshtrain --help", f"meshtrain validate {EXAMPLE}")
BEFORE = "fe853d8"
"""The commit whose meshtrain/cli/main.py is the CLI before the light install (run from this tree)."""


def _meshtrain() -> list[str]:
    """The console script next to this interpreter (the venv's), else ``python -m``."""
    script = Path(sys.executable).with_name("meshtrain")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "meshtrain.cli.main"]


def _before(workdir: Path) -> list[str] | None:
    """``python OLD_MAIN``: the pre-light main.py from git, or None outside a git checkout."""
    if shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "show", f"{BEFORE}:meshtrain/cli/main.py"], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode:
        return None
    old = workdir / "main_before.py"
    old.write_text(out.stdout)
    return [sys.executable, str(old)]


def commands(workdir: Path) -> dict[str, list[str]]:
    """Row name -> command line, in the table's order."""
    cli = _meshtrain()
    rows = {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        "meshtrain --help": [*cli, "--help"],
        "meshtrain --version": [*cli, "--version"],
        f"meshtrain validate {EXAMPLE}": [*cli, "validate", EXAMPLE],
    }
    old = _before(workdir)
    if old is not None:
        rows[f"before ({BEFORE}) meshtrain --help"] = [*old, "--help"]
        rows[f"before ({BEFORE}) meshtrain validate"] = [*old, "validate", EXAMPLE]
    return rows


def timed(command: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh runs of ``command`` (one untimed first: the page cache)."""
    subprocess.run(command, cwd=ROOT, capture_output=True, check=True)
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, capture_output=True, check=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="timed runs per command")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in commands(Path(tmp)).items():
            seconds = timed(command, args.runs)
            rows.append(
                {
                    "command": name,
                    "median_s": statistics.median(seconds),
                    "min_s": min(seconds),
                    "max_s": max(seconds),
                    "runs": seconds,
                }
            )
    load_after = os.getloadavg()[0]
    floor = rows[0]["median_s"]
    print(f"{'command':<52} {'median':>8} {'min':>7} {'max':>7} {'x floor':>8}")
    for row in rows:
        print(
            f"{row['command']:<52} {row['median_s']:>7.3f}s {row['min_s']:>6.3f}s "
            f"{row['max_s']:>6.3f}s {row['median_s'] / floor:>7.1f}x"
        )
    missed = [r["command"] for r in rows if r["command"] in TARGETED and r["median_s"] >= TARGET_S]
    print(
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after "
        f"({os.cpu_count()} cores); target: median under {TARGET_S:g} s for "
        + " and ".join(TARGETED)
        + (f"; MISSED by {', '.join(missed)}" if missed else ": met")
    )
    path = machine.write_results(
        "cli_startup",
        {
            "target_s": TARGET_S,
            "targeted": list(TARGETED),
            "met": not missed,
            "load_average_1m": {"before": load_before, "after": load_after},
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
