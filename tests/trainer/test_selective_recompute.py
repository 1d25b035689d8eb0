"""Selective recompute (``training.selectiveRecompute``) changes memory, never numbers.

Against the same model without it: equal loss and gradients (the recomputed
operations are the same operations), and a lower peak of live tensor bytes
over forward and backward, for each part and both model families.  The
layouts with tensor and sequence parallelism are rows of
``test_equivalence.py`` (``*-selective``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.api.spec import model as api_model
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.telemetry import live_bytes
from tests.builders import LLAMA_TINY, TINY

PARTS = [("attention",), ("mlp",), ("attention", "mlp")]


def _config(family: str) -> gpt.GPTConfig:
    raw = LLAMA_TINY if family == "llama" else TINY
    return gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate(raw).shape())


def _train_once(family: str, parts: tuple[str, ...]) -> tuple[float, dict[str, torch.Tensor], int]:
    config = _config(family)
    model = llama.build(config, seed=3)
    gpt.set_selective_recompute(model, parts)
    tokens = torch.randint(
        0, config.vocab, (4, config.seq_len), generator=torch.Generator().manual_seed(5)
    )
    with live_bytes.LiveBytes() as tracker:
        tracker.track(model.parameters())
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, tracker.peak


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_selective_recompute_keeps_loss_and_gradients_and_lowers_the_peak(family):
    loss, grads, peak = _train_once(family, ())
    for parts in PARTS:
        got_loss, got_grads, got_peak = _train_once(family, parts)
        assert got_loss == loss, parts
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        assert got_peak < peak, f"{parts}: peak {got_peak} B, without recompute {peak} B"


def test_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown recompute parts"):
        gpt.set_selective_recompute(llama.build(_config("gpt")), ("attention", "norm"))
