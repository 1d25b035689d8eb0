"""The GPT model on its own: shapes, causality, its accounting."""

from __future__ import annotations

import torch

from meshtrain.trainer.models import gpt

CONFIG = gpt.GPTConfig(vocab=256, seq_len=16, layers=2, hidden=32, heads=4, ffn_hidden=128)


def test_forward_gives_logits_per_position():
    torch.manual_seed(0)
    logits = gpt.GPT(CONFIG)(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = gpt.GPT(CONFIG)
    ids = torch.randint(0, 256, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_weights_and_another_seed_others():
    a, b, c = gpt.GPT(CONFIG, seed=3), gpt.GPT(CONFIG, seed=3), gpt.GPT(CONFIG, seed=4)
    for (name, p), (_, q), (_, r) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters()
    ):
        assert torch.equal(p, q), name
        assert p.dim() == 1 or not torch.equal(p, r), name


def test_a_meta_model_materialized_equals_the_eager_one():
    eager = gpt.GPT(CONFIG, seed=5)
    with torch.device("meta"):
        lazy = gpt.GPT(CONFIG, seed=5)
    assert all(p.is_meta for p in lazy.parameters())
    del lazy.blocks["0"]  # a pipeline stage keeps only some blocks
    gpt.materialize(lazy)
    eager_params = dict(eager.named_parameters())
    for name, param in lazy.named_parameters():
        assert torch.equal(param, eager_params[name]), name
    assert torch.equal(gpt.dense_value(lazy, "head.weight", lazy.head.weight), eager.head.weight)


def test_materialising_on_several_threads_gives_the_values_drawn_one_at_a_time():
    """Each parameter's own generator makes the values independent of the threads' order."""
    with torch.device("meta"):
        lazy = gpt.GPT(CONFIG, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        gpt.materialize(lazy)
    finally:
        torch.set_num_threads(threads)
    for name, param in lazy.named_parameters():
        drawn = gpt.initial_value(CONFIG, 7, gpt.logical_name(CONFIG, name), param.shape)
        assert torch.equal(param, drawn), name


def test_initial_values_follow_the_gpt2_recipe():
    model = gpt.GPT(CONFIG, seed=0)
    residual = model.blocks["0"].attn.proj.weight
    assert abs(residual.std().item() - 0.02 / (2 * CONFIG.layers) ** 0.5) < 0.002
    assert abs(model.head.weight.std().item() - 0.02) < 0.002
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_param_count_matches_formula():
    model = gpt.GPT(CONFIG)
    assert model.num_params() == gpt.dense_param_count(CONFIG)
    embeddings = CONFIG.vocab * CONFIG.hidden + CONFIG.seq_len * CONFIG.hidden
    assert model.num_params(include_embeddings=False) == gpt.dense_param_count(CONFIG) - embeddings


def test_flops_per_token_is_6n_plus_attention():
    n = gpt.dense_param_count(CONFIG, include_embeddings=False)
    attention = 12 * CONFIG.layers * CONFIG.seq_len * CONFIG.hidden
    assert gpt.flops_per_token(CONFIG) == 6 * n + attention
    assert gpt.flops_per_token(CONFIG, causal_half=True) == 6 * n + attention / 2


def test_known_size_of_gpt2_small_shape():
    # GPT-2 small (tied embeddings) has 124M; meshtrain's head is untied, so +V*H.
    config = gpt.GPTConfig(
        vocab=50257, seq_len=1024, layers=12, hidden=768, heads=12, ffn_hidden=3072
    )
    with_tied_head = gpt.dense_param_count(config) - 50257 * 768
    # GPT-2 also has biases (~0.1M) that meshtrain leaves out.
    assert abs(with_tied_head - 124_439_808) < 0.2e6


def test_stage_without_embedding_takes_hidden_state():
    model = gpt.GPT(CONFIG)
    model.tok_emb = model.pos_emb = None
    model.norm = model.head = None
    out = model(torch.randn(2, 16, 32))
    assert out.shape == (2, 16, 32)
