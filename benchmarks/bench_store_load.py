"""The rendezvous store's load from the ranks' watchers, before and after the change counter.

Every rank of a gang runs a watcher thread that polls the one TCPStore the gang shares (pod 0's
supervisor or the store pod hosts it) for a new round, the halt and its pod's newer incarnation
(:class:`meshtrain.trainer.recovery.generations.Watcher`).  Before, each poll read every key
(a check and a get each); now it reads one counter and the keys only when the counter moved, or
every :data:`~meshtrain.trainer.recovery.rendezvous.FULL_READ_S`
(:class:`~meshtrain.trainer.recovery.rendezvous.ChangeGate`).

For each number of watchers, both modes side by side in one run.  The store runs in a process of
its own, as in a pod; the watchers are the real watcher code (the abort of gloo sockets left
out), each on its own client connection, as threads of this process; a probe in a third process
times a ``set`` then ``get`` meanwhile (what a joining rank or a heartbeat waits).  Reported:

- the requests the watchers sent per second while the gang was quiet, in all and per watcher;
- the probe's round trip, median and p99, while they polled;
- from :func:`~meshtrain.trainer.recovery.rendezvous.start_round` to each watcher seeing it
  (its own moment), median and slowest, over several rounds.

On a small machine the watchers' threads share its cores with the store: the rates are the
watchers' ask, and the probe's round trips include the machine's load, which both modes share.

Results: ``benchmarks/results/store_load-<host>.json``.  Run: ``python benchmarks/bench_store_load.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.trainer import launch
from meshtrain.trainer.recovery import abort, generations, rendezvous
from tests.unit.test_recovery_changes import CountingStore

QUIET_S = 10.0
ROUNDS = 3
SERVER = """
import sys
from meshtrain.trainer.recovery import rendezvous
store = rendezvous.connect("127.0.0.1", int(sys.argv[1]), master=True, timeout_s=60)
rendezvous.init_generation(store)
print("up", flush=True)
sys.stdin.read()
"""
PROBE = """
import json, sys, time
from meshtrain.trainer.recovery import rendezvous
store = rendezvous.connect("127.0.0.1", int(sys.argv[1]), master=False, timeout_s=60)
trips, end = [], time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t = time.perf_counter()
    store.set("bench/probe", "x")
    store.get("bench/probe")
    trips.append(time.perf_counter() - t)
    time.sleep(0.02)
print(json.dumps(trips))
"""


class NoSockets(abort.GlooSockets):
    """The abort left out: this benchmark measures the store, not the sockets' shutdown."""

    def shutdown(self) -> int:
        return 0


class Seen(threading.Event):
    """A watcher's ``fired``, which notes when it was set."""

    at = 0.0

    def set(self) -> None:
        self.at = time.monotonic()
        super().set()


def _watchers(port: int, count: int, calls: collections.Counter[str]) -> list[Any]:
    store = rendezvous.connect("127.0.0.1", port, master=False, timeout_s=60)
    generation = rendezvous.generation(store)
    # every pod's incarnation before any watcher, as in a gang (the supervisors take theirs, then
    # the ranks join round 0): each take bumps the counter, which running watchers would follow
    taken = [rendezvous.take_incarnation(store, rank, f"pod-{rank}") for rank in range(count)]
    started = []
    for incarnation in taken:
        assert incarnation is not None
        watcher = generations.Watcher(
            CountingStore(store, calls),  # type: ignore[arg-type]
            generation,
            NoSockets(port),
            backend="gloo",
            incarnation=incarnation,
        )
        watcher.fired = Seen()
        watcher.start()
        started.append(watcher)
    return started


def _round(port: int, count: int, calls: collections.Counter[str], quiet: bool) -> dict[str, Any]:
    store = rendezvous.connect("127.0.0.1", port, master=False, timeout_s=60)
    watchers = _watchers(port, count, calls)
    try:
        time.sleep(rendezvous.FULL_READ_S + 1)  # past every watcher's first read
        result: dict[str, Any] = {}
        if quiet:
            before, started = sum(calls.values()), time.monotonic()
            probe = subprocess.run(
                [sys.executable, "-c", PROBE, str(port), str(QUIET_S)],
                capture_output=True,
                text=True,
                check=True,
            )
            elapsed = time.monotonic() - started
            result["requests_per_s"] = (sum(calls.values()) - before) / elapsed
            result["trips"] = json.loads(probe.stdout)
        current = rendezvous.generation(store)
        failure = rendezvous.Failure("process", "bench", (0,), time.time())
        started = time.monotonic()
        assert rendezvous.start_round(store, current, failure, 10**6)
        for watcher in watchers:
            assert watcher.fired.wait(60), "a watcher missed the round"
        result["seen_s"] = [watcher.fired.at - started for watcher in watchers]
        return result
    finally:
        for watcher in watchers:
            watcher.stop()
        for watcher in watchers:
            watcher.join(5)


def run(watchers: int, every_key: bool) -> dict[str, Any]:
    port = launch.free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    original = rendezvous.ChangeGate.moved
    if every_key:  # the watcher before the counter: every key each poll
        rendezvous.ChangeGate.moved = lambda self, now=None: True  # type: ignore[method-assign]
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        calls: collections.Counter[str] = collections.Counter()
        rounds = [_round(port, watchers, calls, quiet=r == 0) for r in range(ROUNDS)]
    finally:
        rendezvous.ChangeGate.moved = original  # type: ignore[method-assign]
        server.communicate("", timeout=30)
    trips = sorted(rounds[0]["trips"])
    seen = [s for r in rounds for s in r["seen_s"]]
    return {
        "watchers": watchers,
        "mode": "every key each poll" if every_key else "change counter",
        "requests_per_s": round(rounds[0]["requests_per_s"], 1),
        "requests_per_s_per_watcher": round(rounds[0]["requests_per_s"] / watchers, 2),
        "probe_set_get_median_ms": round(statistics.median(trips) * 1e3, 3),
        "probe_set_get_p99_ms": round(trips[int(0.99 * (len(trips) - 1))] * 1e3, 3),
        "probe_trips": len(trips),
        "round_seen_median_s": round(statistics.median(seen), 3),
        "round_seen_slowest_s": round(max(seen), 3),
        "rounds": ROUNDS,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tag", default="", help="suffix of the results file's name")
    args = parser.parse_args()
    rows = []
    for watchers in args.watchers:
        for every_key in (True, False):
            row = run(watchers, every_key)
            rows.append(row)
            print(
                f"{row['watchers']:>5} watchers, {row['mode']:<20} {row['requests_per_s']:>8.0f} req/s "
                f"({row['requests_per_s_per_watcher']:.2f} each); probe set+get median "
                f"{row['probe_set_get_median_ms']:.2f} ms, p99 {row['probe_set_get_p99_ms']:.2f} ms; "
                f"round seen median {row['round_seen_median_s']:.3f} s, "
                f"slowest {row['round_seen_slowest_s']:.3f} s",
                flush=True,
            )
    path = machine.write_results(
        "store_load" + (f"-{args.tag}" if args.tag else ""),
        {
            "rows": rows,
            "watch_s": generations.WATCH_S,
            "full_read_s": rendezvous.FULL_READ_S,
            "quiet_s": QUIET_S,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
