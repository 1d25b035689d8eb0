"""The fused, token-chunked LM loss equals the plain one (value and gradients) and never holds the full logits.

The reference is ``F.cross_entropy`` of the whole logits (``hidden @ W.T``),
the loss the trainer used before; the vocabulary-parallel case is in
:mod:`mt_layer_workers` (it needs a tensor-parallel group).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.planner import memory
from meshtrain.trainer.parallel import loss
from meshtrain.trainer.telemetry import live_bytes


def _inputs(n: int, hidden: int, vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator) * 0.3
    t = torch.randint(0, vocab, (n,), generator=generator)
    return h, w, t


def _plain(h, w, t, scale):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    value = F.cross_entropy((h @ w.t()).float(), t)
    (value * scale).backward()
    return value.detach(), h.grad, w.grad


def _chunked(h, w, t, scale, chunk, fused=None, vocab=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    value = loss.linear_cross_entropy(h, w, t, chunk=chunk, fused=fused, vocab=vocab)
    (value * scale).backward()
    return value.detach(), h.grad, w.grad


ARITHMETIC = {"eager": None, "fused": loss.FusedChunkMath()}
"""The chunk arithmetic of the loss without and with ``training.compile`` (here uncompiled: the
same functions inductor fuses; ``benchmarks/test_compile_equivalence.py`` trains through the
compiled ones)."""


@pytest.mark.parametrize("arithmetic", ARITHMETIC)
@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_loss_in_fp32(chunk, arithmetic):
    h, w, t = _inputs(37, 16, 50)
    want = _plain(h, w, t, 0.25)
    got = _chunked(h, w, t, 0.25, chunk, ARITHMETIC[arithmetic])
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arithmetic", ARITHMETIC)
def test_padding_rows_of_the_head_are_no_tokens(arithmetic):
    """Rows past ``vocab`` (a padded vocabulary's) get no probability and no gradient."""
    h, w, t = _inputs(37, 16, 50, seed=3)
    real = 41
    padded = torch.cat([w[:real], torch.randn(50 - real, 16)])
    want = _plain(h, w[:real], t % real, 1.0)
    got = _chunked(h, padded, t % real, 1.0, 7, ARITHMETIC[arithmetic], vocab=real)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2][:real], want[2], rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(got[2][real:]) == 0


@pytest.mark.parametrize("arithmetic", ARITHMETIC)
def test_chunked_loss_under_bf16_autocast_matches_the_plain_autocast_loss(arithmetic):
    h, w, t = _inputs(64, 32, 96, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _plain(h, w, t, 1.0)
        got = _chunked(h, w, t, 1.0, 16, ARITHMETIC[arithmetic])
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], want[1:]):  # bf16 matmuls: agreement to bf16 precision
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_no_full_logits_are_ever_alive():
    n, vocab = 256, 4096
    h, w, t = _inputs(n, 8, vocab, seed=2)
    logits_bytes = n * vocab * 4
    peaks = {}
    for name, run in (
        ("plain", lambda: _plain(h, w, t, 1.0)),
        ("chunked", lambda: _chunked(h, w, t, 1.0, 16)),
    ):
        with live_bytes.LiveBytes() as tracker:
            run()
        peaks[name] = tracker.peak
    assert peaks["plain"] >= logits_bytes  # the tracker sees the plain loss's logits
    assert peaks["chunked"] < logits_bytes / 4, peaks


def test_the_planner_sizes_the_same_chunks_as_the_trainer():
    assert memory.LOSS_CHUNK_BYTES == loss.CHUNK_BYTES


def test_compiled_arithmetic_traces_each_function_at_most_twice_with_a_static_vocabulary():
    """Three batch sizes (chunks of 13 and 12, 13 and 12, 14 tokens) and an evaluation: each of the three functions
    is traced for the first length and once more with the token dimension dynamic, which then
    serves every length; the vocabulary's size stays a constant of the graph.  (A graph per
    length would reach dynamo's recompile limit, past which a function runs uncompiled.)"""
    traced: list[torch.fx.GraphModule] = []

    def counting(graph: torch.fx.GraphModule, inputs: list) -> object:
        traced.append(graph)
        return graph.forward

    torch._dynamo.reset()
    fused = loss.FusedChunkMath.compiled(counting)
    for tokens in (37, 50, 70):
        h, w, t = _inputs(tokens, 16, 50)
        want = _plain(h, w, t, 1.0)
        got = _chunked(h, w, t, 1.0, 16, fused)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss.linear_cross_entropy(h, w, t, chunk=16, fused=fused)
    assert len(traced) == 2 * 3, [g.code for g in traced]
    for graph in traced:
        inputs = [n.meta["example_value"] for n in graph.graph.nodes if n.op == "placeholder"]
        [logits] = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 2]
        assert type(logits.shape[1]) is int and logits.shape[1] == 50  # not a symbol


@pytest.mark.parametrize(("n", "chunk"), [(1, 1), (7, 3), (37, 16), (64, 16), (16384, 1334)])
def test_balanced_chunks_cover_the_tokens_in_as_many_chunks_within_one_token(n, chunk):
    bounds = loss.balanced_chunks(n, chunk)
    assert len(bounds) == -(-n // chunk)  # as many as the planner counts (memory.loss_chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = {hi - lo for lo, hi in bounds}
    assert max(lengths) <= chunk and max(lengths) - min(lengths) <= 1
