"""``training.compile``: ``torch.compile`` of every transformer block, with a fallback to eager.

All blocks run the same code, so dynamo builds one graph for every layer (as TorchTitan compiles
each block), fusing the memory-bound work between the matmuls.  Tensor-parallel region boundaries
are graph breaks, so every collective stays a timed call of meshtrain's own.  Where the backend
cannot compile here (:func:`compile_problem`) the blocks stay eager; frames that fall back later
are counted (:class:`FallbackWatch`).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from meshtrain.trainer.models import gpt


@functools.cache
def compile_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run here (None: it can), from a tiny forward and backward."""
    try:
        probe = torch.compile(lambda x: F.gelu(x * 2.0).sum())
        x = torch.ones(8, device=device_type, requires_grad=True)
        probe(x).backward()
    except Exception as err:  # noqa: BLE001 - any backend failure means: stay eager
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


BACKEND = "inductor"
"""What ``torch.compile`` compiles the blocks and the loss's arithmetic with (tests that only check
tracing swap in a cheaper one)."""


def apply_compile(chunks: list[gpt.GPT], device: torch.device) -> bool:
    """Compile every block's forward in place; returns whether they were compiled.

    The forward, not the module's call: hooks on a block stay eager.  Under
    ZeRO-3 those are FSDP2's unshard before the forward and reshard after it,
    so the compiled graph is the block's compute on its gathered weights (as
    when TorchTitan compiles each block before ``fully_shard`` wraps it) and
    every gather and reduce-scatter stays FSDP2's own, timed call.
    """
    problem = compile_problem(device.type)
    if problem is not None:
        print(
            f"training.compile: not compiling on {device.type} ({problem}); "
            "running the blocks eagerly",
            file=sys.stderr,
        )
        return False
    torch._dynamo.config.suppress_errors = True  # a graph the backend rejects runs eagerly
    for chunk in chunks:
        for block in chunk.blocks.values():
            block.forward = torch.compile(block.forward, backend=BACKEND)
    return True


def _failed_frames() -> int:
    frames = torch._dynamo.utils.counters["frames"]
    return int(frames["total"] - frames["ok"])


class FallbackWatch:
    """Frames dynamo failed to compile in this process since the watch was made.

    Under ``suppress_errors`` each of them ran eagerly, silently but for
    dynamo's log; the counters are the process's, so two engines in one
    process see each other's.
    """

    def __init__(self) -> None:
        self._before = _failed_frames()
        self._said = False

    def count(self) -> int:
        return _failed_frames() - self._before

    def say_once(self) -> None:
        """Print on stderr, the first time there is one, that compiled frames ran eagerly."""
        if not self._said and (failed := self.count()):
            self._said = True
            print(
                f"training.compile: {failed} compiled frame(s) failed to compile and ran "
                "eagerly (dynamo's warnings above say why)",
                file=sys.stderr,
            )
