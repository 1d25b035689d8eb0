"""Run every benchmark script (``python -m benchmarks [NAME ...]``).

Each ``bench_*.py`` is a standalone script that prints its own table and
writes ``benchmarks/results/<name>-<host>.json``; this runner only sequences
them and reports which failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SANDBOX = {"bench_faults"}
"""Benchmarks that bring up the sandbox (root, images built and imported): run only when named."""


def main(argv: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(name in s.stem for name in argv)]
    else:
        scripts = [s for s in scripts if s.stem not in SANDBOX]
    failed = []
    for script in scripts:
        print(f"\n=== {script.stem} ===", flush=True)
        started = time.perf_counter()
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(
            f"--- {script.stem}: exit {code} after {time.perf_counter() - started:.1f}s", flush=True
        )
        if code:
            failed.append(script.stem)
    print(
        f"\n{len(scripts) - len(failed)} of {len(scripts)} benchmarks completed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
