"""Document masks and epochs (``training.documentMask``, ``training.sampling``): the pure parts.

The mask, positions and squared document lengths are checked against document lists cut by a
plain loop over the ids; the epoch order against a set of every window, a resume and dp1 vs dp2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtrain.api import loading
from meshtrain.planner import comm, memory, precision, profiles
from meshtrain.planner.timing import stage_work, step_time
from meshtrain.trainer.data import batches, dataset, epochs, token_files
from meshtrain.trainer.models import documents, gpt, llama
from tests.builders import LLAMA_TINY, JobBuilder

EOS = 0


def _documents_of(row: list[int]) -> list[list[int]]:
    """A row of ids cut after every EOS: the documents it holds (a plain loop, no tensor code)."""
    docs, current = [], []
    for token in row:
        current.append(token)
        if token == EOS:
            docs.append(current)
            current = []
    return docs + ([current] if current else [])


def _rows() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(1, 50, (4, 24), generator=generator)
    rows[0, [0, 7, 8, 20]] = EOS  # a document of one token, two in a row
    rows[1, 23] = EOS  # ends on a boundary
    rows[3, :] = EOS  # every token its own document
    return rows  # row 2: one document cut by the window


def test_positions_restart_after_every_end_of_text():
    rows = _rows()
    got = documents.of_tokens(rows, EOS).positions
    for row, positions in zip(rows.tolist(), got.tolist()):
        expected = [i for doc in _documents_of(row) for i in range(len(doc))]
        assert positions == expected


def test_mask_lets_a_token_see_only_its_own_documents_past():
    rows = _rows()
    mask = documents.of_tokens(rows, EOS, torch.bfloat16).mask
    assert mask.shape == (4, 1, 24, 24) and mask.dtype == torch.bfloat16  # additive, q's dtype
    for b, row in enumerate(rows.tolist()):
        owner = [d for d, doc in enumerate(_documents_of(row)) for _ in doc]
        for q in range(24):
            for k in range(24):
                allowed = k <= q and owner[k] == owner[q]
                assert mask[b, 0, q, k].item() == (0.0 if allowed else float("-inf"))


def test_squares_sum_every_documents_squared_length():
    rows = _rows()
    expected = sum(len(doc) ** 2 for row in rows.tolist() for doc in _documents_of(row))
    assert documents.squares(rows, EOS) == expected


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_the_epoch_permutation_is_a_bijection(size):
    for key in (0, 1, 12345):
        assert sorted(epochs.permuted(i, size, key) for i in range(size)) == list(range(size))


def test_different_epochs_have_different_orders():
    order = epochs.WindowOrder.of([1000 * 8 + 1], seq_len=8, seed=7)
    first = [order.window(i) for i in range(order.size)]
    second = [order.window(order.size + i) for i in range(order.size)]
    assert sorted(first) == sorted(second) and first != second


def _sampler(sources, *, dp_rank=0, dp_size=1, micro_batch=3, micro_batches=2, seed=7):
    return batches.BatchSampler(
        sources,
        seq_len=8,
        micro_batch=micro_batch,
        micro_batches=micro_batches,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        sampling="epochs",
    )


def _files(tmp_path, lengths):
    out = []
    for i, n in enumerate(lengths):
        tokens = np.arange(n, dtype=np.uint16) + 1000 * i  # every window's first id names it
        out.append(token_files.TokenFile(path=tmp_path / f"{i}.bin", tokens=tokens, weight=1.0))
    return out


def test_every_window_once_per_epoch_across_files(tmp_path):
    files = _files(tmp_path, [8 * 20 + 1, 8 * 7 + 5, 8 * 3 + 1])  # 20 + 7 + 3 = 30 windows
    sampler = _sampler(files)  # global batch 6: five batches per epoch
    starts = {(s, o) for s, f in enumerate(files) for o in range(0, len(f.tokens) - 8, 8)}
    assert sampler.order.size == len(starts) == 30
    for epoch in range(3):
        drawn = []
        for _ in range(5):
            assert sampler.epoch_at(sampler.position) == epoch
            index = sampler.position
            sampler.next()
            drawn += sampler.windows(index)
        assert sorted(drawn) == sorted(starts)
        rows = torch.cat([sampler.global_batch_at(i) for i in range(epoch * 5, epoch * 5 + 5)])
        firsts = sorted(rows[:, 0].tolist())  # the windows' data: non-overlapping, each once
        assert firsts == sorted(int(files[s].tokens[o]) for s, o in starts)


def test_a_resume_at_step_k_draws_what_an_uninterrupted_run_draws(tmp_path):
    files = _files(tmp_path, [8 * 13 + 1])
    straight = _sampler(files)
    whole = [straight.next() for _ in range(9)]
    first = _sampler(files)
    for _ in range(4):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint record keeps it
    resumed = _sampler(files)
    resumed.load_state_dict(state)
    for expected in whole[4:]:
        got = resumed.next()
        for a, b in zip(got, expected):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_dp1_and_dp2_draw_one_global_sequence(tmp_path):
    files = _files(tmp_path, [8 * 17 + 1, 8 * 5 + 1])
    one = _sampler(files, micro_batch=4, micro_batches=2)  # global batch 8
    two = [_sampler(files, dp_rank=r, dp_size=2, micro_batch=2, micro_batches=2) for r in (0, 1)]
    for index in range(7):  # past an epoch (22 windows)
        whole = torch.cat([mb.inputs for mb in one.at(index)])
        split = torch.cat([mb.inputs for r in two for mb in r.at(index)])
        assert torch.equal(whole, split)


def test_a_resize_continues_the_order_without_repeating_or_skipping(tmp_path):
    files = _files(tmp_path, [8 * 24 + 1])  # 24 windows
    big = _sampler(files, dp_size=2, micro_batch=2, micro_batches=1)  # global batch 4
    drawn = []
    for _ in range(3):
        index = big.position
        big.next()
        drawn += big.windows(index)
    small = _sampler(files, micro_batch=3, micro_batches=1)  # dp1, global batch 3
    small.load_state_dict(big.state_dict())
    while len(drawn) < 24:
        index = small.position
        small.next()
        drawn += small.windows(index)
    assert sorted(drawn) == [(0, o) for o in range(0, 24 * 8, 8)]


def _doc_file(tmp_path, metadata):
    path = tmp_path / "docs.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(path)
    if metadata is not None:
        token_files.metadata_path(path).write_text(json.dumps(metadata))
    return path


def test_document_mask_needs_an_end_of_text_id_and_names_the_field(tmp_path):
    path = _doc_file(tmp_path, {"dtype": "uint16", "vocab": 256})
    job = loading.parse_spec(
        JobBuilder.cpu_run().training(dataset=str(path), documentMask=True).raw()
    )
    with pytest.raises(dataset.DatasetError, match=r"spec.training.documentMask: .*end-of-text"):
        dataset.check_dataset(job.training, vocab=256)
    token_files.metadata_path(path).write_text(json.dumps({"dtype": "uint16", "eos_id": 0}))
    dataset.check_dataset(job.training, vocab=256)
    assert dataset.document_end([path]) == 0


def test_document_mask_refuses_a_begin_of_text_that_is_the_end_of_text(tmp_path):
    """bos == eos with a begin-of-text before every document: each would close a document."""
    meta = {"dtype": "uint16", "eos_id": 7, "bos_id": 7, "bos_per_document": True}
    path = _doc_file(tmp_path, meta)
    with pytest.raises(dataset.DatasetError, match=r"spec.training.documentMask: .*one-token"):
        dataset.document_end([path])
    token_files.metadata_path(path).write_text(json.dumps(meta | {"bos_per_document": False}))
    assert dataset.document_end([path]) == 7  # GPT-2: one id for both, no prefix


def test_document_mask_refuses_the_byte_corpus_in_the_spec():
    with pytest.raises(ValueError, match=r"spec.training.documentMask: .*stdlib"):
        loading.parse_spec(JobBuilder.cpu_run().training(documentMask=True).raw())


def test_epochs_refuse_mixture_weights_in_the_spec():
    raw = JobBuilder.cpu_run().training(
        dataset="stdlib", sampling="epochs", datasets=[{"path": "/d/a.bin", "weight": 3.0}]
    )
    with pytest.raises(ValueError, match=r"spec.training.sampling: .*weight"):
        loading.parse_spec(raw.raw())


def test_the_planner_counts_masked_attention_as_the_trainer_counts_equal_documents():
    """Documents of the declared length: the planner's model FLOPs are the trainer's exact count."""
    h100 = profiles.get("h100-sxm")
    scheme = precision.scheme_for("bf16")
    base = JobBuilder().layout(2, 2, 1, gpus_per_node=4).model(preset="1.3b")
    full = loading.parse_spec(base.clone().raw())
    docs = loading.parse_spec(
        base.clone().training(dataset="/data/t.bin", documentMask=True, documentLength=512).raw()
    )
    shape = docs.model.shape()
    tokens = docs.global_batch * shape.seq_len
    windows = torch.full((docs.global_batch, shape.seq_len), 5)
    windows[:, 511::512] = EOS  # every window: four documents of 512 tokens
    config = gpt.GPTConfig.from_shape(shape)
    squares = docs.global_batch * (shape.seq_len // 512) * 512**2  # recounted here
    assert documents.squares(windows, EOS) == squares
    exact = gpt.training_flops(config, tokens, squares)
    planned = step_time.plan_time(docs, h100, comm.plan_comm(docs, scheme))
    assert planned.model_flops == pytest.approx(exact, rel=1e-12)
    unmasked = step_time.plan_time(full, h100, comm.plan_comm(full, scheme))
    assert planned.model_flops < unmasked.model_flops
    # the masked kernel computes every score of the window: no time saved, only MFU's count
    assert planned.step_seconds == pytest.approx(unmasked.step_seconds, rel=1e-12)
    undeclared = loading.parse_spec(
        base.clone().training(dataset="/data/t.bin", documentMask=True).raw()
    )
    assert stage_work.attention_span(undeclared) == shape.seq_len  # an upper bound


def _llama(**overrides):
    job = loading.parse_spec(JobBuilder.cpu_run().model({**LLAMA_TINY, **overrides}).raw())
    config = gpt.GPTConfig.from_shape(job.model.shape())
    return llama.build(config, seed=3), config


def test_masked_grouped_query_attention_takes_every_head_on_the_pinned_kernels(monkeypatch):
    """CUDA's memory-efficient kernel, the fused one that takes a mask, refuses ``enable_gqa``:
    the masked call gets k and v of every query head, no ``enable_gqa``, a mask in q's dtype,
    inside the pinned kernel set (here the CPU's: the memory-efficient flag is off)."""
    model, config = _llama()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        enabled = torch.backends.cuda.mem_efficient_sdp_enabled()
        calls.append((q.shape, k.shape, v.shape, kwargs, enabled))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokens = torch.randint(0, 8, (2, config.seq_len), generator=torch.Generator().manual_seed(1))
    model(tokens, documents=documents.of_tokens(tokens, EOS))
    assert len(calls) == config.layers
    for q, k, v, kwargs, efficient in calls:
        assert q[1] == k[1] == v[1] == config.heads  # 4 query heads, 2 key/value heads repeated
        assert not kwargs.get("enable_gqa", False)
        assert kwargs["attn_mask"].dtype == torch.float32
        assert not efficient  # pinned to MASKED_KERNELS["cpu"] for the call
    calls.clear()
    model(tokens)  # unmasked: grouped-query attention as before
    assert all(k[1] == 2 and kwargs["enable_gqa"] for _, k, _, kwargs, _ in calls)


def test_the_cuda_kernel_set_leaves_no_math_fallback():
    """Pinned to CUDA's masked kernels, a call neither takes fails instead of running the math
    kernel (on this CPU nothing is left: torch's dispatcher refuses)."""
    q = torch.randn(1, 2, 8, 4)
    mask = torch.zeros(1, 1, 8, 8)
    pinned = torch.nn.attention.sdpa_kernel(gpt.MASKED_KERNELS["cuda"])
    with pinned, pytest.raises(RuntimeError, match="No viable backend"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_layer_shares_one_mask_and_one_pair_of_rotary_tables(family):
    """Autograd keeps the (B, 1, T, T) mask once per micro-batch, not once per layer, and
    Llama's (B, T, hd) fp32 cos and sin once (saved tensors counted by their storage)."""
    if family == "llama":
        model, config = _llama()
    else:
        job = loading.parse_spec(JobBuilder.cpu_run().raw())
        config = gpt.GPTConfig.from_shape(job.model.shape())
        model = gpt.GPT(config, seed=3)
    batch, seq = 2, config.seq_len
    tokens = torch.randint(0, 8, (batch, seq), generator=torch.Generator().manual_seed(2))
    saved: dict[tuple[int, ...], set[int]] = {}

    def pack(t):
        saved.setdefault(tuple(t.shape), set()).add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, documents=documents.of_tokens(tokens, EOS)).sum()
    assert config.layers > 1
    assert len(saved[(batch, 1, seq, seq)]) == 1
    if family == "llama":
        tables = {
            p
            for shape, ptrs in saved.items()
            if shape == (batch, seq, config.head_dim)
            for p in ptrs
        }
        assert len(tables) == 2  # cos and sin


def _saved_bytes(model, tokens, docs) -> int:
    """Bytes autograd keeps for a forward of ``model`` (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.features(tokens, docs)
    return sum(storages.values())


def test_the_planner_counts_what_autograd_keeps_for_the_documents():
    """The memory model's documentMask bytes (one mask and one pair of rotary tables per
    micro-batch, k and v repeated per block) are what the real model's autograd keeps beyond an
    unmasked forward, measured (fp32, grouped-query Llama)."""
    model, config = _llama()
    tokens = torch.randint(0, 8, (2, config.seq_len), generator=torch.Generator().manual_seed(4))
    extra = _saved_bytes(model, tokens, documents.of_tokens(tokens, EOS)) - _saved_bytes(
        model, tokens, None
    )
    job = loading.parse_spec(JobBuilder.cpu_run().model(LLAMA_TINY).raw())
    shared, per_block = memory.document_bytes(job.model.shape(), 2, 1, precision.FP32)
    assert shared + config.layers * per_block == extra
    masked = loading.parse_spec(
        JobBuilder.cpu_run().model(LLAMA_TINY).training(dataset="/d/t.bin", documentMask=True).raw()
    )
    cpu = profiles.get("cpu")
    worst = memory.plan_memory(masked, cpu).worst.activations
    assert worst > memory.plan_memory(job, cpu).worst.activations  # counted in the plan


def test_an_epoch_resume_over_other_data_is_refused_naming_the_datasets(tmp_path):
    """The saved window count indexes one permutation: other files (or other sizes, another
    seq_len) would silently draw another order, so the resume is refused."""
    files = _files(tmp_path, [8 * 13 + 1, 8 * 4 + 1])
    first = _sampler(files)
    for _ in range(3):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    _sampler(files).load_state_dict(state)  # the same data: accepted
    for other in ([8 * 14 + 1, 8 * 4 + 1], [8 * 4 + 1, 8 * 13 + 1], [8 * 13 + 1]):
        with pytest.raises(ValueError, match=r"spec.training.datasets .*new checkpoint.path"):
            _sampler(_files(tmp_path, other)).load_state_dict(state)
    older = {k: v for k, v in state.items() if not k.startswith("order_") and k != "seq_len"}
    _sampler(_files(tmp_path, [8 * 14 + 1])).load_state_dict(older)  # no record: as before


def test_the_mask_rows_are_aligned_for_the_memory_efficient_kernel():
    """A window of 30 tokens: rows stride 32 keys, so CUDA's kernel takes the mask as it is."""
    tokens = torch.randint(0, 8, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = documents.of_tokens(tokens, EOS).mask
    assert mask.shape == (2, 1, 30, 30) and mask.stride(-2) % documents.MASK_ALIGNMENT == 0
    q = torch.randn(2, 2, 30, 4)
    dense = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.contiguous())
    torch.testing.assert_close(gpt.attend(q, q, q, recompute=False, mask=mask), dense)
