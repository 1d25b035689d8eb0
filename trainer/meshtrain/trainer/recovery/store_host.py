"""``python -m meshtrain.trainer.recovery.store_host``: the job's rendezvous store in a pod of its
own (``runPolicy.recovery.rendezvousStore: dedicated``).

It hosts the ``TCPStore`` that every supervisor and worker of one gang attempt uses, and watches
every pod's heartbeat, pod 0's included (:class:`.liveness.PodWatch`), and rank 0's progress
(:class:`.stall.StallWatch`: a hung gang meets in a new round).  So losing any trainer pod,
pod 0 too, is a round that waits for its replacement, not a gang rebuild.  Losing this pod loses
the store: the supervisors exit 75 and the operator rebuilds the gang (a new attempt, a new store).

It exits 0 once the gang is over and the others no longer need the store: rank 0 finished or the
gang was halted, or SIGTERM came (the pod is deleted: its gang is being stopped, and the stopping
ranks agree on the step of their last checkpoint through the store).  It then keeps serving until
every pod left, no pod's heartbeat moves any more, or its time is up.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from torch._C import _distributed_c10d as c10d

from meshtrain.api.spec import run_policy
from meshtrain.trainer.recovery import liveness, rendezvous, stall

LINGER_S = 15.0
"""Least time the store stays up at the gang's end for the supervisors to read it."""
STORE_TIMEOUT_S = 60.0
"""Timeout of this process's own store calls."""
QUIET_S = 3 * liveness.HEARTBEAT_S
"""At the end: no pod's heartbeat moved for this long, so no pod reads the store any more."""


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.trainer.recovery.store_host",
        description="Host one gang attempt's rendezvous store and watch its pods' heartbeats.",
    )
    parser.add_argument("--port", type=int, default=int(env("MASTER_PORT", "29500")))
    parser.add_argument("--nnodes", type=int, required=True, help="pods of the gang")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per pod")
    parser.add_argument(
        "--in-place-limit", type=int, required=True, help="in-place recoveries per gang attempt"
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=float(run_policy.Recovery().stall_timeout_seconds),
        help="seconds without progress from rank 0, every rank in the round, before the gang is "
        "taken for hung (0: never)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=float(env("PET_SHUTDOWN_TIMEOUT", "30")),
        help="seconds the store stays up after SIGTERM (the trainer pods' own)",
    )
    return parser


def _say(message: str) -> None:
    print(f"meshtrain store: {message}", file=sys.stderr, flush=True)


def serve(store: c10d.Store, args: argparse.Namespace, stop: threading.Event) -> str:
    """Watch the pods until the gang is over and they left; why it ended."""
    rendezvous.init_generation(store)
    watch = liveness.PodWatch(
        store, range(args.nnodes), args.nproc_per_node, args.in_place_limit, _say
    )
    stalls = stall.StallWatch(
        store,
        args.nnodes * args.nproc_per_node,
        args.stall_timeout,
        args.in_place_limit,
        _say,
    )
    until: float | None = None
    while True:
        watch.look()
        stalls.look()
        now = time.monotonic()
        if until is None:
            if stop.is_set():
                until, why = now + args.shutdown_timeout, "SIGTERM"
            elif store.check([rendezvous.FINISHED]):
                until, why = now + max(LINGER_S, args.shutdown_timeout), "rank 0 finished"
            elif (code := rendezvous.halted(store)) is not None:
                until, why = now + max(LINGER_S, args.shutdown_timeout), f"halted with {code}"
        if until is not None:
            left = store.add(rendezvous.DONE, 0)
            if left >= args.nnodes:
                return f"{why}; every pod left"
            if not watch.alive(QUIET_S):
                return f"{why}; no pod's heartbeat moves"
            if now >= until:
                return f"{why}; out of time"
        time.sleep(liveness.HEARTBEAT_S)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = rendezvous.connect("127.0.0.1", args.port, master=True, timeout_s=STORE_TIMEOUT_S)
    _say(f"serving {args.nnodes} pod(s) on port {args.port}")
    _say(f"exit 0: {serve(store, args, stop)}")
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # no teardown of a store server that clients may still be talking to
