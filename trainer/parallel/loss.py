"""The language-model loss: LM head and cross-entropy fused, chunked over tokens.

The plain loss writes the (tokens, vocab) logits in the autocast dtype, an
fp32 copy of them, and keeps a softmax of the same size for backward: at
1.3B parameters with 8k tokens a micro-batch, 2.4 GiB that exist only to be
reduced to one number.  :func:`lm_loss` never holds more than one chunk of
logits: for every chunk of tokens it computes that chunk's logits (in the
autocast dtype, as the head would), upcasts only them to fp32, takes the
loss and, at once, d loss / d logits = (softmax - one-hot) / tokens, and
contracts that with the head weight and the chunk's hidden states into the
chunk's input gradient and its share of the weight gradient.  Forward
therefore keeps two gradients (the hidden states' size, and the head
weight's in fp32) instead of logits, and backward only scales them by the
incoming gradient (the fused linear cross-entropy of Liger-Kernel works the
same way); the head's matmuls run once each, as in the plain loss.

With tensor parallelism the head weight is this rank's vocabulary shard
(column-parallel): per chunk the row maximum and the two sums (target logit,
sum of exponentials) are all-reduced over the tensor-parallel group, so no
rank sees more than ``vocab / tp`` logits of a token, and the hidden-state
gradient is a partial sum that the head's entry into the tensor-parallel
region all-reduces (or reduce-scatters under sequence parallelism) in
backward, as for any column-parallel layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer import model as gpt
from meshtrain.trainer.parallel import tensor

CHUNK_BYTES = 256 * 2**20
"""fp32 logits of one chunk at most (1,300 tokens of a 50k vocabulary): large matmuls, bounded memory."""


def chunk_tokens(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_local))


def lm_loss(
    model: gpt.GPT, x: torch.Tensor, targets: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES
) -> torch.Tensor:
    """Mean cross-entropy of ``model`` (the last pipeline chunk, holding norm and head) on ``x``.

    ``x`` is what the chunk takes (token ids, or the previous stage's hidden
    state) and ``targets`` (B, T) the next tokens.  The loss is computed
    inside the chunk's forward (``apply_head``): its forward hooks see it
    (``faults.slow_down``), and under ZeRO-3 the head's weight is gathered
    there.
    """

    def head_loss(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        # hidden: (B, T, H), or (B, T/tp, H) under sequence parallelism
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        tp = head.tp if isinstance(head, tensor.ColumnParallelLinear) else None
        if tp is not None:
            hidden = tensor.enter_region(hidden, tp)  # (B, T, H) on every rank
        return linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),  # (B*T, H)
            weight,
            targets.reshape(-1),
            tp=tp,
            chunk=chunk_tokens(weight.shape[0], chunk_bytes),
            vocab=model.config.vocab,
        )

    loss: torch.Tensor = model(x, apply_head=head_loss)
    return loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp: tensor.TPContext | None = None,
    chunk: int,
    vocab: int | None = None,
) -> torch.Tensor:
    """Mean over tokens of cross_entropy(hidden @ weight.T, targets), ``chunk`` tokens at a time.

    ``hidden`` (N, H), ``weight`` (V, H) or this rank's (V/tp, H) vocabulary
    shard, ``targets`` (N,).  Under autocast the matmuls run in its dtype and
    the softmax in fp32, as the plain loss does.  Rows of ``weight`` past
    ``vocab`` (a padded vocabulary's, :func:`meshtrain.layout.padded_vocab`)
    are no tokens: their logits are left out.
    """
    device = hidden.device.type
    compute = (
        torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    )
    loss: torch.Tensor = _LinearCrossEntropy.apply(
        hidden, weight, targets, tp, chunk, compute, torch.is_grad_enabled(), vocab
    )
    return loss


def _all_reduce(
    x: torch.Tensor, tp: tensor.TPContext | None, op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    return x if tp is None else tensor.all_reduce(x, tp, op)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss in forward, with its gradients computed there too; backward scales them."""

    @staticmethod
    def forward(
        fctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        tp: tensor.TPContext | None,
        chunk: int,
        compute: torch.dtype,
        grads: bool,
        vocab: int | None,
    ) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            n, vocab_local = hidden.shape[0], weight.shape[0]
            start = tp.rank * vocab_local if tp is not None else 0
            tokens_here = vocab_local if vocab is None else min(max(vocab - start, 0), vocab_local)
            w = weight.detach().to(compute)  # (V/tp, H)
            losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
            # the gradients (empty when none are wanted: evaluation)
            grad_hidden = torch.empty_like(hidden if grads else hidden[:0])
            grad_weight = torch.zeros_like(weight if grads else weight[:0], dtype=torch.float32)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                h = hidden[lo:hi].detach().to(compute)  # (c, H)
                logits = (h @ w.t()).float()  # (c, V/tp): the only logits alive
                logits[:, tokens_here:] = -torch.inf  # padding rows: softmax 0, gradient 0
                # softmax is shift-invariant: subtract the (global) row maximum for stability
                shift = _all_reduce(logits.max(dim=-1).values, tp, dist.ReduceOp.MAX)  # (c,)
                logits.sub_(shift.unsqueeze(-1))
                local = targets[lo:hi] - start
                inside = (local >= 0) & (local < vocab_local)  # (c,) target in this shard
                local = local.masked_fill(~inside, 0)
                gathered = logits.gather(1, local.unsqueeze(1)).squeeze(1)
                # where, not * inside: a shard of padding rows only gathers -inf, and -inf * 0 is NaN
                target_logit = torch.where(inside, gathered, torch.zeros_like(gathered))  # (c,)
                exp = logits.exp_()  # (c, V/tp), in place
                sums = _all_reduce(  # one collective: (target logit, sum of exp) -> (2, c)
                    torch.stack([target_logit, exp.sum(dim=-1)]), tp, dist.ReduceOp.SUM
                )
                losses[lo:hi] = sums[1].log() - sums[0]
                if not grads:
                    continue
                grad_logits = exp.div_(sums[1].unsqueeze(-1))  # softmax, in place
                rows = torch.arange(hi - lo, device=hidden.device)
                grad_logits[rows, local] -= inside.to(grad_logits.dtype)  # - one-hot
                g = grad_logits.div_(n).to(compute)  # d mean / d logits, (c, V/tp)
                grad_hidden[lo:hi] = g @ w  # (c, H): a partial sum over tp ranks
                grad_weight.add_((g.t() @ h).float())  # (V/tp, H)
        fctx.grads = (grad_hidden, grad_weight)
        fctx.weight_dtype = weight.dtype
        return losses.mean()

    @staticmethod
    def backward(fctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = fctx.grads
        del fctx.grads  # backward runs once (the graph is not retained): scale in place
        grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        grad_weight = grad_weight.mul_(grad_loss).to(fctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
