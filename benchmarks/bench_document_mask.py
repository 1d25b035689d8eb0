"""Benchmark: a training step's forward and backward with ``training.documentMask`` against without, side by side.

The ``tiny`` and ``llama-tiny`` presets (batch 8, fp32 on a CPU, bf16 autocast on a GPU) on
windows of documents of mean length 25, once causal (``is_causal``) and once with the
document mask and positions (:mod:`meshtrain.trainer.models.documents`), alternating
repetition by repetition so machine noise hits both alike; the mask's construction is timed
apart.  On a GPU the attention core alone is also timed with FlexAttention's block mask
(compiled), the alternative docs/trainer.md weighs (its backward does not run on a CPU).
Writes ``benchmarks/results/document_mask-<host>.json``.

    python benchmarks/bench_document_mask.py [--repeats 30] [--device cpu|cuda]
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
from meshtrain.api.spec import model as api_model
from meshtrain.trainer.models import documents, gpt, llama

EOS = 0
BATCH = 8
MEAN_DOCUMENT = 25


def _tokens(config: gpt.GPTConfig, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, config.vocab, (BATCH, config.seq_len), generator=generator)
    ends = torch.rand(BATCH, config.seq_len, generator=generator) < 1 / MEAN_DOCUMENT
    return tokens.masked_fill(ends, EOS).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _seconds(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    begun = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - begun


def measure(preset: str, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of a causal and a masked step of ``preset``, and of building the mask."""
    config = gpt.GPTConfig.from_shape(api_model.ModelSpec(preset=preset).shape())
    model = llama.build(config, seed=0).to(device)
    tokens = _tokens(config, device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # attention's queries

    def step(masked: bool) -> Callable[[], None]:
        def run() -> None:
            docs = documents.of_tokens(tokens, EOS, dtype) if masked else None
            with autocast:
                logits = model(tokens, documents=docs)
            logits.float().logsumexp(-1).mean().backward()

        return run

    steps = {"causal": step(False), "masked": step(True)}
    for run in steps.values():
        run()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, run in steps.items():
            seconds[name].append(_seconds(run, device))
    build = [
        _seconds(lambda: documents.of_tokens(tokens, EOS, dtype), device) for _ in range(repeats)
    ]
    causal, masked = (statistics.median(seconds[name]) for name in steps)
    return {
        "seq_len": config.seq_len,
        "batch": BATCH,
        "causal_seconds": causal,
        "masked_seconds": masked,
        "masked_over_causal": masked / causal,
        "mask_build_seconds": statistics.median(build),
    }


def flex_core(repeats: int, seq: int = 8192, heads: int = 16, head_dim: int = 128) -> dict:
    """GPU only: the attention core, SDPA with the additive mask against FlexAttention's block mask."""
    from torch.nn.attention import flex_attention as flex  # noqa: PLC0415 - GPU path only

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 1000, (1, seq), generator=generator)
    tokens[torch.rand(1, seq, generator=generator) < 1 / 512] = EOS
    tokens = tokens.to(device)
    doc = documents.document_index(tokens, EOS)

    def same_document(b, h, q, k):  # noqa: ANN001, ANN202 - FlexAttention's mask_mod signature
        return (doc[b, q] == doc[b, k]) & (k <= q)

    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
    q.requires_grad_()
    compiled = torch.compile(flex.flex_attention)

    def sdpa() -> None:
        mask = documents.of_tokens(tokens, EOS, torch.bfloat16).mask
        gpt.attend(q, q, q, recompute=False, mask=mask).sum().backward()  # the pinned kernels

    def flexed() -> None:
        block = flex.create_block_mask(same_document, 1, None, seq, seq, device="cuda")
        compiled(q, q, q, block_mask=block).sum().backward()

    for run in (sdpa, flexed):
        run()
    times = {"sdpa_mask": [], "flex_block_mask": []}
    for _ in range(repeats):
        times["sdpa_mask"].append(_seconds(sdpa, device))
        times["flex_block_mask"].append(_seconds(flexed, device))
    return {"seq_len": seq, **{k: statistics.median(v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one rank's share of a small machine
    rows = {}
    print(f"{'preset':<12} {'causal ms':>10} {'masked ms':>10} {'ratio':>6} {'mask build ms':>14}")
    for preset in ("tiny", "llama-tiny"):
        row = measure(preset, args.repeats, device)
        rows[preset] = row
        print(
            f"{preset:<12} {row['causal_seconds'] * 1e3:>10.2f} {row['masked_seconds'] * 1e3:>10.2f} "
            f"{row['masked_over_causal']:>6.3f} {row['mask_build_seconds'] * 1e3:>14.3f}"
        )
    if device.type == "cuda":
        rows["attention core, seq 8192"] = flex_core(max(3, args.repeats // 10))
        print(rows["attention core, seq 8192"])
    path = machine.write_results(
        "document_mask", {"device": args.device, "repeats": args.repeats, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
