"""The operator's device inventory after a ResourceClaim changes: rebuilt from every slice and
claim (before) against the allocated set kept per claim event (after).

A cache of ``--nodes`` nodes, each publishing 8 GPUs in one ResourceSlice, with ``--claims``
allocated claims of 4 GPUs each; then ``--changes`` claim events (a claim allocated, freed or
deleted), each followed by the read a placement makes (``informer.Cache.inventory``).  *before*
times what that read cost when every claim change rebuilt the whole inventory
(``devices.inventory`` over the stores, the code before review SHOULD-FIX 12); *after* the same
events through the cache as it is.  Both end with equal inventories (checked).

It writes ``benchmarks/results/device_inventory-<host>.json``.

Run: ``python benchmarks/bench_device_inventory.py [--nodes N] [--claims N] [--changes N]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import devices

DRIVER = "gpu.sim.meshtrain.io"
CLASS = {
    "metadata": {"name": DRIVER, "resourceVersion": "1"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def _slice(node: int) -> dict[str, Any]:
    gpus = [
        {
            "name": f"gpu-{i}",
            "attributes": {"productName": {"string": "NVIDIA H200"}, "index": {"int": i}},
            "capacity": {"memory": {"value": "141Gi"}},
        }
        for i in range(8)
    ]
    spec = {
        "driver": DRIVER,
        "nodeName": f"n{node}",
        "pool": {"name": f"n{node}", "generation": 1, "resourceSliceCount": 1},
        "devices": gpus,
    }
    return {"metadata": {"name": f"n{node}-gpus", "resourceVersion": "1"}, "spec": spec}


def _claim(name: str, node: int | None, version: int) -> dict[str, Any]:
    metadata = {"name": name, "namespace": "ns", "resourceVersion": str(version)}
    if node is None:
        return {"metadata": metadata, "status": {}}
    results = [
        {"request": "gpus", "driver": DRIVER, "pool": f"n{node}", "device": f"gpu-{i}"}
        for i in range(4)
    ]
    return {"metadata": metadata, "status": {"allocation": {"devices": {"results": results}}}}


def _run(nodes: int, claims: int, changes: int, rebuild: bool) -> tuple[list[float], Any]:
    """Seconds per read after each claim change; the last inventory."""
    rng = random.Random(1)
    cache = informer.Cache(follow_devices=True)
    for node in range(nodes):
        cache.dra["resourceslices"].upsert(_slice(node))
    cache.dra["deviceclasses"].upsert(CLASS)
    for index in range(claims):
        cache.dra["resourceclaims"].upsert(_claim(f"c{index}", index % nodes, 1))
    cache.inventory()
    seconds, found = [], None
    for version in range(2, changes + 2):
        name = f"c{rng.randrange(claims)}"
        node = rng.choice([None, rng.randrange(nodes)])
        cache.dra["resourceclaims"].upsert(_claim(name, node, version))
        started = time.perf_counter()
        if rebuild:
            stores = (cache.dra[n].values() for n in ("resourceslices", "resourceclaims"))
            found = devices.inventory(*stores, cache.dra["deviceclasses"].values())
        else:
            found = cache.inventory()
        seconds.append(time.perf_counter() - started)
    return seconds, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--changes", type=int, default=50)
    args = parser.parse_args()
    before, rebuilt = _run(args.nodes, args.claims, args.changes, rebuild=True)
    after, kept = _run(args.nodes, args.claims, args.changes, rebuild=False)
    assert rebuilt == kept, "the kept inventory differs from a rebuild"
    results = {
        "nodes": args.nodes,
        "devices": args.nodes * 8,
        "claims": args.claims,
        "changes": args.changes,
        "before_ms_per_change": {
            "median": round(statistics.median(before) * 1000, 2),
            "max": round(max(before) * 1000, 2),
        },
        "after_ms_per_change": {
            "median": round(statistics.median(after) * 1000, 2),
            "max": round(max(after) * 1000, 2),
        },
    }
    print(results)
    print(machine.write_results("device_inventory", results))


if __name__ == "__main__":
    main()
