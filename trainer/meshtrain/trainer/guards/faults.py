"""Fault injection for testing failure handling, driven by environment variables.

``MESHTRAIN_FAULT_INJECT=rank:step`` kills that rank before that step (exit :data:`EXIT_CODE`, no
cleanup), as a crashed GPU would; ``rank:step:kill`` sends it SIGKILL instead, as the kernel's OOM
killer would; ``rank:step:hang`` blocks it in a receive no rank ever sends to, as a GPU or link
that stopped would block its collective (its peers then block in theirs; only an abort of the
process groups frees them).  A supervised worker fails so only in generation 0: the spare that
takes its rank, or the same process in the next round, replays the step.  ``rank:step:device``
raises an uncorrectable ECC error there in every generation, as a GPU gone bad would: its
supervisor takes the GPU for bad at the second (:mod:`meshtrain.trainer.recovery.device_fault`).
``rank:step:lost`` raises the driver's words for a GPU fallen off the bus: taken for bad at once.
``MESHTRAIN_FAULT_NODE=name`` keeps the fault to a pod on that node (``MESHTRAIN_NODE_NAME``, the
node the pod was bound to), as a bad GPU fails only where it is: a replacement placed elsewhere
runs clean.
``MESHTRAIN_FAULT_SLOW=rank:factor[:step]`` makes that rank's compute about ``factor`` times as
long, as a throttled GPU would: the straggler detector's test input.  Its sleeps sit in a forward hook, so they count as compute, not as waiting.
"""

from __future__ import annotations

import collections
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

ENV = "MESHTRAIN_FAULT_INJECT"
EXIT_CODE = 17
SLOW_ENV = "MESHTRAIN_FAULT_SLOW"
NODE_ENV = "MESHTRAIN_FAULT_NODE"
"""Where set, only a pod bound to this node meets the fault of :data:`ENV`."""
OWN_COMPUTE_STEPS = 5
"""Steps of this rank's own compute whose median sizes the injected sleep."""


MODES = ("kill", "hang", "device", "lost")
"""What ``rank:step:MODE`` does instead of exiting with :data:`EXIT_CODE`."""
DEVICE_ERROR_TEXT = "CUDA error: uncorrectable ECC error encountered (injected)"
"""What a ``:device`` fault raises: torch's words for a GPU whose memory failed."""
DEVICE_LOST_TEXT = "CUDA error: GPU has fallen off the bus (injected)"
"""What a ``:lost`` fault raises: the driver's words (Xid 79) for a GPU gone."""
HANG_TAG = 7919
"""The tag of the hung rank's receive: no send of the trainer's own uses it."""


def parse(value: str | None) -> tuple[int, int] | None:
    """``"3:2"`` -> (rank 3, step 2); empty -> None; a mode after the step (``"3:2:kill"``,
    ``"3:2:hang"``, ``"3:2:device"``, ``"3:2:lost"``) parses the same."""
    if not value:
        return None
    parts = value.split(":")
    try:
        if len(parts) == 3 and parts[2] in MODES:
            parts = parts[:2]
        rank, step = (int(part) for part in parts)
    except ValueError:
        raise ValueError(
            f"{ENV}={value!r}: expected RANK:STEP[:{'|:'.join(MODES)}], e.g. 3:2"
        ) from None
    return rank, step


def maybe_fail(rank: int, step: int, generation: int = 0) -> None:
    """Die here if the fault-injection variable says so (only in ``generation`` 0; a ``:device``
    or ``:lost`` fault in every generation)."""
    value = os.environ.get(ENV)
    target = parse(value)
    if target is None or not _on_faulty_node():
        return
    if target == (rank, step) and value and value.endswith((":device", ":lost")):
        sys.stderr.write(f"{ENV}: rank {rank} meets a GPU error before step {step}\n")
        sys.stderr.flush()
        raise RuntimeError(DEVICE_LOST_TEXT if value.endswith(":lost") else DEVICE_ERROR_TEXT)
    if target == (rank, step) and generation == 0:
        if value and value.endswith(":hang"):
            _hang(rank, step)
            return
        kill = bool(value and value.endswith(":kill"))
        sys.stderr.write(
            f"{ENV}: rank {rank} dies before step {step} "
            f"(pid {os.getpid()}, {'SIGKILL' if kill else f'exit {EXIT_CODE}'})\n"
        )
        sys.stderr.flush()
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(EXIT_CODE)


