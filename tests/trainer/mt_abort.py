"""Child process of test_gloo_abort (run by path; a unique module name).

Rank 0 blocks in an all_reduce that rank 1 (alive, asleep) never joins; a thread shuts rank 0's
gloo sockets down (:class:`meshtrain.trainer.recovery.abort.GlooSockets`); rank 0 writes how long
the collective took to raise and whether the store still answers.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.trainer.recovery import abort, rendezvous


def main(rank: int, port: int, out: Path) -> None:
    store = rendezvous.connect("127.0.0.1", port, master=rank == 0, timeout_s=60)
    sockets = abort.GlooSockets(port)
    sockets.mark()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("g0/", store),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.all_reduce(torch.ones(4))  # the pair is connected
    if rank == 1:  # alive but never joining: only an abort can free rank 0
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    shut: list[int] = []
    timer = threading.Timer(0.5, lambda: shut.append(sockets.shutdown()))
    timer.start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        error = ""
    except RuntimeError as err:
        error = str(err)[:200]
    seconds = time.monotonic() - started
    timer.join()  # the count is appended after the shutdown that freed the collective
    store.set("after-abort", "still here")
    result = {
        "seconds": seconds,
        "error": error,
        "shut": shut,
        "store": store.get("after-abort").decode(),
    }
    out.write_text(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
