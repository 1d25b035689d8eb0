"""ZeRO stages 1 and 2: optimizer state (and, at 2, gradients) sharded over the data-parallel group.

Each gradient bucket is padded to ``N * ceil(n / N)`` elements and rank ``r`` owns a flat range of
it (:func:`shard_range`, :func:`segments`).  :class:`ZeroAdamW` keeps AdamW's moments for the owned
range only and all-gathers the updated weights; :class:`ShardedGradReducer` (stage 2) keeps only
the owned gradients.  The fp32 weights are the master copy, so stage 1 shards just the moments
(docs/checkpoints.md, "ZeRO").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import clipping, param_gather, reducer
from meshtrain.trainer.telemetry import clocks, recording


def shard_size(numel: int, size: int) -> int:
    """Elements per rank of a flat buffer of ``numel`` elements padded to a multiple of ``size``."""
    return -(-numel // size)


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """The flat range [start, stop) of a buffer of ``numel`` elements that ``rank`` of ``size`` owns (may be empty)."""
    s = shard_size(numel, size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls inside a rank's owned range of its bucket."""

    member: int
    """Index of the parameter in its bucket."""
    start: int
    """First owned element in the parameter's own flat order."""
    stop: int
    """One past the last owned element."""
    shard_offset: int
    """Where the first owned element sits in the rank's shard buffer."""

    @property
    def numel(self) -> int:
        """Owned elements."""
        return self.stop - self.start


def segments(numels: list[int], start: int, stop: int) -> list[Segment]:
    """The segments of consecutive tensors (flat sizes ``numels``) that overlap the flat range [start, stop)."""
    found, offset = [], 0
    for member, numel in enumerate(numels):
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            found.append(
                Segment(member=member, start=lo - offset, stop=hi - offset, shard_offset=lo - start)
            )
        offset += numel
    return found


def expected_bytes_per_param(
    *, stage: int, dp: int, weight: int = 4, grad: int = 4, optimizer: int = 8
) -> dict[str, float]:
    """The ZeRO paper's per-parameter bytes: weights, gradients, optimizer state on one rank.

    Defaults are meshtrain's fp32 weights with AdamW (two fp32 moments);
    mixed precision with a separate fp32 master is ``weight=2, grad=2, optimizer=12``.
    """
    return {
        "params": weight / dp if stage >= 3 else float(weight),
        "grads": grad / dp if stage >= 2 else float(grad),
        "optimizer": optimizer / dp if stage >= 1 else float(optimizer),
    }


def _reduce_scatter(
    out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, size: int
) -> dist.Work:
    """Sum ``full`` over the group, leaving this rank's 1/size slice in ``out`` (asynchronous).

    gloo implements ``reduce_scatter_tensor`` for fp32 and bf16 CPU tensors on
    every supported torch (2.10 to 2.15); for a backend or dtype that lacks it, the fallback
    all-reduces ``full`` and copies the slice when waited on (same sums,
    more traffic).
    """
    try:
        work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
        assert work is not None  # async_op=True returns the Work (the stub says Work | None)
        return work
    except (RuntimeError, NotImplementedError):
        work = dist.all_reduce(full, group=group, async_op=True)
        work.wait()
        rank = dist.get_rank(group)
        out.copy_(full.narrow(0, rank * out.numel(), out.numel()))
        return work


IN_FLIGHT_BUCKETS = 1
"""ZeRO-2 reduce-scatters in flight at once, beside the bucket being packed: each holds a packed,
full-size bucket until it is done."""
MIN_BUCKETS = 16
"""ZeRO-2 cuts a rank's gradients into at least this many buckets (fewer only where ``bucketMb``
already does), so the packed buckets alive at once stay a small part of the gradients it saves."""


