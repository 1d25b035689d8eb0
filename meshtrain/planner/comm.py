"""Communication model: the collectives one rank runs per optimizer step, and their bytes.

Per pipeline stage, every collective the trainer's engine issues in one step (group, op, calls,
payload bytes), call for call as :mod:`meshtrain.trainer.parallel` does, so that a test compares
it exactly with the bytes the trainer's recorder measures.  docs/planner.md lists each group's
collectives; payload bytes follow the recorder's convention (the full buffer), and
:attr:`Collective.wire_bytes` is what a rank sends under ring algorithms.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.api import layout
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.planner import context, gradient_compression, parameters, precision

NORM_BYTES = 8
"""The global gradient norm travels as one fp64 scalar per axis."""

LOSS_BYTES = 4
"""The vocabulary-parallel cross entropy works in fp32."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """Calls of one collective op over one group during one step on one rank."""

    group: str
    """Axis of the process group: ``dp``, ``tp``, ``pp`` or ``cp`` (the context ring's sends)."""
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
    overlapped: bool = False
    """A tp collective of the linears run in chunks beside their matmuls (``parallelism.overlap.tensor``):
    only what the matmuls do not hide is exposed (:mod:`meshtrain.planner.timing.tp_overlap`)."""
    whole: bool = False
    """An overlapped collective run in one piece beside a matmul it does not feed (without SP the
    column-parallel input gradient's all-reduce beside the weight gradient): one chunk."""

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
    shape: api_model.ModelShape, tensor: int, layers: int, *, first: bool, last: bool
) -> list[tuple[int, ...]]:
    """Shapes of one model chunk's parameters in registration order (after TP sharding).

    Order of :class:`meshtrain.trainer.models.gpt.GPT` (and of the Llama decoder,
    which has no position table and one weight per RMSNorm): token and
    position tables, then per block ln1, qkv, attention proj, ln2, mlp fc,
    mlp proj, then the final norm and the head (absent when tied to this chunk's embedding).
    """
    h, v = shape.hidden, parameters.vocab_rows(shape, tensor)
    llama = shape.family == "llama"
    norm: list[tuple[int, ...]] = [(h,)] if llama else [(h,), (h,)]  # RMSNorm; LayerNorm w, b
    qkv, proj, fc, down = (n // h for n in parameters.local_block_matrices(shape, tensor))
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
    shape: api_model.ModelShape, tensor: int, layers: int, *, first: bool, last: bool
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


ZERO2_MIN_BUCKETS = 16
"""ZeRO-2 cuts a rank's gradients into at least this many buckets (``zero.MIN_BUCKETS``)."""


def zero2_bucket(params: int, element_size: int, bucket_mb: float) -> tuple[int, int]:
    """A ZeRO-2 bucket's (target, cap) in elements: it closes once it holds ``bucket_mb`` MiB (at
    most 1/ZERO2_MIN_BUCKETS of ``params``) and never holds more than the larger of twice that and
    1/ZERO2_MIN_BUCKETS of ``params``."""
    share = -(-params // ZERO2_MIN_BUCKETS)
    size = max(1, min(int(bucket_mb * 2**20) // element_size, share))
    return size, max(2 * size, share)


def zero2_bucket_numels(
    chunk_sizes: list[list[int]], element_size: int, bucket_mb: float
) -> list[int]:
    """Element counts of ZeRO-2's buckets, in launch order (``zero.plan_spans``): each chunk's
    tensors, last first; a bucket closes once it holds the :func:`zero2_bucket` target, and a
    tensor that would take it past the cap is cut there and goes on in the next."""
    size, cap = zero2_bucket(sum(map(sum, chunk_sizes)), element_size, bucket_mb)
    out: list[int] = []
    for sizes in reversed(chunk_sizes):
        filled = 0
        for numel in reversed(sizes):
            first = 0
            while first < numel:
                if not filled or filled >= size:
                    out.append(0)
                    filled = 0
                take = min(numel - first, cap - filled)
                out[-1] += take
                filled, first = filled + take, first + take
    return out


def bucket_numels(sizes: list[int], element_size: int, bucket_mb: float) -> list[int]:
    """Element counts of the gradient reducer's buckets, in launch order."""
    return [sum(sizes[i] for i in b) for b in bucket_members(sizes, element_size, bucket_mb)]


def padded(numel: int, members: int) -> int:
    """A bucket padded to a multiple of the group size, as ZeRO shards it (``N x ceil(n / N)``)."""
    return -(-numel // members) * members


def dp_ranks_per_node(job: api_spec.TrainingJobSpec) -> int:
    """Ranks of one data-parallel group on one node (``gpusPerNode / tensor``, at most ``data``)."""
    return job.parallelism.layout.dp_ranks_per_pod(job.resources.gpus_per_node)


def zero3_collectives(
    shape: api_model.ModelShape,
    tensor: int,
    data: int,
    micro_batches: int,
    virtuals: list[int],
    layers_per_chunk: int,
    last_virtual: int,
    scheme: precision.StateScheme,
    *,
    keep_last_block: bool,
) -> list[tuple[str, str, int, float]]:
    """ZeRO-3 (FSDP2) per step: (group, op, calls, payload bytes) of one rank.

    Units as :func:`meshtrain.trainer.parallel.zero3.units` makes them: the embedding
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


@dataclasses.dataclass(frozen=True)
class _Row:
    """Calls of one collective, summed with the others of its group, op and overlap (:func:`_summed`)."""

    group: str
    """Axis of the process group."""
    op: str
    calls: int
    """Calls per step (none: the row is dropped)."""
    nbytes: float
    """Payload bytes of those calls."""
    after_backward: bool = False
    """Outside the overlapped bucket exchanges (:attr:`Collective.after_backward`)."""
    overlapped: bool = False
    """A tensor-parallel linear's collective beside its matmul (:attr:`Collective.overlapped`)."""
    whole: bool = False
    """In one piece beside an independent matmul (:attr:`Collective.whole`)."""


@dataclasses.dataclass(frozen=True)
class _RankChunks:
    """The model chunks one rank of a pipeline stage holds, in the order the trainer registers them."""

    virtuals: tuple[int, ...]
    """Virtual stage of each chunk (``chunk x p + stage``)."""
    layers: int
    """Blocks per chunk."""
    last_virtual: int
    """The model's last virtual stage (``p v - 1``)."""
    shapes: tuple[list[tuple[int, ...]], ...]
    """Each chunk's parameter shapes (after TP sharding)."""

    @classmethod
    def of(cls, job: api_spec.TrainingJobSpec, stage: int) -> _RankChunks:
        """The chunks of one rank of ``stage``."""
        shape, par = job.model.shape(), job.parallelism
        v = par.virtual_stages
        layers = shape.layers // (par.pipeline * v)
        last = par.pipeline * v - 1
        virtuals = tuple(chunk * par.pipeline + stage for chunk in range(v))
        shapes = tuple(
            chunk_param_shapes(shape, par.tensor, layers, first=j == 0, last=j == last)
            for j in virtuals
        )
        return cls(virtuals=virtuals, layers=layers, last_virtual=last, shapes=shapes)

    @property
    def sizes(self) -> list[list[int]]:
        """Each chunk's parameter element counts."""
        return [[math.prod(s) for s in shapes] for shapes in self.shapes]

    @property
    def holds_first(self) -> bool:
        """Whether the rank holds the embeddings' chunk."""
        return 0 in self.virtuals

    @property
    def holds_last(self) -> bool:
        """Whether the rank holds the head's chunk."""
        return self.last_virtual in self.virtuals


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """A stage's gradient bucket exchanges over dp."""

    rows: list[_Row]
    """Every dp collective of a step."""
    exchanges: int = 0
    """Bucket exchanges per step (:attr:`StageComm.dp_exchanges`)."""
    last: tuple[tuple[str, str, int, int], ...] = ()
    """The legs of the last bucket's exchange (:attr:`StageComm.dp_last_exchange`)."""


def stage_comm(
    job: api_spec.TrainingJobSpec,
    stage: int,
    scheme: precision.StateScheme,
    *,
    warmup: bool = False,
) -> StageComm:
    """The collectives of one rank of pipeline ``stage`` in one optimizer step.

    A compressing job's step after its warm-up, or with ``warmup`` one of its first
    ``gradientCompression.warmupSteps`` steps, which reduce exactly (the uncompressed job's).
    """
    # A compressing reducer packs whole tensors, in its warm-up too (only its exchange is exact).
    whole_tensors = job.parallelism.gradient_compression.mode != "none"
    if warmup:
        job = gradient_compression.exact_job(job)
    par = job.parallelism
    chunks = _RankChunks.of(job, stage)
    # Context ranks hold the same parameters: their gradients are summed with the data-parallel
    # ones, over data x context ranks (Megatron-Core's dp-cp group).
    reducers = context.reducers(par)
    dp = _dp_exchange(job, chunks, scheme, whole_tensors) if reducers > 1 else _Exchange([])
    ring = _Row("cp", "send", context.ring_steps(job).calls, context.placement_bytes(job, scheme))
    rows = dp.rows + _tp_rows(job, chunks, scheme) + _pp_rows(job, chunks, scheme) + [ring]
    members = {"dp": reducers, "tp": par.tensor, "pp": par.pipeline, "cp": par.context}
    return StageComm(
        stage=stage,
        collectives=_summed(rows, members),
        dp_exchanges=dp.exchanges,
        dp_last_exchange=tuple(
            Collective(group=g, op=op, calls=calls, nbytes=nbytes, members=reducers)
            for g, op, calls, nbytes in dp.last
        ),
    )


def _summed(rows: list[_Row], members: dict[str, int]) -> tuple[Collective, ...]:
    """One :class:`Collective` per (group, op, after backward, overlapped, whole), in that order, its rows' calls and bytes summed."""
    out: dict[tuple[str, str, bool, bool, bool], list[int]] = {}
    for row in rows:
        if row.calls <= 0:
            continue
        key = (row.group, row.op, row.after_backward, row.overlapped, row.whole)
        entry = out.setdefault(key, [0, 0])
        entry[0] += row.calls
        entry[1] += int(row.nbytes)
    return tuple(
        Collective(
            group=g,
            op=op,
            calls=calls,
            nbytes=nbytes,
            members=2 if op == "send" else members[g],
            after_backward=after,
            overlapped=overlapped,
            whole=whole,
        )
        for (g, op, after, overlapped, whole), (calls, nbytes) in sorted(out.items())
    )


def _dp_exchange(
    job: api_spec.TrainingJobSpec,
    chunks: _RankChunks,
    scheme: precision.StateScheme,
    whole_tensors: bool = False,
) -> _Exchange:
    """The gradient buckets' exchanges of the job's kind, and under ZeRO the gather of the updated weights."""
    par = job.parallelism
    # Buckets never span two chunks; the last chunk's come first.
    buckets = [
        n
        for sizes in reversed(chunks.sizes)
        for n in bucket_numels(sizes, scheme.grads, par.bucket_mb)
    ]
    mode = par.gradient_compression.mode
    compressed = mode != "none"
    cast = mode in ("bf16", "fp16")
    if par.zero_stage == 2 and not (compressed or whole_tensors):  # compressing: whole tensors
        buckets = zero2_bucket_numels(chunks.sizes, scheme.grads, par.bucket_mb)
    if par.zero_stage == 3:
        exchange = _zero3_exchange(job, chunks, scheme)
    elif par.zero_stage == 2 and (cast or not compressed):  # the casts ride ZeRO-2's async launch
        wire = (
            dataclasses.replace(scheme, grads=gradient_compression.CAST_BYTES) if cast else scheme
        )
        exchange = _zero2_exchange(job, buckets, wire)
    elif compressed:
        exchange = _compressed_exchange(job, chunks, scheme)
    elif par.all_reduce == "hierarchical":
        exchange = _hierarchical_exchange(job, buckets, scheme)
    else:
        params = sum(sum(sizes) for sizes in chunks.sizes)
        exchange = _Exchange(
            [_Row("dp", "all_reduce", len(buckets), params * scheme.grads)],
            len(buckets),
            (("dp", "all_reduce", 1, buckets[-1] * scheme.grads),),
        )
    return dataclasses.replace(
        exchange, rows=exchange.rows + _zero_after_backward(job, buckets, scheme)
    )


def _zero3_exchange(
    job: api_spec.TrainingJobSpec, chunks: _RankChunks, scheme: precision.StateScheme
) -> _Exchange:
    """FSDP2's gathers (after backward's overlap) and reduce-scatters (each one exchange), the
    latter in 2-byte elements under bf16 or fp16 compression (FSDP2's ``reduce_dtype``)."""
    par = job.parallelism
    if par.gradient_compression.mode in ("bf16", "fp16"):
        scheme = dataclasses.replace(scheme, grads=gradient_compression.CAST_BYTES)
    rows = [
        _Row(group, op, calls, nbytes, after_backward=op == "all_gather")
        for group, op, calls, nbytes in zero3_collectives(
            job.model.shape(),
            par.tensor,
            context.reducers(par),
            par.micro_batches,
            list(chunks.virtuals),
            chunks.layers,
            chunks.last_virtual,
            scheme,
            keep_last_block=par.pipeline == 1,
        )
    ]
    return _Exchange(rows, sum(row.calls for row in rows if not row.after_backward))


def _zero2_exchange(
    job: api_spec.TrainingJobSpec, buckets: list[int], scheme: precision.StateScheme
) -> _Exchange:
    """Every micro-batch's backward reduce-scatters each bucket, padded to the group (so no full-size gradient outlives a micro-batch)."""
    d, m = context.reducers(job.parallelism), job.parallelism.micro_batches
    nbytes = m * sum(padded(n, d) for n in buckets) * scheme.grads
    return _Exchange(
        [_Row("dp", "reduce_scatter", m * len(buckets), nbytes)],
        m * len(buckets),
        (("dp", "reduce_scatter", 1, padded(buckets[-1], d) * scheme.grads),),
    )


def _compressed_exchange(
    job: api_spec.TrainingJobSpec, chunks: _RankChunks, scheme: precision.StateScheme
) -> _Exchange:
    """Each bucket's compressed exchange (:mod:`.gradient_compression`), from its members' shapes."""
    par = job.parallelism
    bucket_shapes = [
        [shapes[i] for i in members]
        for sizes, shapes in zip(reversed(chunks.sizes), reversed(chunks.shapes))
        for members in bucket_members(sizes, scheme.grads, par.bucket_mb)
    ]
    compression, reducers = par.gradient_compression, context.reducers(par)
    if (
        par.zero_stage == 2
    ):  # int8, topk, powersgd: every micro-batch, inline in backward's hook: exposed
        rows = gradient_compression.sharded_collectives(
            compression, bucket_shapes, reducers, scheme.grads, par.micro_batches
        )
        return _Exchange([_Row(*row, after_backward=True) for row in rows], 0)
    rows = gradient_compression.dp_collectives(compression, bucket_shapes, reducers, scheme.grads)
    last = gradient_compression.dp_collectives(
        compression, bucket_shapes[-1:], reducers, scheme.grads
    )
    return _Exchange([_Row(*row) for row in rows], len(bucket_shapes), tuple(last))


def _hierarchical_exchange(
    job: api_spec.TrainingJobSpec, buckets: list[int], scheme: precision.StateScheme
) -> _Exchange:
    """Per bucket, padded to a node's k peers: reduce-scatter inside, all-reduce of the 1/k shard across, all-gather inside."""
    k = dp_ranks_per_node(job)
    full = sum(padded(n, k) for n in buckets) * scheme.grads
    last = padded(buckets[-1], k) * scheme.grads
    return _Exchange(
        [
            _Row("dp", "reduce_scatter", len(buckets), full),
            _Row("dp", "all_reduce", len(buckets), full // k),
            _Row("dp", "all_gather", len(buckets), full),
        ],
        len(buckets),
        (
            ("dp", "reduce_scatter", 1, last),
            ("dp", "all_reduce", 1, last // k),
            ("dp", "all_gather", 1, last),
        ),
    )


def _zero_after_backward(
    job: api_spec.TrainingJobSpec, buckets: list[int], scheme: precision.StateScheme
) -> list[_Row]:
    """ZeRO after backward: the norm summed over dp and (stages 1-2) the owned weights gathered bucket by bucket."""
    par = job.parallelism
    norm = _Row("dp", "all_reduce", 1, NORM_BYTES, after_backward=True)
    if par.zero_stage == 3:
        return [norm]
    if par.zero_stage >= 1:
        weights = sum(padded(n, context.reducers(par)) for n in buckets) * scheme.weights
        return [_Row("dp", "all_gather", len(buckets), weights, after_backward=True), norm]
    return []


def _tp_rows(
    job: api_spec.TrainingJobSpec, chunks: _RankChunks, scheme: precision.StateScheme
) -> list[_Row]:
    """Tensor parallel: activations per micro-batch, then the per-step reductions (none without TP)."""
    shape, par = job.model.shape(), job.parallelism
    t, m = par.tensor, par.micro_batches
    if t == 1:
        return []
    sp = par.sequence_parallel
    # Activation checkpointing replays each block's forward in backward, and PyTorch stops the replay once
    # the last tensor backward needs exists: the MLP output's collective (its result saves nothing) is skipped.
    # The overlapped row linear's replay does the same: its collective runs whole after the matmul
    # (trainer/parallel/tensor_overlap.py, replaying), so only the attention output's is replayed, whole.
    recompute = job.training.activation_checkpointing
    b, s, h = job.training.micro_batch, shape.seq_len // par.context, shape.hidden
    # a full (B, T, H) residual-stream tensor and a row-parallel output, as they cross the group
    stream = matmul = b * s * h * scheme.wire_bytes
    blocks = chunks.layers * len(chunks.virtuals)
    first, last = chunks.holds_first, chunks.holds_last
    per_block = (
        2 * blocks * m * (stream + matmul)
    )  # each sub-layer: a stream tensor and a matmul output
    # parallelism.overlap.tensor: a linear's collective in chunks along the sequence, the same bytes
    k, fused = tp_chunks(job), par.overlap.tensor
    chunked, whole = (fused and k > 1, "chunked"), (fused, "whole")  # (overlapped, how)
    serial = (False, "chunked")
    linears = [  # (applies, op, calls, payload bytes, overlap): the linears' collectives
        # Per sub-layer, SP: gather in / reduce-scatter out forward, the reverse backward.
        (sp, "all_gather", 4 * blocks * m * k, per_block, chunked),
        (sp, "reduce_scatter", 4 * blocks * m * k, per_block, chunked),
        # SP, overlapped: the column-parallel linears keep their input's shard and gather it again
        # in backward, beside their input-gradient matmuls
        (sp and fused, "all_gather", 2 * blocks * m * k, 2 * blocks * m * stream, chunked),
        # the replayed forward: both gathers, and the attention output's reduce-scatter
        (sp and recompute, "all_gather", 2 * blocks * m * k, 2 * blocks * m * stream, chunked),
        (sp and recompute, "reduce_scatter", blocks * m, blocks * m * matmul, serial),
        # Without SP: reduce the row-parallel outputs forward (in chunks), the column-parallel
        # input gradients backward (whole, beside the weight gradient: overlapped even in one chunk)
        (not sp, "all_reduce", 2 * blocks * m * k, 2 * blocks * m * matmul, chunked),
        (not sp, "all_reduce", 2 * blocks * m, 2 * blocks * m * stream, whole),
        (not sp and recompute, "all_reduce", blocks * m, blocks * m * matmul, serial),
    ]
    rows = [  # (applies, op, calls, payload bytes)
        # vocabulary-parallel embedding: the sum of the partial lookups
        (first and sp, "reduce_scatter", m, m * stream),
        (first and sp, "all_gather", m, m * stream),
        (first and not sp, "all_reduce", m, m * stream),
        # head input gradient, then the cross entropy's max and (target, sum-exp)
        (last and sp, "all_gather", m, m * stream),
        (last and sp, "reduce_scatter", m, m * stream),
        (last and not sp, "all_reduce", m, m * stream),
        (last, "all_reduce", 2 * m, m * b * s * LOSS_BYTES * 3),
        # SP: replicated parameters' gradients are per-slice partials
        (sp, "all_reduce", 1, _replicated_params(shape, chunks) * scheme.grads),
        # replicated key/value heads: their rows' gradients summed over the ranks holding the head
        (
            shape.key_value_heads < t,
            "all_reduce",
            1,
            blocks * 2 * shape.head_dim * h * scheme.grads,
        ),
        (True, "all_reduce", 1, NORM_BYTES),
    ]
    return [
        _Row("tp", op, calls, nbytes, overlapped=overlapped, whole=overlapped and how == "whole")
        for applies, op, calls, nbytes, (overlapped, how) in linears
        if applies
    ] + [_Row("tp", op, calls, nbytes) for applies, op, calls, nbytes in rows if applies]


def tp_chunks(job: api_spec.TrainingJobSpec) -> int:
    """Chunks a tensor-parallel linear's collective runs in (1: serial, ``parallelism.overlap.tensor`` off).

    The trainer splits the sequence a rank holds (``seqLen / tensor`` under sequence parallelism)
    into :data:`~meshtrain.api.layout.TP_OVERLAP_CHUNKS`, at most one a token.
    """
    par = job.parallelism
    if not par.overlap.tensor or par.tensor == 1:
        return 1
    seq = job.model.shape().seq_len // par.context  # the tokens a context rank holds
    rows = seq // par.tensor if par.sequence_parallel else seq
    return min(layout.TP_OVERLAP_CHUNKS, max(rows, 1))


def _replicated_params(shape: api_model.ModelShape, chunks: _RankChunks) -> int:
    """Parameters a tensor rank holds whole (norms, the position table): partial gradients under SP."""
    norm = parameters.norm_params(shape)
    positions = 0 if shape.family == "llama" else shape.seq_len * shape.hidden
    return (
        2 * norm * chunks.layers * len(chunks.virtuals)
        + (positions if chunks.holds_first else 0)
        + (norm if chunks.holds_last else 0)
    )


def _pp_rows(
    job: api_spec.TrainingJobSpec, chunks: _RankChunks, scheme: precision.StateScheme
) -> list[_Row]:
    """Pipeline: activations forward, their gradients backward, then the norm scalar (none without a pipeline)."""
    shape, par = job.model.shape(), job.parallelism
    if par.pipeline == 1:
        return []
    t, h = par.tensor, shape.hidden
    message = _stage_message(job, scheme)
    sends = sum((j != chunks.last_virtual) + (j != 0) for j in chunks.virtuals) * par.micro_batches
    rows = [_Row("pp", "send", sends, sends * message)]
    if shape.tie_embeddings and (chunks.holds_first or chunks.holds_last):
        # the two copies' gradients summed
        rows.append(_Row("pp", "all_reduce", 1, parameters.vocab_rows(shape, t) * h * scheme.grads))
    return rows + [_Row("pp", "all_reduce", 1, NORM_BYTES)]


def plan_comm(
    job: api_spec.TrainingJobSpec, scheme: precision.StateScheme
) -> tuple[StageComm, ...]:
    """Collectives of every pipeline stage (ranks of one stage send alike)."""
    return tuple(stage_comm(job, stage, scheme) for stage in range(job.parallelism.pipeline))


def placement_traffic(
    job: api_spec.TrainingJobSpec, scheme: precision.StateScheme
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
    message = _stage_message(job, scheme)
    return dp, float(2 * par.micro_batches * par.virtual_stages * message)


def _stage_message(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """Bytes of one activation (or its gradient) between stages: one rank's tokens of a micro-batch.

    ``seqLen / context`` tokens per sequence, of them ``1 / tensor`` under sequence parallelism.
    """
    shape, par = job.model.shape(), job.parallelism
    seq = shape.seq_len // par.context
    if par.sequence_parallel and par.tensor > 1:
        seq //= par.tensor
    return job.training.micro_batch * seq * shape.hidden * scheme.wire_bytes
