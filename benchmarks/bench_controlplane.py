"""Control-plane fixture start-up time with warm binaries (target: under 10 s).

Starts etcd + kube-apiserver (and once more with scheduler and
controller-manager) ``--repeat`` times, prints the median and writes
benchmarks/results/controlplane-<host>.json with the load average seen.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain.sandbox import controlplane

TARGET_SECONDS = 10.0


def startup_seconds(full: bool) -> float:
    """Wall time of one ``start()``; the control plane is stopped afterwards."""
    plane = controlplane.ControlPlane(with_scheduler=full, with_controller_manager=full)
    try:
        plane.start()
        return plane.startup_seconds
    finally:
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=3, help="starts per variant; the median is reported"
    )
    args = parser.parse_args(argv)
    rows = []
    for full in (False, True):
        times = [startup_seconds(full) for _ in range(args.repeat)]
        rows.append(
            {
                "components": "all four" if full else "etcd + kube-apiserver",
                "seconds": times,
                "median_seconds": statistics.median(times),
                "load_average": os.getloadavg(),
            }
        )
    print(f"{'components':<24} {'median s':>9}   target < {TARGET_SECONDS:.0f} s")
    for row in rows:
        print(
            f"{row['components']:<24} {row['median_seconds']:>9.2f}   load {row['load_average'][0]:.1f}"
        )
    out = machine.write_results("controlplane", {"target_seconds": TARGET_SECONDS, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
