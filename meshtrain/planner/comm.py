"""Communication model: the collectives one rank runs per optimizer step, and their bytes.

An enumeration, per pipeline stage, of every collective the
trainer's engine issues in one step (group, op, calls, payload bytes), built
from the model shape, the layout and the precision scheme.  It follows what
:mod:`meshtrain.trainer.parallel` does, call for call, so that a test can
compare it exactly with the bytes the trainer's recorder measures:

* **dp**: the gradient reducer packs this rank's parameters (reverse
  registration order, never two model chunks in one bucket) into buckets of
  ``bucketMb`` MiB and all-reduces each bucket once per step (payload: every
  gradient once).  With ZeRO (:mod:`meshtrain.trainer.parallel.zero`) stage
  1 keeps the all-reduce, stage 2 reduce-scatters each bucket, padded to a
  multiple of the group size, after every micro-batch's backward (so no
  full-size gradient outlives a micro-batch), and both all-gather each bucket's updated weights (padded) and sum
  the gradient norm over the group (one fp64 scalar).  Stage 3 (FSDP2) gathers
  every block before its forward and its backward and reduce-scatters its
  gradients, per micro-batch (:func:`zero3_collectives`).  ``allReduce:
  hierarchical`` replaces a bucket's all-reduce by a reduce-scatter inside the
  node, an all-reduce of the 1/k shard across nodes (k: the group's ranks per
  node) and an all-gather inside the node.
* **tp** (tensor > 1), per micro-batch: Megatron's two reductions per
  sub-layer (attention, MLP), one forward (row-parallel output) and one
  backward (column-parallel input gradient); under sequence parallelism each
  becomes an all-gather and a reduce-scatter in each direction.  The
  vocabulary-parallel embedding reduces its output, the head's input
  gradient is reduced, and the vocabulary-parallel cross entropy all-reduces
  a max and a (target logit, sum of exp) pair per token.  Per step: the
  global gradient norm (one fp64 scalar), under sequence parallelism one
  all-reduce of the replicated parameters' gradients, and with fewer
  key/value heads than tensor ranks one all-reduce of the k/v rows'
  gradients over the ranks holding the same head (a subgroup of tp,
  recorded as tp).
* **pp** (pipeline > 1): one activation sent forward per micro-batch and
  model chunk (except from the last virtual stage) and one gradient sent
  back (except from the first), shaped (micro batch, seq [/ tp under SP],
  hidden); per step the global-norm scalar and, with tied embeddings, one
  all-reduce of the matrix's gradient between the first and the last stage.  The trainer records pipeline
  waits, not pipeline bytes, so only the dp and tp figures are measured.

Each bucket's gradient exchange (the flat all-reduce, the hierarchical
chain, a compressed exchange, a ZeRO-2 or ZeRO-3 reduce-scatter) is issued
when the bucket's gradients are final and overlaps the rest of backward
(:attr:`StageComm.dp_exchanges` counts them); ZeRO's parameter gathers and
the dp norm are marked :attr:`Collective.after_backward`.

Payload bytes follow the recorder's convention (the full buffer, also for
all-gather and reduce-scatter); :attr:`Collective.wire_bytes` is what a rank
actually sends under ring algorithms.  Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.api import spec as api_spec
from meshtrain.planner import gradient_compression, memory

NORM_BYTES = 8
"""The global gradient norm travels as one fp64 scalar per axis."""

LOSS_BYTES = 4
"""The vocabulary-parallel cross entropy works in fp32."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """Calls of one collective op over one group during one step on one rank."""

    group: str
    """Axis of the process group: ``dp``, ``tp`` or ``pp``."""
    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``send`` (pipeline point-to-point)."""
    calls: int
    """Number of calls per step."""
    nbytes: int
    """Payload bytes summed over the calls (the full buffer, as the trainer's recorder counts)."""
    members: int
    """Ranks in the group (2 for a pipeline send: the two peers)."""
    after_backward: bool = False
    """A dp collective outside the gradient buckets' exchanges (ZeRO's parameter gathers, the norm):
    not overlapped with backward, so charged as exposed."""

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on its links: ring all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n."""
        n = self.members
        if self.op == "all_reduce":
            return 2 * (n - 1) / n * self.nbytes
        if self.op in ("all_gather", "reduce_scatter"):
            return (n - 1) / n * self.nbytes
        return float(self.nbytes)


@dataclasses.dataclass(frozen=True)
class StageComm:
    """All collectives of one rank of one pipeline stage."""

    stage: int
    """Pipeline stage (0-based)."""
    collectives: tuple[Collective, ...]
    """Every (group, op, after_backward) with its calls and bytes."""
    dp_exchanges: int = 0
    """Gradient bucket exchanges per step: each one chain of dp collectives issued when its bucket's
    gradients are final, overlapping the rest of backward (:mod:`meshtrain.trainer.parallel.exchanges`)."""
    dp_last_exchange: tuple[Collective, ...] = ()
    """The legs (one call each) of the last bucket's exchange, issued when backward ends, so exposed
    whole (in GPT the last bucket holds the token embedding); empty where not modelled (ZeRO-3)."""

    def payload(self, group: str) -> int:
        """Payload bytes per step over ``group``."""
        return sum(c.nbytes for c in self.collectives if c.group == group)

    def wire(self, group: str) -> float:
        """Bytes this rank sends per step over ``group``."""
        return sum(c.wire_bytes for c in self.collectives if c.group == group)

    def by_key(self) -> dict[tuple[str, str], Collective]:
        """Collectives keyed by (group, op), overlapped and after-backward calls summed (as the trainer records them)."""
        out: dict[tuple[str, str], Collective] = {}
        for c in self.collectives:
            key = (c.group, c.op)
            if key in out:
                c = dataclasses.replace(
                    out[key], calls=out[key].calls + c.calls, nbytes=out[key].nbytes + c.nbytes
                )
            out[key] = c
        return out


def chunk_param_shapes(
    shape: api_spec.ModelShape, tensor: int, layers: int, *, first: bool, last: bool
) -> list[tuple[int, ...]]:
    """Shapes of one model chunk's parameters in registration order (after TP sharding).

    Order of :class:`meshtrain.trainer.models.gpt.GPT` (and of the Llama decoder,
    which has no position table and one weight per RMSNorm): token and
    position tables, then per block ln1, qkv, attention proj, ln2, mlp fc,
    mlp proj, then the final norm and the head (absent when tied to this chunk's embedding).
    """
    h, v = shape.hidden, memory.vocab_rows(shape, tensor)
    llama = shape.family == "llama"
    norm: list[tuple[int, ...]] = [(h,)] if llama else [(h,), (h,)]  # RMSNorm; LayerNorm w, b
    qkv, proj, fc, down = (n // h for n in memory.local_block_matrices(shape, tensor))
    shapes: list[tuple[int, ...]] = []
    if first:
        shapes += [(v, h)] + ([] if llama else [(shape.seq_len, h)])
    for _ in range(layers):  # column-parallel (rows split), row-parallel (columns split)
        shapes += [*norm, (qkv, h), (h, proj), *norm, (fc, h), (h, down)]
    if last:
        # a tied head is the embedding: no parameter of its own on the embedding's stage, a copy on another
        shapes += norm + ([] if shape.tie_embeddings and first else [(v, h)])
    return shapes


def chunk_param_sizes(
    shape: api_spec.ModelShape, tensor: int, layers: int, *, first: bool, last: bool
) -> list[int]:
    """Element counts of :func:`chunk_param_shapes`."""
    return [math.prod(s) for s in chunk_param_shapes(shape, tensor, layers, first=first, last=last)]


def bucket_members(sizes: list[int], element_size: int, bucket_mb: float) -> list[list[int]]:
    """Indices (into ``sizes``) of the gradient reducer's buckets, in launch order.

    The reducer walks the parameters in reverse registration order and
    starts a new bucket once the current one holds at least ``bucket_mb`` MiB
    (so a bucket may overshoot by its last tensor, and the last may be small).
    """
    limit = int(bucket_mb * 2**20)
    buckets: list[list[int]] = []
    filled = 0
    for index in reversed(range(len(sizes))):
        if not buckets or filled >= limit:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += sizes[index] * element_size
    return buckets


def bucket_numels(sizes: list[int], element_size: int, bucket_mb: float) -> list[int]:
    """Element counts of the gradient reducer's buckets, in launch order."""
    return [sum(sizes[i] for i in b) for b in bucket_members(sizes, element_size, bucket_mb)]


def padded(numel: int, members: int) -> int:
    """A bucket padded to a multiple of the group size, as ZeRO shards it (``N x ceil(n / N)``)."""
    return -(-numel // members) * members


def dp_ranks_per_node(job: api_spec.TrainingJobSpec) -> int:
    """Ranks of one data-parallel group on one node (``gpusPerNode / tensor``, at most ``data``)."""
    par = job.parallelism
    return min(max(job.resources.gpus_per_node // par.tensor, 1), par.data)


def zero3_collectives(
    shape: api_spec.ModelShape,
    tensor: int,
    data: int,
    micro_batches: int,
    virtuals: list[int],
    layers_per_chunk: int,
    last_virtual: int,
    scheme: memory.StateScheme,
    *,
    keep_last_block: bool,
) -> list[tuple[str, str, int, float]]:
    """ZeRO-3 (FSDP2) per step: (group, op, calls, payload bytes) of one rank.

    Units as ``trainer/parallel/zero3.units`` makes them: the embedding
    tables (first chunk, untied, without pipelining), each block, and each chunk's root (final
    norm and head, plus tied tables).  Per micro-batch every unit with
    parameters is gathered for its forward and again for its backward
    (measured: FSDP2 reshards the root after forward too when backward is
    driven per micro-batch), except the last block of a chunk without
    pipelining (``keep_last_block``), which stays gathered from its forward
    into its backward; each unit reduce-scatters its gradients once (fp32:
    FSDP2's reduce_dtype; the gathers are in its param_dtype, bf16 under
    bf16).  Each parameter is padded to ``ceil(rows / N) N`` rows.
    """

    def unit_bytes(shapes: list[tuple[int, ...]], size: int) -> int:
        return sum(padded(s[0], data) * math.prod(s[1:]) for s in shapes) * size

    block = chunk_param_shapes(shape, tensor, 1, first=False, last=False)
    others: list[list[tuple[int, ...]]] = []  # the tables' and the roots' units
    for j in virtuals:
        first, last = j == 0, j == last_virtual
        if first and not shape.tie_embeddings and keep_last_block:  # zero3.units
            others.append(chunk_param_shapes(shape, tensor, 0, first=True, last=False))
            first = False
        others.append(chunk_param_shapes(shape, tensor, 0, first=first, last=last))
    others = [u for u in others if u]
    blocks = layers_per_chunk * len(virtuals)
    kept = len(virtuals) if keep_last_block and layers_per_chunk else 0  # gathered once
    m = micro_batches
    gathers = 2 * m * (blocks + len(others)) - m * kept
    block_gathered = unit_bytes(block, scheme.wire_bytes)  # FSDP2's param_dtype: bf16 under bf16
    gathered = m * (
        (2 * blocks - kept) * block_gathered
        + 2 * sum(unit_bytes(u, scheme.wire_bytes) for u in others)
    )
    scatters = m * (blocks + len(others))
    scattered = m * (
        blocks * unit_bytes(block, scheme.grads) + sum(unit_bytes(u, scheme.grads) for u in others)
    )
    return [("dp", "all_gather", gathers, gathered), ("dp", "reduce_scatter", scatters, scattered)]


def _add(
    out: dict[tuple[str, str, bool], list[int]],
    group: str,
    op: str,
    calls: int,
    nbytes: float,
    *,
    after_backward: bool = False,
) -> None:
    if calls <= 0:
        return
    entry = out.setdefault((group, op, after_backward), [0, 0])
    entry[0] += calls
    entry[1] += int(nbytes)


def stage_comm(job: api_spec.TrainingJobSpec, stage: int, scheme: memory.StateScheme) -> StageComm:
    """The collectives of one rank of pipeline ``stage`` in one optimizer step."""
    shape = job.model.shape()
    par = job.parallelism
    p, t, d, m = par.pipeline, par.tensor, par.data, par.micro_batches
    v = par.virtual_stages if par.schedule == "interleaved-1f1b" else 1
    sp = par.sequence_parallel and t > 1
    # Activation checkpointing replays each block's forward in backward, and PyTorch stops the replay once
    # the last tensor backward needs exists: the MLP output's collective (its result saves nothing) is skipped.
    recompute = job.training.activation_checkpointing
    b, s, h = job.training.micro_batch, shape.seq_len, shape.hidden
    layers_per_chunk = shape.layers // (p * v)
    last_virtual = p * v - 1
    virtuals = [chunk * p + stage for chunk in range(v)]
    holds_first = 0 in virtuals
    holds_last = last_virtual in virtuals
    out: dict[tuple[str, str, bool], list[int]] = {}
    exchanges = 0
    last_exchange: list[tuple[str, str, int, int]] = []

    # Parameters of this rank, chunk by chunk in the order the trainer registers them.
    chunk_shapes = [
        chunk_param_shapes(shape, t, layers_per_chunk, first=j == 0, last=j == last_virtual)
        for j in virtuals
    ]
    chunks = [[math.prod(s) for s in shapes] for shapes in chunk_shapes]
    params = sum(sum(sizes) for sizes in chunks)

    # Data parallel: gradient buckets, and under ZeRO the gather of the updated weights.
    if d > 1:  # buckets never span two chunks; the last chunk's come first
        buckets = [
            n
            for sizes in reversed(chunks)
            for n in bucket_numels(sizes, scheme.grads, par.bucket_mb)
        ]
        if par.zero_stage == 3:
            for group, op, calls, nbytes in zero3_collectives(
                shape,
                t,
                d,
                m,
                virtuals,
                layers_per_chunk,
                last_virtual,
                scheme,
                keep_last_block=par.pipeline == 1,
            ):
                gathers = op == "all_gather"
                _add(out, group, op, calls, nbytes, after_backward=gathers)
                exchanges += 0 if gathers else calls
        elif par.zero_stage == 2:  # every micro-batch's backward reduce-scatters each bucket
            exchanges = m * len(buckets)
            last_exchange = [("dp", "reduce_scatter", 1, padded(buckets[-1], d) * scheme.grads)]
            _add(
                out,
                "dp",
                "reduce_scatter",
                m * len(buckets),
                m * sum(padded(n, d) for n in buckets) * scheme.grads,
            )
        elif par.gradient_compression.mode != "none":
            bucket_shapes = [
                [shapes[i] for i in members]
                for sizes, shapes in zip(reversed(chunks), reversed(chunk_shapes))
                for members in bucket_members(sizes, scheme.grads, par.bucket_mb)
            ]
            for group, op, calls, nbytes in gradient_compression.dp_collectives(
                par.gradient_compression, bucket_shapes, d, scheme.grads
            ):
                _add(out, group, op, calls, nbytes)
            exchanges = len(bucket_shapes)
            last_exchange = gradient_compression.dp_collectives(
                par.gradient_compression, bucket_shapes[-1:], d, scheme.grads
            )
        elif par.all_reduce == "hierarchical":  # intra-node reduce-scatter and all-gather of each
            # bucket padded to the k peers of a node, inter-node all-reduce of its 1/k shard
            k = dp_ranks_per_node(job)
            full = sum(padded(n, k) for n in buckets) * scheme.grads
            _add(out, "dp", "reduce_scatter", len(buckets), full)
            _add(out, "dp", "all_reduce", len(buckets), full // k)
            _add(out, "dp", "all_gather", len(buckets), full)
            exchanges = len(buckets)
            last = padded(buckets[-1], k) * scheme.grads
            last_exchange = [
                ("dp", "reduce_scatter", 1, last),
                ("dp", "all_reduce", 1, last // k),
                ("dp", "all_gather", 1, last),
            ]
        else:
            _add(out, "dp", "all_reduce", len(buckets), params * scheme.grads)
            exchanges = len(buckets)
            last_exchange = [("dp", "all_reduce", 1, buckets[-1] * scheme.grads)]
        if par.zero_stage == 3:  # the norm summed over dp
            _add(out, "dp", "all_reduce", 1, NORM_BYTES, after_backward=True)
        elif (
            par.zero_stage >= 1
        ):  # owned weights all-gathered bucket by bucket; the norm summed over dp
            _add(
                out,
                "dp",
                "all_gather",
                len(buckets),
                sum(padded(n, d) for n in buckets) * scheme.weights,
                after_backward=True,
            )
            _add(out, "dp", "all_reduce", 1, NORM_BYTES, after_backward=True)

    # Tensor parallel: activations per micro-batch, then per-step reductions.
    if t > 1:
        # a full (B, T, H) residual-stream tensor and a row-parallel output, as they cross the group
        stream = matmul = b * s * h * scheme.wire_bytes
        blocks = layers_per_chunk * v
        if sp:
            # Per sub-layer: gather in / reduce-scatter out forward, the reverse backward.
            # Each op runs once on a stream tensor and once on a matmul output per sub-layer.
            _add(out, "tp", "all_gather", 4 * blocks * m, 2 * blocks * m * (stream + matmul))
            _add(out, "tp", "reduce_scatter", 4 * blocks * m, 2 * blocks * m * (stream + matmul))
            if (
                recompute
            ):  # the replayed forward: both gathers, and the attention output's reduce-scatter
                _add(out, "tp", "all_gather", 2 * blocks * m, 2 * blocks * m * stream)
                _add(out, "tp", "reduce_scatter", blocks * m, blocks * m * matmul)
        else:
            # Per sub-layer: reduce the row-parallel output forward, the column-parallel input gradient backward.
            _add(out, "tp", "all_reduce", 4 * blocks * m, 2 * blocks * m * (stream + matmul))
            if recompute:  # the replayed forward: the attention output's reduction
                _add(out, "tp", "all_reduce", blocks * m, blocks * m * matmul)
        if holds_first:  # vocabulary-parallel embedding: sum of the partial lookups
            if sp:
                _add(out, "tp", "reduce_scatter", m, m * stream)
                _add(out, "tp", "all_gather", m, m * stream)
            else:
                _add(out, "tp", "all_reduce", m, m * stream)
        if holds_last:  # head input gradient, then the cross entropy's max and (target, sum-exp)
            if sp:
                _add(out, "tp", "all_gather", m, m * stream)
                _add(out, "tp", "reduce_scatter", m, m * stream)
            else:
                _add(out, "tp", "all_reduce", m, m * stream)
            _add(out, "tp", "all_reduce", 2 * m, m * b * s * LOSS_BYTES * 3)
        if sp:  # replicated parameters' gradients are per-slice partials under SP
            norm = memory.norm_params(shape)
            positions = 0 if shape.family == "llama" else s * h
            replicated = (
                2 * norm * layers_per_chunk * v
                + (positions if holds_first else 0)
                + (norm if holds_last else 0)
            )
            _add(out, "tp", "all_reduce", 1, replicated * scheme.grads)
        if shape.key_value_heads < t:  # replicated key/value heads: their rows' gradients summed
            kv_rows = 2 * shape.head_dim  # over the ranks holding the head (ZeRO-2: the owned part)
            _add(out, "tp", "all_reduce", 1, blocks * kv_rows * h * scheme.grads)
        _add(out, "tp", "all_reduce", 1, NORM_BYTES)

    # Pipeline: activations forward, their gradients backward, then the norm scalar.
    if p > 1:
        seq = s // t if sp else s
        message = b * seq * h * scheme.wire_bytes
        sends = sum((j != last_virtual) + (j != 0) for j in virtuals) * m
        _add(out, "pp", "send", sends, sends * message)
        if shape.tie_embeddings and (holds_first or holds_last):  # the two copies' gradients summed
            _add(out, "pp", "all_reduce", 1, memory.vocab_rows(shape, t) * h * scheme.grads)
        _add(out, "pp", "all_reduce", 1, NORM_BYTES)

    members = {"dp": d, "tp": t, "pp": p}
    collectives = tuple(
        Collective(
            group=g,
            op=op,
            calls=calls,
            nbytes=nbytes,
            members=2 if op == "send" else members[g],
            after_backward=after,
        )
        for (g, op, after), (calls, nbytes) in sorted(out.items())
    )
    return StageComm(
        stage=stage,
        collectives=collectives,
        dp_exchanges=exchanges,
        dp_last_exchange=tuple(
            Collective(group=g, op=op, calls=calls, nbytes=nbytes, members=d)
            for g, op, calls, nbytes in last_exchange
        ),
    )


def plan_comm(job: api_spec.TrainingJobSpec, scheme: memory.StateScheme) -> tuple[StageComm, ...]:
    """Collectives of every pipeline stage (ranks of one stage send alike)."""
    return tuple(stage_comm(job, stage, scheme) for stage in range(job.parallelism.pipeline))


def placement_traffic(
    job: api_spec.TrainingJobSpec, scheme: memory.StateScheme
) -> tuple[float, float]:
    """Bytes per step in the placement module's terms, from this model: (dp, pp).

    ``dp``: bytes one rank sends to its data-parallel ring successor (the
    wire bytes of its dp collectives, largest stage); ``pp``: bytes between a
    rank and its next-stage peer (activations forward plus gradients back,
    ``v`` crossings per micro-batch).  These are the two figures
    :class:`meshtrain.placement.PlacementRequest` weighs.
    """
    stages = plan_comm(job, scheme)
    dp = max(stage.wire("dp") for stage in stages)
    par = job.parallelism
    if par.pipeline == 1:
        return dp, 0.0
    shape = job.model.shape()
    v = par.virtual_stages if par.schedule == "interleaved-1f1b" else 1
    seq = shape.seq_len // par.tensor if par.sequence_parallel and par.tensor > 1 else shape.seq_len
    message = job.training.micro_batch * seq * shape.hidden * scheme.wire_bytes
    return dp, float(2 * par.micro_batches * v * message)