def _on_faulty_node() -> bool:
    """Whether this pod's node is the one :data:`NODE_ENV` names (any node where it is unset)."""
    node = os.environ.get(NODE_ENV)
    return not node or node == os.environ.get("MESHTRAIN_NODE_NAME")


def _hang(rank: int, step: int) -> None:
    """Block in a receive from a peer that never sends (until the process groups are aborted,
    or the process-group timeout)."""
    sys.stderr.write(f"{ENV}: rank {rank} hangs before step {step} (pid {os.getpid()})\n")
    sys.stderr.flush()
    peer = (rank + 1) % dist.get_world_size()
    on_gpu = "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available()
    # NCCL takes device tensors and matches no tags (a real send of that peer may be taken: the
    # rank then hangs in its next collective instead); unmeasured, a lent machine has one GPU
    buffer = torch.empty(1, device=torch.cuda.current_device() if on_gpu else "cpu")
    dist.recv(buffer, src=peer, tag=HANG_TAG)
    if on_gpu:
        torch.cuda.synchronize()  # NCCL's receive returns at once: its kernel is what waits


def parse_slow(value: str | None) -> tuple[int, float, int] | None:
    """``"1:1.5"`` -> (rank 1, factor 1.5, from step 1); ``"1:1.5:40"`` from step 40; empty -> None."""
    if not value:
        return None
    try:
        parts = value.split(":")
        if len(parts) not in (2, 3):
            raise ValueError
        rank, factor = int(parts[0]), float(parts[1])
        start = int(parts[2]) if len(parts) == 3 else 1
    except ValueError:
        raise ValueError(f"{SLOW_ENV}={value!r}: expected RANK:FACTOR[:STEP], e.g. 1:1.5") from None
    if factor < 1:
        raise ValueError(f"{SLOW_ENV}={value!r}: the factor must be at least 1")
    return rank, factor, start


def slow_down(
    chunks: Sequence[torch.nn.Module],
    rank: int,
    current_step: Callable[[], int],
    previous_compute: Callable[[], float | None],
    forwards_per_step: int,
) -> bool:
    """Hook this rank's model chunks when the slow-down variable names it; whether it did.

    Each training forward of a chunk sleeps ``(factor - 1) / forwards_per_step``
    of this rank's own compute per step, the median of its last few steps
    without the injected sleeps (``previous_compute``: the recorder's last
    ``compute_seconds``), so the step's compute grows by about ``factor``
    whatever share of it the chunks' own forward is (the loss, the backward),
    and one noisy step does not swing the sleep.
    """
    target = parse_slow(os.environ.get(SLOW_ENV))
    if target is None or target[0] != rank:
        return False
    _, factor, start = target
    injected: dict[int, float] = {}  # step -> seconds slept in it
    own: collections.deque[float] = collections.deque(maxlen=OWN_COMPUTE_STEPS)
    seen: set[int] = set()

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        step = current_step()
        last = previous_compute()
        if last is None or not torch.is_grad_enabled():
            return
        if step not in seen:  # the first forward of a step: learn the previous step's own time
            seen.add(step)
            own.append(max(last - injected.get(step - 1, 0.0), 0.0))
        if step < start:
            return
        pause = (factor - 1.0) * statistics.median(own) / forwards_per_step
        injected[step] = injected.get(step, 0.0) + pause
        time.sleep(pause)

    for chunk in chunks:
        chunk.register_forward_hook(after)
    sys.stderr.write(f"{SLOW_ENV}: rank {rank} computes {factor}x slower from step {start}\n")
    return True