def plan_spans(sizes: list[int], bucket: int, cap: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive tensors (flat sizes ``sizes``) in buckets of at least ``bucket`` elements (the
    last may hold fewer) and at most ``cap`` (>= 2 x ``bucket``): a bucket closes once it holds
    ``bucket``, as :func:`.reducer.plan_buckets` closes a whole-tensor one, and a tensor that
    would take it past ``cap`` is cut there and goes on in the next.  Per bucket, (tensor index,
    first element, elements) of each slice."""
    buckets: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for index, numel in enumerate(sizes):
        first = 0
        while first < numel:
            if buckets[-1] and filled >= bucket:
                buckets.append([])
                filled = 0
            take = min(numel - first, cap - filled)
            buckets[-1].append((index, first, take))
            filled, first = filled + take, first + take
    return [b for b in buckets if b]


class ShardedGradReducer(reducer.GradReducer):
    """ZeRO-2 gradient reduction: reduce-scatter per bucket; a rank keeps only its owned gradient range.

    ``bucket.buffer`` is the rank's gradient shard (``ceil(n/N)`` elements), not a full-size
    buffer.  Autograd allocates a parameter's ``.grad`` in backward; as soon as it is final for
    this micro-batch it is copied into the packed, full-size buffer of each bucket holding a slice
    of it and released (DeepSpeed's stage 2 copies into its reduce bucket the same way), and a
    bucket whose slices have all arrived is reduce-scattered and its result added to the shard.
    That happens after *every* micro-batch's backward: keeping ``.grad`` across micro-batches
    would hold the full gradients, which is what ZeRO-2 exists to avoid.  Buckets hold at least
    ``bucketMb`` (at most 1/:data:`MIN_BUCKETS` of the gradients) and at most the larger of twice
    that and 1/:data:`MIN_BUCKETS` of the gradients, so a large tensor (the embedding, the head)
    is split over several (:func:`plan_spans`); one bucket is
    packed while at most :data:`IN_FLIGHT_BUCKETS` are reduced.
    """

    split_tensors = True
    """Whether a tensor past a bucket's cap is cut across buckets (False keeps whole tensors: a
    compressor that works on whole matrices, such as PowerSGD, needs them)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        flat = [p for chunk in params for p in (chunk if isinstance(chunk, list) else [chunk])]
        self._total = sum(p.numel() for p in flat if p.requires_grad)
        # bucket index -> (wire buffer, reduced shard, start, scale) of its collective in flight
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, clocks.Stamp, float]] = {}
        self._packing: dict[int, torch.Tensor] = {}  # bucket index -> full buffer being filled
        self._in_flight: list[reducer.Bucket] = []  # launch order
        self._slices: dict[int, list[tuple[reducer.Bucket, int, int, int]]] = {}
        """id(param) -> (bucket, offset in the bucket, first element, elements) of its slices."""
        super().__init__(params, **reducer_args)

    def _add_buckets(
        self, members: list[torch.nn.Parameter], element_size: int, bucket_bytes: int
    ) -> None:
        if self.split_tensors:
            share = -(-self._total // MIN_BUCKETS)
            size = max(1, min(bucket_bytes // element_size, share))
            cap = max(2 * size, share)
        else:  # whole tensors in bucketMb buckets, as plain data parallelism packs them
            size, cap = max(1, bucket_bytes // element_size), self._total
        for planned in plan_spans([p.numel() for p in members], size, cap):
            numel = sum(n for _, _, n in planned)
            shard = torch.zeros(
                shard_size(numel, self.group_size),
                dtype=members[0].dtype,
                device=members[0].device,
            )
            bucket = reducer.Bucket(
                index=len(self.buckets),
                params=[members[i] for i, _, _ in planned],
                buffer=shard,
                spans=[(first, n) for _, first, n in planned],
            )
            offset = 0
            for p, first, n in bucket.members():
                p.grad = None
                self._bucket_of[id(p)] = bucket
                self._slices.setdefault(id(p), []).append((bucket, offset, first, n))
                offset += n
            self.buckets.append(bucket)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        flat = grad.reshape(-1)
        complete = []
        for bucket, offset, first, n in self._slices[id(param)]:
            if bucket.index not in self._packing:
                shard = bucket.buffer
                self._packing[bucket.index] = torch.zeros(
                    shard.numel() * self.group_size, dtype=shard.dtype, device=shard.device
                )
            self._packing[bucket.index].narrow(0, offset, n).copy_(flat.narrow(0, first, n))
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                complete.append(bucket)
        param.grad = None
        for bucket in complete:
            self._launch(bucket)

    def _launch(self, bucket: reducer.Bucket) -> None:
        """Reduce-scatter the bucket's packed buffer (at most IN_FLIGHT_BUCKETS others still running)."""
        self._settle(bucket)
        while len(self._in_flight) >= IN_FLIGHT_BUCKETS:  # bound the packed buffers alive
            self._settle(self._in_flight[0])
        start = self.clock.now()
        wire, scale = self._on_wire(self._pack(bucket))
        reduced = torch.empty(bucket.buffer.numel(), dtype=wire.dtype, device=wire.device)
        # gloo's reduce-scatter work has no future to hang a callback on: time it from packing to the
        # end the clock's wait returns (the host's at wait; on CUDA the side stream's end event).
        self._pending[bucket.index] = (
            wire,
            reduced,
            start,
            scale,
        )  # live until the collective is done
        bucket.work = self.clock.launch(
            lambda: _reduce_scatter(reduced, wire, self.group, self.group_size)
        )
        self._in_flight.append(bucket)
        bucket.ready = 0

    def _pack(self, bucket: reducer.Bucket) -> torch.Tensor:
        """The bucket's packed, full-size (padded) buffer, filled as its members' gradients arrived
        (zeros where a member had none this micro-batch); the reducer lets go of it."""
        full = self._packing.pop(bucket.index, None)
        if full is None:
            shard = bucket.buffer
            full = torch.zeros(
                shard.numel() * self.group_size, dtype=shard.dtype, device=shard.device
            )
        return full

    def _on_wire(self, full: torch.Tensor) -> tuple[torch.Tensor, float]:
        """What the reduce-scatter carries for the packed bucket ``full``, and the factor its result
        is added to the shard with: ``full`` itself and 1 here (a 16-bit cast's mean and the group size
        in :mod:`.compression_sharded`)."""
        return full, 1.0

    def _settle(self, bucket: reducer.Bucket) -> None:
        """Wait for the bucket's collective in flight, if any, and add its result to the shard."""
        if bucket.work is None:
            return
        end = bucket.work.wait()
        self._in_flight.remove(bucket)
        wire, reduced, start, scale = self._pending.pop(bucket.index)
        self.recorder.collective(
            "dp",
            "reduce_scatter",
            wire.numel() * wire.element_size(),
            start,
            end,
            bucket=bucket.index,
        )
        bucket.buffer.add_(reduced, alpha=scale)
        bucket.work = None

    def finish(self) -> None:
        """Reduce what is left, wait for every bucket and turn sums into means; only shards remain."""
        for bucket in self.buckets:  # gradients assigned outside autograd (no hook fired) pack now
            for p in bucket.params:
                if p.grad is not None:
                    self._on_grad(p)
        for bucket in self.buckets:
            if bucket.index in self._packing:  # some member had no gradient this micro-batch
                self._launch(bucket)
        for bucket in self.buckets:
            self._settle(bucket)
            bucket.buffer.div_(self.group_size)
            bucket.ready = 0
        self.sync = True

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard of every bucket, in bucket order."""
        return [b.buffer for b in self.buckets]


@dataclasses.dataclass
class _BucketState:
    """What a rank keeps for one bucket."""

    params: list[torch.nn.Parameter]
    """The bucket's members, in flat order."""
    spans: list[tuple[int, int]]
    """(first element, elements) of each member's slice in the bucket."""
    start: int
    """Owned flat range of the bucket: [start, stop)."""
    stop: int
    segments: list[Segment]
    """Owned parts of the members."""
    exp_avg: torch.Tensor
    """First moment of the owned range (padded to the shard size)."""
    exp_avg_sq: torch.Tensor
    """Second moment of the owned range."""
    numel: int
    """Elements of the bucket."""


def _write(state: _BucketState, full: torch.Tensor) -> None:
    """Copy a gathered bucket into its members' slices."""
    offset = 0
    for p, (first, n) in zip(state.params, state.spans):
        p.detach().view(-1).narrow(0, first, n).copy_(full.narrow(0, offset, n))
        offset += n


def _owned(state: _BucketState, work: torch.Tensor | None = None) -> torch.Tensor:
    """The owned weights of a bucket packed flat (shard-sized), or written back from ``work``."""
    packed = torch.zeros_like(state.exp_avg) if work is None else work
    for seg in state.segments:
        weights = state.params[seg.member].detach().view(-1).narrow(0, seg.start, seg.numel)
        target = packed.narrow(0, seg.shard_offset, seg.numel)
        if work is None:
            target.copy_(weights)
        else:
            weights.copy_(target)
    return packed


class ZeroAdamW:
    """AdamW whose moments and update are sharded over the data-parallel group (ZeRO stage 1 or 2).

    It keeps the two moments of every bucket's owned range only (``8 / N`` bytes per parameter
    in fp32), updates the owned weights, then all-gathers each bucket's updated elements so every
    replica holds the full weights again.  The arithmetic is ``torch.optim.AdamW``'s elementwise
    sequence, so ZeRO 0, 1 and 2 give the same numbers.

    Exposes ``param_groups`` (one dict per weight-decay class, with ``lr``) so
    :func:`meshtrain.trainer.optim.lr_schedule.set_lr` works unchanged.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        grad_reducer: reducer.GradReducer,
        *,
        stage: int,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        recorder: recording.StepRecorder | None = None,
        clock: clocks.Clock | None = None,
        prefetch_into: list[torch.nn.Module] | None = None,
    ) -> None:
        """``prefetch_into``: the model chunks whose layers wait for their weights' all-gathers
        (``parallelism.overlap.paramGather``); None: every bucket is gathered inside :meth:`step`."""
        if stage not in (1, 2):
            raise ValueError(f"ZeroAdamW is for ZeRO stages 1 and 2, got {stage}")
        if stage == 2 and not isinstance(grad_reducer, ShardedGradReducer):
            raise ValueError("ZeRO-2 needs the ShardedGradReducer (gradients reduce-scattered)")
        self.stage = stage
        self.reducer = grad_reducer
        self.group, self.size = grad_reducer.group, grad_reducer.group_size
        self.rank = dist.get_rank(self.group)
        self.recorder = recorder or recording.NullRecorder()
        self.clock = clock or clocks.HostClock()
        self.names = {id(p): n for n, p in named_params}
        self.param_groups = [
            {"name": "decay", "lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps},
            {"name": "no_decay", "lr": lr, "weight_decay": 0.0, "betas": betas, "eps": eps},
        ]
        self.step_count = 0
        """Optimizer steps taken (AdamW's bias-correction step)."""
        self.buckets: list[_BucketState] = []
        for bucket in grad_reducer.buckets:
            members = bucket.members()
            numel = sum(n for _, _, n in members)
            start, stop = shard_range(numel, self.rank, self.size)
            segs = [  # in each parameter's own flat order, past the slices other buckets hold
                dataclasses.replace(
                    seg,
                    start=seg.start + members[seg.member][1],
                    stop=seg.stop + members[seg.member][1],
                )
                for seg in segments([n for _, _, n in members], start, stop)
            ]
            s = shard_size(numel, self.size)
            like = bucket.params[0]
            self.buckets.append(
                _BucketState(
                    params=bucket.params,
                    spans=[(first, n) for _, first, n in members],
                    start=start,
                    stop=stop,
                    segments=segs,
                    numel=numel,
                    exp_avg=torch.zeros(s, dtype=like.dtype, device=like.device),
                    exp_avg_sq=torch.zeros(s, dtype=like.dtype, device=like.device),
                )
            )
        self.gathers = param_gather.GatherQueue(self.group, self.size, self.recorder, self.clock)
        """Prefetched all-gathers not yet written into the parameters."""
        self.serial_waits: list[tuple[clocks.Stamp, clocks.Stamp]] = []
        """Blocking all-gathers of the serial path since the last :meth:`take_gather_waits`."""
        self.prefetch = prefetch_into is not None and self.size > 1
        """Whether the updated weights are gathered during the next forward."""
        self._hooks = []
        if self.prefetch and prefetch_into is not None:
            self._hooks = self._hook_layers(prefetch_into)

    def _hook_layers(self, chunks: list[torch.nn.Module]) -> list[Any]:
        """A forward pre-hook on every layer: wait for (and write) its buckets' gathers."""
        buckets_of: dict[int, set[int]] = {}
        for index, state in enumerate(self.buckets):
            for p in state.params:
                buckets_of.setdefault(id(p), set()).add(index)

        def hook_for(needs: set[int]) -> Any:
            def pre_hook(_module: torch.nn.Module, _args: Any) -> None:
                if self.gathers:
                    self.gathers.settle(needs)

            return pre_hook

        waits = param_gather.layer_waits(chunks, lambda p: buckets_of.get(id(p), set()))
        return [module.register_forward_pre_hook(hook_for(needs)) for module, needs in waits]

    def wait_gathers(self) -> None:
        """Write every prefetched gather into the parameters (before anything reads them outside a forward)."""
        self.gathers.settle_all()

    def take_gather_waits(self) -> list[tuple[clocks.Stamp, clocks.Stamp]]:
        """Intervals the training thread blocked on parameter all-gathers since the last call (cleared)."""
        waits, self.serial_waits = self.serial_waits + self.gathers.take_waits(), []
        return waits

    # --- gradients of the owned range ------------------------------------------

    def _owned_grad(self, index: int) -> torch.Tensor:
        """The owned gradient elements of bucket ``index`` as one flat tensor (shard-sized)."""
        state = self.buckets[index]
        if self.stage == 2:
            return self.reducer.buckets[index].buffer
        flat = self.reducer.buckets[index].buffer  # stage 1: the full all-reduced bucket
        return flat.narrow(0, state.start, state.stop - state.start)

    def clip_grad_norm(
        self,
        params: list[torch.nn.Parameter],
        *,
        counted: list[clipping.Counted],
        max_norm: float,
        groups: list[tuple[recording.Group, dist.ProcessGroup]],
        recorder: recording.StepRecorder | None = None,
        clock: clocks.Clock | None = None,
    ) -> torch.Tensor:
        """Global L2 gradient norm from owned elements (summed over dp, then tp and pp); clip like clip_grad_norm_.

        Same signature as :func:`meshtrain.trainer.parallel.clipping.clip_grad_norm`:
        ``counted[i]`` says what this rank counts of ``params[i]``
        (tensor-parallel replicas count once).
        """
        counted_by_id = {id(p): c for p, c in zip(params, counted)}
        recorder = recorder or self.recorder
        clock = clock or self.clock
        views = []
        for index, state in enumerate(self.buckets):
            for seg in state.segments:
                wanted = counted_by_id.get(id(state.params[seg.member]), True)
                if wanted is False:
                    continue
                lo, hi = (seg.start, seg.stop) if wanted is True else wanted
                view = self._owned_view(index, seg, lo, hi)
                if view is not None:
                    views.append(view)
        device = self.buckets[0].exp_avg.device if self.buckets else torch.device("cpu")
        owned = [self._owned_grad(index) for index in range(len(self.buckets))]
        return clipping.reduce_norm_and_clip(
            clipping.squared_norm(views, device),
            owned,
            max_norm=max_norm,
            groups=[("dp", self.group), *groups],
            recorder=recorder,
            clock=clock,
        )

    def _owned_view(self, index: int, seg: Segment, start: int, stop: int) -> torch.Tensor | None:
        """The owned gradient elements of ``seg``'s parameter inside its flat range [start, stop), if any."""
        lo, hi = max(start, seg.start), min(stop, seg.stop)
        if lo >= hi:
            return None
        return self._owned_grad(index).narrow(0, seg.shard_offset + lo - seg.start, hi - lo)

    def all_reduce_grads(
        self,
        ranges: dict[str, tuple[int, int]],
        group: dist.ProcessGroup,
        recorder: recording.StepRecorder,
        clock: clocks.Clock,
    ) -> None:
        """Sum the owned gradient elements of each named parameter's flat range over ``group`` (stage 2).

        Sequence parallelism leaves norm and position-table gradients as
        per-slice partials to be summed over the tensor-parallel group, and
        replicated key/value heads leave their rows' gradients partial per
        holder; under ZeRO-2 only the owned range exists, and it is the same
        range on every tensor-parallel peer (their buckets have identical
        shapes), so the owned elements are summed.
        """
        views = []
        for index, state in enumerate(self.buckets):
            for seg in state.segments:
                wanted = ranges.get(self.names[id(state.params[seg.member])])
                view = None if wanted is None else self._owned_view(index, seg, *wanted)
                if view is not None:
                    views.append(view)
        if not views:  # the same on every peer: their owned ranges are identical
            return
        flat = torch.cat(views)  # one collective for all of them
        recording.blocking_collective(
            recorder,
            clock,
            "tp",
            "all_reduce",
            flat.numel() * flat.element_size(),
            lambda: dist.all_reduce(flat, group=group),
        )
        offset = 0
        for view in views:
            view.copy_(flat.narrow(0, offset, view.numel()))
            offset += view.numel()

    # --- the update --------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned elements, then all-gather every bucket's weights.

        With prefetch the gathers are queued in forward order (the reverse of the buckets')
        and written by the layers' pre-hooks; any still pending from before are written first.
        """
        self.wait_gathers()
        self.step_count += 1
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        bias1 = 1 - beta1**self.step_count
        bias2_sqrt = math.sqrt(1 - beta2**self.step_count)
        decay_of = {
            "decay": self.param_groups[0]["weight_decay"],
            "no_decay": self.param_groups[1]["weight_decay"],
        }
        order = range(len(self.buckets))
        for index in reversed(order) if self.prefetch else order:
            state = self.buckets[index]
            owned = state.stop - state.start
            work = _owned(state)  # owned weights, flat
            for seg in state.segments:
                wd = (
                    decay_of["decay"]
                    if state.params[seg.member].dim() >= 2
                    else decay_of["no_decay"]
                )
                if wd:
                    work.narrow(0, seg.shard_offset, seg.numel).mul_(1 - lr * wd)
            grad = self._owned_grad(index).narrow(0, 0, owned)
            w, m, v = (
                work.narrow(0, 0, owned),
                state.exp_avg.narrow(0, 0, owned),
                state.exp_avg_sq.narrow(0, 0, owned),
            )
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            w.addcdiv_(m, denom, value=-lr / bias1)
            if self.prefetch:  # owned weights wait in the parameters, packed again at launch
                _owned(state, work)
                pack, write = functools.partial(_owned, state), functools.partial(_write, state)
                self.gathers.put(param_gather.Gather(index=index, shard=pack, write=write))
            else:
                self._gather(state, work)

    def _gather(self, state: _BucketState, work: torch.Tensor) -> None:
        """All-gather the owned weights of a bucket (blocking) and write them into every member."""
        if self.size == 1:
            full = work
        else:
            full = torch.empty(work.numel() * self.size, dtype=work.dtype, device=work.device)
            start = self.clock.now()
            dist.all_gather_into_tensor(full, work, group=self.group)
            end = self.clock.now()
            self.recorder.collective(
                "dp", "all_gather", full.numel() * full.element_size(), start, end
            )
            self.serial_waits.append((start, end))
        _write(state, full)

    def zero_grad(self) -> None:
        """Gradients live in the reducer; it zeroes them."""
        self.reducer.zero_grad()

    # --- checkpoint view -----------------------------------------------------------

    def owned_state(self) -> list[tuple[str, torch.nn.Parameter, int, torch.Tensor, torch.Tensor]]:
        """(name, param, first owned element, exp_avg slice, exp_avg_sq slice) for every owned segment."""
        out = []
        for state in self.buckets:
            for seg in state.segments:
                p = state.params[seg.member]
                out.append(
                    (
                        self.names[id(p)],
                        p,
                        seg.start,
                        state.exp_avg.narrow(0, seg.shard_offset, seg.numel),
                        state.exp_avg_sq.narrow(0, seg.shard_offset, seg.numel),
                    )
                )
        return out

    @property
    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """The moments by bucket, shaped like ``torch.optim.Optimizer.state`` for code that walks it (telemetry)."""
        return {
            i: {"exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq}
            for i, b in enumerate(self.buckets)
        }

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (both moments, padding included)."""
        return sum(
            t.numel() * t.element_size() for b in self.buckets for t in (b.exp_avg, b.exp_avg_sq)
        )
