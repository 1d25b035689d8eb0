"""Per-rank checks of the parallel layers and the gradient reducer against dense computations.

Each function runs on every rank of a 2-rank gloo world (one TP or DP group)
and returns {check name: max abs difference} for the test to judge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.trainer.parallel import loss, reducer, tensor
from meshtrain.trainer.telemetry import recording


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def tp_layers(sequence_parallel: bool, overlap: bool = False) -> dict[str, float]:
    rank, size = dist.get_rank(), dist.get_world_size()
    ctx = tensor.TPContext(
        group=dist.group.WORLD,
        rank=rank,
        size=size,
        sequence_parallel=sequence_parallel,
        overlap=overlap,
    )
    out: dict[str, float] = {}
    torch.manual_seed(0)  # same dense tensors on every rank
    h, f, b, t, v = 8, 16, 2, 4, 32
    w1, w2 = torch.randn(f, h), torch.randn(h, f)
    x, probe = torch.randn(b, t, h), torch.randn(b, t, h)
    emb, ids = torch.randn(v, h), torch.randint(0, v, (b, t))
    feats, head_w, targets = torch.randn(b, t, h), torch.randn(v, h), torch.randint(0, v, (b * t,))

    # Dense references (forward and backward).
    dw1, dw2, dx = (
        w1.clone().requires_grad_(),
        w2.clone().requires_grad_(),
        x.clone().requires_grad_(),
    )
    hidden = F.linear(dx, dw1)
    y = F.linear(F.gelu(hidden), dw2)
    (y * probe).sum().backward()
    demb = emb.clone().requires_grad_()
    e = F.embedding(ids, demb)
    (e * probe).sum().backward()
    dfeats, dhead = feats.clone().requires_grad_(), head_w.clone().requires_grad_()
    ce = F.cross_entropy(F.linear(dfeats, dhead).reshape(-1, v), targets)
    ce.backward()

    # Column -> row parallel MLP.
    col = tensor.ColumnParallelLinear(tensor.shard(w1, tensor.ShardSpec(0), rank, size), ctx)
    row = tensor.RowParallelLinear(tensor.shard(w2, tensor.ShardSpec(1), rank, size), ctx)
    seq = slice(rank * t // size, (rank + 1) * t // size) if sequence_parallel else slice(None)
    px = x[:, seq].clone().requires_grad_()
    partial_hidden = col(px)
    py = row(F.gelu(partial_hidden))
    (py * probe[:, seq]).sum().backward()
    out["column forward"] = _diff(
        partial_hidden, tensor.shard(hidden.detach(), tensor.ShardSpec(2), rank, size)
    )
    out["row forward"] = _diff(py, y.detach()[:, seq])
    out["input grad"] = _diff(px.grad, dx.grad[:, seq])
    out["column weight grad"] = _diff(
        col.weight.grad, tensor.shard(dw1.grad, tensor.ShardSpec(0), rank, size)
    )
    out["row weight grad"] = _diff(
        row.weight.grad, tensor.shard(dw2.grad, tensor.ShardSpec(1), rank, size)
    )

    # Vocabulary-parallel embedding.
    pemb = tensor.VocabParallelEmbedding(tensor.shard(emb, tensor.ShardSpec(0), rank, size), ctx)
    pe = pemb(ids)
    (pe * probe[:, seq]).sum().backward()
    out["embedding forward"] = _diff(pe, e.detach()[:, seq])
    out["embedding grad"] = _diff(
        pemb.weight.grad, tensor.shard(demb.grad, tensor.ShardSpec(0), rank, size)
    )

    # Head + loss fused and chunked over a vocabulary-parallel head: never more than V/tp logits a
    # row; the chunk arithmetic eager, and as training.compile fuses it (run uncompiled here).
    for arithmetic, fused in (("", None), (" (fused)", loss.FusedChunkMath())):
        head = tensor.ColumnParallelLinear(
            tensor.shard(head_w, tensor.ShardSpec(0), rank, size), ctx
        )
        pfeats = feats[:, seq].clone().requires_grad_()
        gathered = tensor.enter_region(pfeats, ctx).reshape(-1, h)
        pce = loss.linear_cross_entropy(
            gathered, head.weight, targets, tp=ctx, chunk=3, fused=fused
        )
        pce.backward()
        out[f"cross-entropy forward{arithmetic}"] = abs(pce.item() - ce.item())
        out[f"cross-entropy weight grad{arithmetic}"] = _diff(
            head.weight.grad, tensor.shard(dhead.grad, tensor.ShardSpec(0), rank, size)
        )
        out[f"cross-entropy input grad{arithmetic}"] = _diff(pfeats.grad, dfeats.grad[:, seq])

        # A padded vocabulary whose last rank holds padding rows only (6 tokens in 16 rows at tp2).
        real = 6
        padded_w = torch.cat([head_w[:real], torch.zeros(16 - real, h)])
        small_targets = targets % real
        want = F.cross_entropy(F.linear(feats, head_w[:real]).reshape(-1, real), small_targets)
        shard = tensor.shard(padded_w, tensor.ShardSpec(0), rank, size)
        got = loss.linear_cross_entropy(
            feats.reshape(-1, h), shard, small_targets, tp=ctx, chunk=5, vocab=real, fused=fused
        )
        out[f"cross-entropy, a shard all padding{arithmetic}"] = abs(got.item() - want.item())
    return out


def reducer_counts(tensors: int, bucket_mb: float) -> dict:
    """A model of ``tensors`` parameter tensors; 2 micro-batches; collectives counted per step."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(tensors // 2)])
    rec = recording.MemoryRecorder()
    red = reducer.GradReducer(
        list(layers.parameters()),
        group=dist.group.WORLD,
        group_size=size,
        bucket_mb=bucket_mb,
        recorder=rec,
    )
    torch.manual_seed(100 + rank)  # different data per rank
    batches = [torch.randn(4, 16) for _ in range(2)]
    counts = []
    red.set_sync(False)
    layers(batches[0]).square().mean().backward()
    counts.append(rec.count("collective", "dp"))  # after the non-final micro-batch
    red.set_sync(True)
    layers(batches[1]).square().mean().backward()
    red.finish()
    counts.append(rec.count("collective", "dp"))
    # Reference: plain per-tensor all-reduce of locally accumulated grads.
    torch.manual_seed(0)
    dense = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(tensors // 2)])
    for batch in batches:
        dense(batch).square().mean().backward()
    worst = 0.0
    for p, q in zip(layers.parameters(), dense.parameters()):
        dist.all_reduce(q.grad)
        worst = max(worst, _diff(p.grad, q.grad / size))
    return {"counts": counts, "buckets": len(red.buckets), "grad diff": worst}


def tp_bf16_overlap_equals_serial(sequence_parallel: bool) -> dict[str, float]:
    """Under bf16 autocast (bf16 on the wire), the overlapped MLP's outputs and gradients against the serial one's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h, f, b, t = 8, 16, 2, 8
    w1, w2, x, probe = (
        torch.randn(f, h),
        torch.randn(h, f),
        torch.randn(b, t, h),
        torch.randn(b, t, h),
    )
    seq = slice(rank * t // size, (rank + 1) * t // size) if sequence_parallel else slice(None)
    results = []
    for overlap in (False, True):
        ctx = tensor.TPContext(
            group=dist.group.WORLD,
            rank=rank,
            size=size,
            sequence_parallel=sequence_parallel,
            wire_dtype=torch.bfloat16,
            overlap=overlap,
        )
        col = tensor.ColumnParallelLinear(tensor.shard(w1, tensor.ShardSpec(0), rank, size), ctx)
        row = tensor.RowParallelLinear(tensor.shard(w2, tensor.ShardSpec(1), rank, size), ctx)
        px = x[:, seq].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            py = row(F.gelu(col(px)))
        (py.float() * probe[:, seq]).sum().backward()
        results.append((py.float(), px.grad, col.weight.grad, row.weight.grad))
    (serial, overlapped) = results
    out = {
        name: _diff(a, b)
        for name, a, b in zip(
            ("output", "input grad", "column weight grad", "row weight grad"), serial, overlapped
        )
    }
    out["dtypes differ"] = float(any(a.dtype != b.dtype for a, b in zip(serial, overlapped)))
    return out


def collectives() -> dict[str, float]:
    """``reduce_scatter_tensor`` and ``all_gather_into_tensor``, asynchronous as the trainer calls
    them, on this torch's gloo for the dtypes the trainer sends, against ``all_reduce`` and the
    list ``all_gather`` (no fallback: a torch or dtype without them raises here)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    diffs = {}
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(size * 6, 3, generator=torch.Generator().manual_seed(rank)).to(dtype)
        shard = torch.empty(6, 3, dtype=dtype)  # this rank's (6, 3) of the (size * 6, 3) sum
        work = dist.reduce_scatter_tensor(shard, full.clone(), async_op=True)
        assert work is not None
        work.wait()
        total = full.clone()
        dist.all_reduce(total)
        diffs[f"reduce_scatter {dtype}"] = _diff(
            shard.float(), total[rank * 6 : rank * 6 + 6].float()
        )
        local = full[:6].contiguous()
        gathered = torch.empty(size * 6, 3, dtype=dtype)
        work = dist.all_gather_into_tensor(gathered, local, async_op=True)
        assert work is not None
        work.wait()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local)
        diffs[f"all_gather {dtype}"] = _diff(gathered.float(), torch.cat(parts).float())
    return diffs


def all_checks() -> dict:
    """Everything above in one process group (spawning dominates the test's cost)."""
    return {
        "tp": tp_layers(False),
        "tp+sp": tp_layers(True),
        "tp+overlap": tp_layers(False, overlap=True),
        "tp+sp+overlap": tp_layers(True, overlap=True),
        "bf16 overlap": tp_bf16_overlap_equals_serial(False),
        "bf16 sp overlap": tp_bf16_overlap_equals_serial(True),
        "reducer": reducer_counts(120, 0.004),
        "collectives": collectives(),
    }
