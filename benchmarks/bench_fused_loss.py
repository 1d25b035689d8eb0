"""Benchmark: the LM loss's chunk arithmetic eager against compiled (``training.compile``), side by side.

:func:`meshtrain.trainer.parallel.loss.linear_cross_entropy` forward and
backward at GPT-2's vocabulary (50,304) over two chunks of tokens, once
with the eager in-place arithmetic and once with
:class:`~meshtrain.trainer.parallel.loss.FusedChunkMath` compiled by
inductor, alternating repetition by repetition so machine noise hits both
alike.  Two widths: 16, where the head's matmuls are negligible and the
time is the arithmetic between them, and 768 (the 125M preset's head),
where it is the whole loss.  ``--precision bf16`` (the default on a GPU)
runs under bf16 autocast, so the logits are bf16 and the eager arithmetic
first writes an fp32 copy of them, as in training on GPUs; ``fp32`` (the
default on a CPU) has no copy to save.  Writes
``benchmarks/results/fused_loss-<precision>-<host>.json``.

    python benchmarks/bench_fused_loss.py [--repeats 5] [--device cpu|cuda] [--precision bf16|fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain.trainer.parallel import loss

VOCAB = 50304
WIDTHS = {"arithmetic (hidden 16)": 16, "125M head (hidden 768)": 768}


def _loss_step(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    fused: loss.FusedChunkMath | None,
    precision: str,
) -> Callable[[], None]:
    device = hidden.device
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    chunk = loss.chunk_tokens(VOCAB)

    def step() -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        with autocast:
            value = loss.linear_cross_entropy(h, w, targets, chunk=chunk, fused=fused)
        value.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def _time(step: Callable[[], None]) -> float:
    begun = time.perf_counter()
    step()
    return time.perf_counter() - begun


def measure(width: int, repeats: int, device: torch.device, precision: str) -> dict[str, float]:
    tokens = 2 * loss.chunk_tokens(VOCAB)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).to(device)
    weight = (torch.randn(VOCAB, width, generator=generator) * width**-0.5).to(device)
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator).to(device)
    steps = {
        "eager": _loss_step(hidden, weight, targets, None, precision),
        "compiled": _loss_step(
            hidden, weight, targets, loss.FusedChunkMath.compiled("inductor"), precision
        ),
    }
    for step in steps.values():  # warm-up: the compiled one compiles here
        step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            seconds[name].append(_time(step))
    eager, compiled = (statistics.median(seconds[name]) for name in ("eager", "compiled"))
    return {
        "tokens": tokens,
        "hidden": width,
        "vocab": VOCAB,
        "eager_seconds": eager,
        "compiled_seconds": compiled,
        "compiled_over_eager": compiled / eager,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    rows = {}
    print(f"{'case':<26} {'tokens':>6} {'eager s':>9} {'compiled s':>10} {'ratio':>6}")
    for name, width in WIDTHS.items():
        row = measure(width, args.repeats, device, precision)
        rows[name] = row
        print(
            f"{name:<26} {row['tokens']:>6} {row['eager_seconds']:>9.4f} "
            f"{row['compiled_seconds']:>10.4f} {row['compiled_over_eager']:>6.2f}"
        )
    path = machine.write_results(
        f"fused_loss-{precision}",
        {
            "device": args.device,
            "precision": precision,
            "repeats": args.repeats,
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
