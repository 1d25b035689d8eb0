"""The language-model loss: LM head and cross-entropy fused, chunked over tokens.

The plain loss writes the (tokens, vocab) logits, an fp32 copy and a softmax for backward: at 1.3B
parameters with 8k tokens a micro-batch, 2.4 GiB that exist only to be reduced to one number.
:func:`lm_loss` holds one chunk of logits at a time and computes the gradients in forward
(:class:`_LinearCrossEntropy`); under tensor parallelism each rank sees only its vocabulary shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.models import documents as documents_mod
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import tensor

CHUNK_BYTES = 256 * 2**20
"""fp32 logits of one chunk at most (1,300 tokens of a 50k vocabulary): large matmuls, bounded memory."""


def chunk_tokens(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_local))


def balanced_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of ceil(n / chunk) chunks of at most ``chunk`` tokens, within one token of
    each other: two lengths at most, and no short tail (a compiled function specialises on
    lengths 0 and 1)."""
    count = -(-n // chunk)
    base, longer = divmod(n, count)
    bounds, lo = [], 0
    for i in range(count):
        hi = lo + base + (1 if i < longer else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _row_max(logits: torch.Tensor, tokens_here: int) -> torch.Tensor:
    """(c,) fp32 maximum over the chunk's real token columns (padding rows are no tokens)."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    return torch.where(cols < tokens_here, logits.float(), -torch.inf).amax(dim=-1)


def _target_and_sum(
    logits: torch.Tensor,
    shift: torch.Tensor,
    local: torch.Tensor,
    inside: torch.Tensor,
    tokens_here: int,
) -> torch.Tensor:
    """(2, c): each row's shifted target logit (0 where the target is another shard's) and sum of exp."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    shifted = torch.where(cols < tokens_here, logits.float() - shift[:, None], -torch.inf)
    target = shifted.gather(1, local[:, None]).squeeze(1)
    return torch.stack([torch.where(inside, target, 0.0), shifted.exp().sum(dim=-1)])


def _gradient(
    logits: torch.Tensor,
    shift: torch.Tensor,
    total: torch.Tensor,
    local: torch.Tensor,
    inside: torch.Tensor,
    tokens_here: int,
) -> torch.Tensor:
    """d summed loss / d logits = softmax - one-hot, in the logits' dtype."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    real = cols < tokens_here
    softmax = torch.where(real, (logits.float() - shift[:, None]).exp() / total[:, None], 0.0)
    one_hot = (cols == local[:, None]) & inside[:, None]
    return (softmax - one_hot.float()).to(logits.dtype)


@dataclasses.dataclass(frozen=True)
class FusedChunkMath:
    """The per-chunk arithmetic as three functions that each read the logits once.

    Compiled (:meth:`compiled`), each is one fused kernel or two.  Run as
    they are (tests do, to check the arithmetic) they are several times
    slower than the eager in-place path (every ``where`` and upcast writes
    a temporary), which stays the path without ``training.compile``.  The
    engine uses them for bf16 logits, whose eager arithmetic first writes
    an fp32 copy: ``benchmarks/bench_fused_loss.py`` on a CPU measured the
    compiled arithmetic at 0.62x the eager one's time in bf16 and 1.20x in
    fp32, which has no copy to save (``benchmarks/results/fused_loss-*-vm.json``;
    no GPU figure yet).
    """

    row_max: Callable[..., torch.Tensor] = _row_max
    target_and_sum: Callable[..., torch.Tensor] = _target_and_sum
    gradient: Callable[..., torch.Tensor] = _gradient

    @classmethod
    def compiled(cls, backend: Any) -> FusedChunkMath:
        """The three functions through ``torch.compile``, static at first.

        A second chunk length (:func:`balanced_chunks` makes at most two)
        recompiles with the token dimension dynamic, which then serves every
        length; the vocabulary stays static, so the kernels keep its size.
        Past dynamo's recompile limit a function would run as written, the
        slow way, which a graph per length could reach.
        """
        return cls(
            *(
                torch.compile(fn, backend=backend, dynamic=None)
                for fn in (_row_max, _target_and_sum, _gradient)
            )
        )


def lm_loss(
    model: gpt.GPT,
    x: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    fused: FusedChunkMath | None = None,
    documents: documents_mod.Documents | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``model`` (the last pipeline chunk, holding norm and head) on ``x``.

    ``documents``: the micro-batch's document mask and positions (``training.documentMask``).

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
            fused=fused,
        )

    loss: torch.Tensor = model(x, apply_head=head_loss, documents=documents)
    return loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp: tensor.TPContext | None = None,
    chunk: int,
    vocab: int | None = None,
    fused: FusedChunkMath | None = None,
) -> torch.Tensor:
    """Mean over tokens of cross_entropy(hidden @ weight.T, targets), ``chunk`` tokens at a time.

    ``hidden`` (N, H), ``weight`` (V, H) or this rank's (V/tp, H) vocabulary
    shard, ``targets`` (N,).  Under autocast the matmuls run in its dtype and
    the softmax in fp32, as the plain loss does.  Rows of ``weight`` past
    ``vocab`` (a padded vocabulary's, :func:`meshtrain.api.layout.padded_vocab`)
    are no tokens: their logits are left out.  ``fused``: the per-chunk
    arithmetic to use instead of the eager in-place one.
    """
    device = hidden.device.type
    compute = (
        torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    )
    loss: torch.Tensor = _LinearCrossEntropy.apply(
        hidden, weight, targets, tp, chunk, compute, torch.is_grad_enabled(), vocab, fused
    )
    return loss


def _all_reduce(
    x: torch.Tensor, tp: tensor.TPContext | None, op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    return x if tp is None else tensor.all_reduce(x, tp, op)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A chunk of tokens' logits on this rank and where their targets are."""

    logits: torch.Tensor
    """(c, V/tp) in the compute dtype."""
    local: torch.Tensor
    """(c,) each target's column in this vocabulary shard (0 where it is another shard's)."""
    inside: torch.Tensor
    """(c,) whether the target is in this shard."""
    tokens_here: int
    """Columns of this shard that are tokens (the rest are a padded vocabulary's rows)."""


ChunkResult = tuple[torch.Tensor, torch.Tensor | None]
"""(2, c) target logits and sums of exp over the whole vocabulary; d summed loss / d logits, or None."""


def _eager_chunk(chunk: _Chunk, tp: tensor.TPContext | None, grads: bool) -> ChunkResult:
    """One chunk's loss terms and logit gradient on one fp32 copy of its logits, in place."""
    x = chunk.logits.float()  # (c, V/tp)
    x[:, chunk.tokens_here :] = -torch.inf  # padding rows: softmax 0, gradient 0
    shift = _all_reduce(x.max(dim=-1).values, tp, dist.ReduceOp.MAX)  # (c,)
    x.sub_(shift.unsqueeze(-1))
    gathered = x.gather(1, chunk.local.unsqueeze(1)).squeeze(1)
    # where, not * inside: a shard of padding rows only gathers -inf, and -inf * 0 is NaN
    target_logit = torch.where(chunk.inside, gathered, torch.zeros_like(gathered))  # (c,)
    exp = x.exp_()
    sums = _all_reduce(torch.stack([target_logit, exp.sum(dim=-1)]), tp, dist.ReduceOp.SUM)
    if not grads:
        return sums, None
    softmax = exp.div_(sums[1].unsqueeze(-1))
    rows = torch.arange(x.shape[0], device=x.device)
    softmax[rows, chunk.local] -= chunk.inside.to(softmax.dtype)  # - one-hot
    return sums, softmax.to(chunk.logits.dtype)


def _fused_chunk(
    fused: FusedChunkMath, chunk: _Chunk, tp: tensor.TPContext | None, grads: bool
) -> ChunkResult:
    """:func:`_eager_chunk` through ``fused``'s functions: no fp32 copy of the logits."""
    logits, local, inside, here = chunk.logits, chunk.local, chunk.inside, chunk.tokens_here
    shift = _all_reduce(fused.row_max(logits, here), tp, dist.ReduceOp.MAX)
    sums = _all_reduce(
        fused.target_and_sum(logits, shift, local, inside, here), tp, dist.ReduceOp.SUM
    )
    if not grads:
        return sums, None
    return sums, fused.gradient(logits, shift, sums[1], local, inside, here)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss in forward, with its gradients computed there too; backward scales them.

    Per chunk of tokens: the chunk's logits (in the autocast dtype, as the head would), upcast to
    fp32, the loss and at once the summed loss's d / d logits = softmax - one-hot, contracted with
    the head weight and the chunk's hidden states into the chunk's input gradient and its share
    of the weight gradient.  Forward thus keeps two gradients (the hidden states' size, and the
    head weight's in fp32) instead of logits, and backward only scales them by the incoming
    gradient over the token count (Liger-Kernel's fused linear cross-entropy also computes the
    gradients in forward, though already divided there); the head's matmuls run once each, as
    in the plain loss.

    Under tensor parallelism each chunk's row maximum and its two sums (target logit, sum of
    exponentials) are all-reduced over the group, and the hidden-state gradient is a partial sum
    that the head's entry into the tensor-parallel region reduces in backward.
    """

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
        fused: FusedChunkMath | None,
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
            for lo, hi in balanced_chunks(n, chunk):
                h = hidden[lo:hi].detach().to(compute)  # (c, H)
                local = targets[lo:hi] - start
                inside = (local >= 0) & (local < vocab_local)  # (c,) target in this shard
                local = local.masked_fill(~inside, 0)
                logits = h @ w.t()  # (c, V/tp) in the compute dtype: the only logits alive
                part = _Chunk(logits, local, inside, tokens_here)
                sums, g = (
                    _eager_chunk(part, tp, grads)
                    if fused is None
                    else _fused_chunk(fused, part, tp, grads)
                )
                losses[lo:hi] = sums[1].log() - sums[0]
                if g is not None:  # of the summed loss: backward divides by n
                    grad_hidden[lo:hi] = g @ w  # (c, H): a partial sum over tp ranks
                    grad_weight.add_((g.t() @ h).float())  # (V/tp, H)
        fctx.grads = (grad_hidden, grad_weight)
        fctx.tokens = n
        fctx.weight_dtype = weight.dtype
        return losses.mean()

    @staticmethod
    def backward(fctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = fctx.grads
        del fctx.grads  # backward runs once (the graph is not retained): scale in place
        # the gradients are the summed loss's and the loss is a mean; an fp32 factor, not one
        # rounded to a bf16 gradient's dtype (a bias of up to 0.4% on every backbone gradient)
        scale = grad_loss.float() / fctx.tokens
        grad_hidden.mul_(scale)
        grad_weight = grad_weight.mul_(scale).to(fctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None
