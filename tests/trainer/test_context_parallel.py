"""Context parallelism's pieces: the load-balanced split of a sequence, and ring attention against
torch's own ``scaled_dot_product_attention`` over the whole sequence (output and q, k, v gradients,
fp64 to 1e-12, and fp32 / bf16 with that dtype's tolerance; grouped-query heads; causal, or with
one device's document mask) on real gloo rings of 2 and 4 ranks.  The trainer's layouts against one
device are in test_equivalence.py."""

from __future__ import annotations

import mt_context_workers
import mt_harness
import pytest
import torch

from meshtrain.trainer.parallel import context


def test_each_rank_holds_chunk_k_and_its_mirror_and_every_token_once():
    tokens = torch.arange(2 * 16).view(2, 16)
    size = 4
    pieces = [context.shard(tokens, rank, size) for rank in range(size)]
    assert pieces[0][0].tolist() == [0, 1, 14, 15]  # chunks 0 and 7 of 8
    assert pieces[3][0].tolist() == [6, 7, 8, 9]  # chunks 3 and 4
    held = torch.cat(pieces, dim=1).sort(dim=1).values
    assert torch.equal(held, tokens)
    for rank in range(size):  # a token's position is its index in the whole sequence
        positions = context.global_positions(rank, size, 4, torch.device("cpu"))
        assert torch.equal(positions, pieces[rank][0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "heads", "kv_heads", "masked"),
    [(2, 4, 4, False), (4, 4, 2, False), (2, 4, 2, True), (4, 2, 2, True)],
    ids=["cp2", "cp4-gqa", "cp2-gqa-documents", "cp4-documents"],
)
def test_ring_attention_equals_whole_sequence_sdpa(world, heads, kv_heads, masked):
    results = mt_harness.run_distributed(
        mt_context_workers.ring_vs_sdpa, world, heads, kv_heads, 8 * world, masked
    )
    for rank_result in results:
        out, ref = rank_result["out"]
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for name, (grad, ref_grad) in zip("qkv", rank_result["grads"]):
            torch.testing.assert_close(
                grad, ref_grad, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}"
            )
        # keys and values: world - 1 transfers forward and again in backward; their gradients: world
        assert rank_result["transfers"] == 3 * world - 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "tolerance", "masked"),
    [
        (torch.float32, 1e-5, False),
        (torch.bfloat16, 2e-2, False),
        (torch.bfloat16, 2e-2, True),
    ],
    ids=["fp32", "bf16", "bf16-documents"],
)
def test_ring_attention_in_training_dtypes_is_close_to_whole_sequence_sdpa(
    dtype, tolerance, masked
):
    """The same ring against torch's own SDPA in the same dtype: the ring merges per-tile outputs
    rounded to ``dtype`` (as TorchTitan's does), so the two agree to that dtype's rounding."""
    results = mt_harness.run_distributed(
        mt_context_workers.ring_vs_sdpa, 2, 4, 2, 32, masked, 0, dtype
    )
    for rank_result in results:
        out, ref = rank_result["out"]
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
        for name, (grad, ref_grad) in zip("qkv", rank_result["grads"]):
            torch.testing.assert_close(
                grad, ref_grad, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"d{n}: {m}"
            )
