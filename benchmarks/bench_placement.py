"""Benchmark of the placement planner: planning time and fabric cost vs topology-blind packing.

For jobs of 64, 1,024 and 8,192 GPUs on fragmented clusters of
512, 4,096 and 16,384 nodes (8 GPUs each, NVIDIA fabric labels: 16 nodes per
leaf, 8 leaves per spine, 8 spines per block), it times ``placement.plan`` and
compares the modelled cost and the bytes crossing each level with
``placement.first_fit`` over nodes in rack order (names follow the racks, the
best a topology-blind packer can hope for) and in random order.  It prints a
table and writes ``benchmarks/results/placement-<hostname>.json``.

Not a measurement of network traffic; the bytes are the cost
model's prediction (docs/placement.md).

    python benchmarks/bench_placement.py [--repeat 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain import placement
from meshtrain.api import loading
from meshtrain.planner import placement_request

BLOCK, SPINE, LEAF = (
    "network.topology.nvidia.com/block",
    "network.topology.nvidia.com/spine",
    "network.topology.nvidia.com/leaf",
)
GPUS_PER_NODE = 8
NODES_PER_LEAF, LEAVES_PER_SPINE, SPINES_PER_BLOCK = 16, 8, 8
CLUSTERS = (512, 4096, 16384)
JOBS = {64: (4, 2, 8), 1024: (16, 8, 8), 8192: (64, 16, 8)}
"""GPUs -> (data, pipeline, tensor)."""
SHAPE = {
    "layers": 32,
    "hidden": 4096,
    "heads": 32,
    "vocab": 32000,
    "seqLen": 4096,
    "ffnHidden": 16384,
}
"""A 7B-class GPT decoder for the bytes per step."""
BUSY_SHARE = 0.5
"""Share of nodes with some GPUs already taken (1 to 8 of them)."""


def cluster(size: int, seed: int) -> tuple[list[placement.Node], list[placement.Reservation]]:
    """A fragmented cluster in rack order, and its reservations."""
    rng = random.Random(seed)
    nodes, reservations = [], []
    per_spine = NODES_PER_LEAF * LEAVES_PER_SPINE
    per_block = per_spine * SPINES_PER_BLOCK
    for index in range(size):
        block, spine, leaf = index // per_block, index // per_spine, index // NODES_PER_LEAF
        name = f"gpu-b{block:02d}-s{spine:03d}-l{leaf:04d}-{index:05d}"
        labels = {BLOCK: f"block-{block}", SPINE: f"spine-{spine}", LEAF: f"leaf-{leaf}"}
        nodes.append(placement.Node(name, GPUS_PER_NODE, labels))
        if rng.random() < BUSY_SHARE:
            reservations.append(
                placement.Reservation(name, rng.randint(1, GPUS_PER_NODE), "other/job")
            )
    return nodes, reservations


def request(gpus: int) -> placement.PlacementRequest:
    """The benchmark job of ``gpus`` GPUs: a 7B-class model, bytes per step from the planner's model."""
    data, pipeline, tensor = JOBS[gpus]
    job = loading.parse_spec(
        {
            "parallelism": {
                "data": data,
                "pipeline": pipeline,
                "tensor": tensor,
                "microBatches": 4 * pipeline,
            },
            "resources": {"gpusPerNode": GPUS_PER_NODE},
            "model": SHAPE,
        }
    )
    return placement_request.request_from_spec(job)


def timed(function: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median wall time in seconds of ``repeat`` calls (each after a full collection), and the last result."""
    times, result = [], None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(repeat: int, seed: int) -> list[dict]:
    rows = []
    for size in CLUSTERS:
        nodes, reservations = cluster(size, seed)
        shuffled = list(nodes)
        random.Random(seed + 1).shuffle(shuffled)
        for gpus in JOBS:
            job = request(gpus)
            seconds, result = timed(
                functools.partial(placement.plan, job, nodes, reservations), repeat
            )
            row = {
                "cluster_nodes": size,
                "job_gpus": gpus,
                "pods": job.pods,
                "plan_ms": seconds * 1e3,
            }
            if isinstance(result, placement.Unschedulable):
                row.update(reason=result.reason, message=result.message)
                rows.append(row)
                continue
            blind_seconds, rack = timed(
                functools.partial(placement.first_fit, job, nodes, reservations), repeat
            )
            shuffled_result = placement.first_fit(job, shuffled, reservations)
            row.update(
                first_fit_ms=blind_seconds * 1e3,
                cost=result.cost,
                cost_first_fit_rack_order=rack.cost,
                cost_first_fit_random_order=shuffled_result.cost,
                level_bytes=dict(result.level_bytes),
                level_bytes_first_fit_rack_order=dict(rack.level_bytes),
                domains_used=dict(result.domains_used),
                domains_used_first_fit_rack_order=dict(rack.domains_used),
            )
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    header = (
        f"{'nodes':>6} {'GPUs':>5} {'plan ms':>8} {'ff ms':>6}  {'cost/ff(rack)':>13} {'cost/ff(rand)':>13}"
        f"  {'GB/step block/spine/leaf plan':>30}  {'ff(rack)':>22}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "reason" in row:
            lines.append(
                f"{row['cluster_nodes']:>6} {row['job_gpus']:>5} {row['plan_ms']:>8.1f}  {row['reason']}"
            )
            continue
        plan_gb = "/".join(f"{row['level_bytes'][key] / 1e9:.0f}" for key in (BLOCK, SPINE, LEAF))
        rack_gb = "/".join(
            f"{row['level_bytes_first_fit_rack_order'][key] / 1e9:.0f}"
            for key in (BLOCK, SPINE, LEAF)
        )
        lines.append(
            f"{row['cluster_nodes']:>6} {row['job_gpus']:>5} {row['plan_ms']:>8.1f} {row['first_fit_ms']:>6.1f}"
            f"  {row['cost'] / row['cost_first_fit_rack_order']:>13.3f} {row['cost'] / row['cost_first_fit_random_order']:>13.3f}"
            f"  {plan_gb:>30}  {rack_gb:>22}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed calls per case; the median is reported"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the cluster fragmentation")
    args = parser.parse_args(argv)
    rows = run(args.repeat, args.seed)
    print(table(rows))
    settings = {
        "repeat": args.repeat,
        "seed": args.seed,
        "busy_share": BUSY_SHARE,
        "shape": SHAPE,
        "jobs": JOBS,
    }
    out = machine.write_results("placement", {"settings": settings, "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
