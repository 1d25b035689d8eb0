"""The operator's chaos run, as figures: faults injected, invariant violations, convergence times.

Runs ``tests/integration/operator/test_operator_chaos.py`` (a private
kube-apiserver, etcd and kube-scheduler; 32 simulated nodes of 8 GPUs; 20 jobs
of mixed sizes; the operator SIGKILLed 5 times; a taint, a cordon, a node
deleted, foreign GPU pods, failed pods and a restricted namespace) once per
seed, collects the figures each run writes (``MESHTRAIN_CHAOS_FIGURES``) and
writes ``benchmarks/results/operator_chaos-<host>.json`` with the machine and
its load average at the start (the machine may be shared: convergence times
are wall-clock on it).

    python benchmarks/bench_operator_chaos.py [--seeds 101 202 303]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import machine

REPO = pathlib.Path(__file__).resolve().parent.parent
TEST = "tests/integration/operator/test_operator_chaos.py"


def run(seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        figures = pathlib.Path(scratch) / "figures.json"
        env = {
            **os.environ,
            "MESHTRAIN_CHAOS_SEED": str(seed),
            "MESHTRAIN_CHAOS_FIGURES": str(figures),
        }
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        found = json.loads(figures.read_text()) if figures.exists() else {"seed": seed}
    found["test_passed"] = done.returncode == 0
    found["run_seconds"] = round(time.monotonic() - started, 1)
    if done.returncode != 0:
        found["test_output_tail"] = done.stdout[-2000:]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 202, 303])
    args = parser.parse_args()
    load = os.getloadavg()
    runs = []
    for seed in args.seeds:
        figures = run(seed)
        runs.append(figures)
        print(
            f"seed {seed}: passed={figures['test_passed']} kills={figures.get('operator_kills')} "
            f"faults={len(figures.get('other_faults') or [])} violations={figures.get('violations')} "
            f"settled {figures.get('settled_seconds_after_last_fault')} s after the last fault, "
            f"first Running {figures.get('first_running_seconds_after_apply')}",
            flush=True,
        )
    path = machine.write_results(
        "operator_chaos", {"load_average_at_start": [round(x, 2) for x in load], "runs": runs}
    )
    print(f"wrote {path}")
    return 0 if all(r["test_passed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
