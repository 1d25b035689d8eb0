"""The training engine: one optimizer step of this rank, from batch to updated weights.

:class:`Engine` builds this rank's share of the dense model (the same initial weights on every
layout), its optimizer and samplers, and runs steps: the pipeline schedule with the gradient
reduction overlapped, clipping, AdamW, and one world all-reduce on which every rank agrees on the
loss.  Processes, the step log and checkpoints are the worker's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.api import spec as api_spec
from meshtrain.trainer.data import batches, dataset, special_tokens, token_files
from meshtrain.trainer.guards import loss_guard, noise_scale
from meshtrain.trainer.interop import config_json, from_hf
from meshtrain.trainer.models import documents, gpt, llama
from meshtrain.trainer.optim import adamw, batch_change, lr_schedule
from meshtrain.trainer.parallel import (
    clipping,
    compilation,
    context,
    loss,
    parallelize,
    zero,
    zero3,
)
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import clocks, recording

AGREE_RANGE = "meshtrain.agree"
"""``record_function`` name of the step's bookkeeping all-reduce (loss, stop flag, shares): not
training communication and not timed, so ``benchmarks/bench_mfu.py --profile`` leaves it out."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (identical on every rank)."""

    step: int
    """1-based optimizer step."""
    loss: float
    """Mean loss over the global batch."""
    tokens: int
    """Tokens in the global batch."""
    seconds: float
    """Wall time of the step on this rank."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used."""
    stop: bool = False
    """Some rank was asked to stop (:mod:`.guards.stopping`): every rank stops after this step."""
    skipped: str = ""
    """Why the loss guard skipped this step's update (empty: applied)."""
    shared: tuple[float, ...] = ()
    """Every rank's ``share`` of this step, indexed by global rank (empty when none was given)."""
    noise_scale: float | None = None
    """Gradient noise scale in sequences (moving estimate; None when not measured or not yet positive)."""

    @property
    def tokens_per_second(self) -> float:
        """Throughput of the whole job over this step."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' means bf16 on GPU and fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast_for(
    precision: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """The context the executor runs forward and backward in: bf16 autocast, or nothing (fp32).

    No cast cache: each weight is used once per forward, and a cached cast lives until the
    forward ends even when recompute (activation checkpointing, selective recompute) frees
    what autograd saved; uncached, a weight's bf16 copy lives only as long as autograd keeps
    it (planner.memory.weight_cast_bytes counts those).
    """
    if precision != "bf16":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, cache_enabled=False)


def norm_groups(mesh: mesh_mod.Mesh, zero_stage: int) -> list[tuple[str, dist.ProcessGroup]]:
    """The axes whose ranks hold different parts of the gradient, for its global norm."""
    layout = mesh.layout
    sharded_axes = (("tp", layout.tensor), ("pp", layout.pipeline))
    groups = [(axis, mesh.group(axis)) for axis, degree in sharded_axes if degree > 1]
    group, size = mesh.grad_group
    if (
        zero_stage == 3 and size > 1
    ):  # each data (x context) rank holds other rows of every gradient
        groups.insert(0, ("dp", group))
    return groups


def scan_share(device: torch.device) -> token_files.Share | None:
    """Every rank of the job, splitting the id scan of a token file no record vouches for (None: alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None

    def max_over_ranks(values: list[int]) -> list[int]:
        found = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return [int(v) for v in found.tolist()]

    return token_files.Share(dist.get_rank(), dist.get_world_size(), max_over_ranks)


class Engine:
    """This rank's model share, optimizer and data, and the step loop body."""

    def __init__(
        self,
        spec: api_spec.TrainingJobSpec,
        mesh: mesh_mod.Mesh,
        *,
        recorder: recording.StepRecorder | None = None,
    ) -> None:
        """Weights are fp32 (master weights under bf16 autocast)."""
        spec = from_hf.with_config(spec)  # config.json's values where the spec is silent
        self.spec = spec
        self.mesh = mesh
        self.clock = clocks.for_device(mesh.device)
        """Times every event reported to the recorder."""
        recorder = recorder or recording.NullRecorder()
        self.recorder = (
            recording.DeferredRecorder(recorder, self.clock)
            if isinstance(self.clock, clocks.CudaClock)
            else recorder
        )
        """``recorder``, behind a DeferredRecorder when the clock's stamps are CUDA events."""
        training, par = spec.training, spec.parallelism
        self.config = gpt.GPTConfig.from_shape(spec.model.shape())
        self.precision = resolve_precision(training.precision, mesh.device)
        self.lr_plan = batch_change.LrPlan()
        """Multiplier on the spec's rates after a resume at another batch (set by the checkpointer)."""
        self.model = self._parallel_model()
        self.compiled = training.compile and compilation.apply_compile(
            self.model.chunks, mesh.device
        )
        """Whether the blocks run compiled (``training.compile`` and a backend that works here)."""
        self._compile_watch = compilation.FallbackWatch() if self.compiled else None
        if self.compiled and self.precision == "bf16":  # fp32 logits: no copy to save, stay eager
            self.model.executor.loss_fn = functools.partial(
                loss.lm_loss, fused=loss.FusedChunkMath.compiled(compilation.BACKEND)
            )
        self.optimizer = self._optimizer()
        tokens = dataset.open_dataset(
            training,
            vocab=self.config.vocab,
            seq_len=self.config.seq_len,
            share=scan_share(mesh.device),
        )
        self.token_ids = _token_ids(tokens, spec.model.init.from_hf)
        """Begin/end-of-text ids of the data's tokenizer; checkpoints carry them to ``meshtrain export``."""
        self.hf_max_positions = (
            config_json.max_positions(spec.model.init.from_hf) if spec.model.init.from_hf else None
        )
        """The imported model's ``max_position_embeddings``; checkpoints carry it to ``meshtrain export``."""
        self.sampler, self.eval_sampler = self._samplers(tokens)
        """The training batches, and the fixed evaluation batches (None when training.eval is off)."""
        self.document_end = (
            dataset.document_end(f.path for f in tokens)  # eval files: agreed by open_dataset
            if training.document_mask
            else None
        )
        """The end-of-text id documents end with (``training.documentMask``); None: no mask."""
        self.guard = (
            loss_guard.LossGuard.from_spec(training.loss_guard)
            if training.loss_guard.enabled
            else None
        )
        self._norm_counted = self.model.norm_counted(mesh.coords.tp)
        self._norm_groups = norm_groups(mesh, par.zero_stage)
        self.noise = self._noise_tracker()
        """The gradient noise scale from each replica's own and the all-reduced gradient (None: not measured)."""
        self.step = 0
        """Optimizer steps done."""
        self._squares: float | None = None
        """This rank's share of the last batch's squared document lengths (:meth:`_document_squares`)."""

    def _parallel_model(self) -> parallelize.ParallelModel:
        """This rank's share of the dense model every rank describes alike (seed, or Hugging Face weights)."""
        spec, training, par = self.spec, self.spec.training, self.spec.parallelism
        with torch.device(
            "meta"
        ):  # shapes only: parallelize builds just this rank's pieces, by name and seed
            dense = llama.build(
                self.config, seed=training.seed, recompute_blocks=training.activation_checkpointing
            )
        gpt.set_selective_recompute(dense, training.selective_recompute)
        if spec.model.init.from_hf:  # every rank reads its own pieces from the directory
            dense.initial_weights = from_hf.HFWeights(spec.model.init.from_hf, self.config)
        return parallelize.parallelize(
            dense,
            self.mesh,
            schedule=par.schedule,
            virtual_stages=par.virtual_stages,
            micro_batches=par.micro_batches,
            micro_batch=training.micro_batch,
            sequence_parallel=par.sequence_parallel,
            bucket_mb=par.bucket_mb,
            recorder=self.recorder,
            clock=self.clock,
            autocast=autocast_for(self.precision, self.mesh.device),
            wire_dtype=torch.bfloat16 if self.precision == "bf16" else None,
            zero_stage=par.zero_stage,
            compression=par.gradient_compression,
            all_reduce=par.all_reduce,
            gpus_per_node=spec.resources.gpus_per_node,
            float8_spec=training.float8,
            overlap_tensor=par.overlap.tensor,
        )

    def _optimizer(self) -> torch.optim.AdamW | zero.ZeroAdamW:
        """AdamW, with its moments sharded over the data-parallel group under ZeRO-1/2."""
        training, stage = self.spec.training, self.spec.parallelism.zero_stage
        if stage in (1, 2) and self.model.reducer is not None:
            prefetch = self.spec.parallelism.overlap.param_gather
            optimizer = zero.ZeroAdamW(
                self.model.named_params,
                self.model.reducer,
                stage=stage,
                lr=training.learning_rate,
                weight_decay=training.weight_decay,
                recorder=self.recorder,
                clock=self.clock,
                prefetch_into=list(self.model.chunks) if prefetch else None,
            )
            if optimizer.prefetch:
                self.model.before_read = optimizer.wait_gathers
            return optimizer
        return adamw.build_adamw(
            self.model.named_params,
            lr=training.learning_rate,
            weight_decay=training.weight_decay,
        )

    def _samplers(
        self, tokens: list[token_files.TokenFile]
    ) -> tuple[batches.BatchSampler, batches.BatchSampler | None]:
        """The training sampler over ``tokens`` and the evaluation sampler over the held-out data (or None)."""
        training = self.spec.training
        tokens, held_out = dataset.open_eval(
            training,
            tokens,
            vocab=self.config.vocab,
            seq_len=self.config.seq_len,
            share=scan_share(self.mesh.device),
        )
        sampling = dict(
            seq_len=self.config.seq_len,
            micro_batch=training.micro_batch,
            micro_batches=self.spec.parallelism.micro_batches,
            dp_rank=self.mesh.coords.dp,
            dp_size=self.mesh.layout.data,
        )
        sampler = batches.BatchSampler(
            tokens, seed=training.seed, sampling=training.sampling, **sampling
        )
        held = (
            batches.BatchSampler(held_out, seed=training.seed + 1, **sampling) if held_out else None
        )
        return sampler, held

    def _noise_tracker(self) -> noise_scale.Tracker | None:
        """Measure the noise scale where the reducer sees each replica's whole local gradient.

        Not with ZeRO-2 (micro-batches are reduce-scattered one by one), ZeRO-3 (FSDP2 reduces; no
        reducer) nor where some gradients are partials until after the reduction: sequence
        parallelism, replicated key/value heads, embeddings tied across stages.  Nor with
        ``gradientCompression`` other than none: the all-reduced gradient is then the
        decompressed approximation (with error feedback, even another step's mass), so
        |G_big|^2 and the estimate would measure the compression error, not the batch noise.
        """
        reducer = self.model.reducer
        par, data_degree = self.spec.parallelism, self.mesh.layout.data
        partial = (
            par.context > 1  # a cp rank's gradient is its share of the tokens'
            or par.sequence_parallel
            or (self.model.tp_plan is not None and self.model.tp_plan.kv_replicas > 1)
            or (self.config.tie_embeddings and par.pipeline > 1)
        )
        compressed = par.gradient_compression.mode != "none"
        if reducer is None or data_degree < 2 or par.zero_stage == 2 or partial or compressed:
            return None
        reducer.measure_local_norm(
            [p for p, counted in zip(self.params, self._norm_counted) if counted]
        )
        small = self.spec.training.micro_batch * par.micro_batches
        return noise_scale.Tracker(small, small * data_degree)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """This rank's parameters."""
        return [p for _, p in self.model.named_params]

    def forward_backward(self) -> torch.Tensor:
        """Draw the next batch, run the schedule, finish every gradient reduction; returns this stage's loss sum."""
        micro = self.sampler.next()
        executor = self.model.executor
        inputs = [self._on_device(mb.inputs) for mb in micro] if executor.needs_inputs else None
        targets = [self._on_device(mb.targets) for mb in micro] if executor.holds_loss else None
        loss = executor.run(inputs, targets, self._documents(micro))
        self._squares = self._document_squares(micro)
        if self.model.reducer is not None:
            self.model.reducer.finish()
        plan = self.model.tp_plan
        if plan is not None and plan.sequence_partial:
            # under SP, norm and position-table gradients are per-sequence-slice partials
            sizes = {n: p.numel() for n, p in self.model.named_params}
            whole = {n: (0, sizes[n]) for n in plan.sequence_partial}
            self._sum_grad_ranges(whole, self.mesh.group("tp"))
        if plan is not None and plan.replica_partial and self.model.kv_group is not None:
            # a replicated key/value head's rows hold each holder's query heads' share
            self._sum_grad_ranges(plan.replica_partial, self.model.kv_group)
        if self.model.tied_group is not None:
            # tied embeddings over stages: the first stage's lookup and the last stage's head
            # each hold a share; both copies get the sum and so stay equal (Megatron's embedding group)
            numel = dict(self.model.named_params)[gpt.TIED_NAME].numel()
            self._sum_grad_ranges({gpt.TIED_NAME: (0, numel)}, self.model.tied_group, axis="pp")
        return loss

    def _documents(
        self, micro: list[batches.MicroBatch]
    ) -> Callable[[int], documents.Documents] | None:
        """Micro-batch index -> its document mask and positions (None without ``training.documentMask``).

        Every stage builds them from the token ids its sampler read (the first stage's
        inputs), so none travel between stages; every tensor rank builds the same.
        """
        eos = self.document_end
        if eos is None:
            return None
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32  # attention's queries
        layout, cp = self.mesh.layout, self.mesh.coords.cp
        if layout.context > 1:  # this rank's queries against every cp rank's keys
            return lambda index: context.documents_of(
                self._on_device(micro[index].inputs, whole=True), eos, cp, layout.context
            )
        return lambda index: documents.of_tokens(self._on_device(micro[index].inputs), eos, dtype)

    def _document_squares(self, micro: list[batches.MicroBatch]) -> float | None:
        """This rank's share of the step's sum of squared document lengths (None without a mask).

        Each data-parallel replica's stages, context and tensor ranks hold the same rows: each
        adds 1 / (tensor x context x pipeline) of them, so the world sum (:meth:`_agree`) counts
        every row once.
        """
        if self.document_end is None:
            return None
        rows = sum(documents.squares(mb.inputs, self.document_end) for mb in micro)
        layout = self.mesh.layout
        return rows / (layout.tensor * layout.context * layout.pipeline)

    def _on_device(self, tokens: torch.Tensor, *, whole: bool = False) -> torch.Tensor:
        """This rank's part of a batch tensor (its slices of the sequence under context
        parallelism, unless ``whole``) on the device without a host sync (pinned, non-blocking
        copy on CUDA)."""
        layout = self.mesh.layout
        if layout.context > 1 and not whole:
            tokens = context.shard(tokens, self.mesh.coords.cp, layout.context)
        if self.mesh.device.type != "cuda":
            return tokens
        return tokens.pin_memory().to(self.mesh.device, non_blocking=True)

    def _sum_grad_ranges(
        self, ranges: dict[str, tuple[int, int]], group: dist.ProcessGroup, *, axis: str = "tp"
    ) -> None:
        """Sum the flat ranges ``ranges`` of the named parameters' gradients over ``group`` (one all-reduce)."""
        if (
            isinstance(self.optimizer, zero.ZeroAdamW) and self.optimizer.stage == 2
        ):  # only dp shards of grads exist
            self.optimizer.all_reduce_grads(ranges, group, self.recorder, self.clock)
            return
        views = []
        for n, p in self.model.named_params:
            if (
                n in ranges and p.grad is not None
            ):  # ZeRO-3: within the local rows, the same on every peer
                grad, offset = zero3.local(p.grad), zero3.flat_offset(p)
                view = clipping.flat_slice(grad, *ranges[n], offset=offset)
                if view is not None:
                    views.append(view)
        if not views:  # the same on every peer: their shapes (and ZeRO shards) are alike
            return
        flat = torch.cat(views)  # one collective for all of them
        recording.blocking_collective(
            self.recorder,
            self.clock,
            axis,
            "all_reduce",
            flat.numel() * flat.element_size(),
            lambda: dist.all_reduce(flat, group=group),
        )
        offset = 0
        for view in views:
            view.copy_(flat[offset : offset + view.numel()])
            offset += view.numel()

    def _agree(
        self,
        loss_sum: torch.Tensor,
        stop_requested: bool,
        norm: torch.Tensor,
        share: float | None,
        local_square: torch.Tensor | None = None,
        squares: float | None = None,
    ) -> tuple[float, bool, float, tuple[float, ...], float, float | None]:
        """The global batch's mean loss, whether any rank asked to stop, the gradient norm,
        every rank's ``share``, and the replicas' mean small-batch squared gradient norm.

        One all-reduce over the world, then the step's one host sync: a
        single read of (loss, stop, shares, norm) together.  Only the last stage holds
        a loss, each of its tensor-parallel ranks the same one: dividing by
        tensor x data before the sum leaves the mean over the data-parallel
        replicas (and x context: each cp rank holds the mean over its equal share of the tokens).  ``norm`` is already global (the clip reduced it).  Each rank
        writes its share into its own slot of a zero vector, so the sum is the
        gathered vector.  ``local_square`` (this rank's part of its replica's own
        squared gradient norm) rides along: summed over the world and divided by
        ``data`` it is the replicas' mean small-batch squared norm (NaN when not measured).
        ``squares`` (this rank's share of the batch's squared document lengths) rides along
        too: the world sum is the global batch's (None when not counted).
        """
        layout = self.mesh.layout
        ranks_per_loss = layout.tensor * layout.data * layout.context
        loss_share = loss_sum.detach().double().reshape(1) / ranks_per_loss
        flag = torch.full(
            (1,), 1.0 if stop_requested else 0.0, dtype=torch.float64, device=loss_share.device
        )
        parts = [loss_share, flag]
        if squares is not None:
            parts.append(torch.full_like(flag, squares))
        if local_square is not None:
            parts.append(local_square.detach().double().reshape(1) / layout.data)
        if share is not None:  # filled on the device: no host-to-device copy, no sync
            slots = torch.zeros(layout.world_size, dtype=torch.float64, device=loss_share.device)
            slots[dist.get_rank()] = share
            parts.append(slots)
        value = torch.cat(parts)
        with torch.profiler.record_function(AGREE_RANGE):
            dist.all_reduce(value)
        loss, stops, *rest, grad_norm = torch.cat(
            [value, norm.detach().double().reshape(1)]
        ).tolist()
        total_squares = round(rest.pop(0)) if squares is not None else None
        small_square = rest.pop(0) if local_square is not None else float("nan")
        return loss, stops > 0, grad_norm, tuple(rest), small_square, total_squares

    def zero_grad(self) -> None:
        """Clear gradients (in place when they live in reducer buckets)."""
        if self.model.reducer is not None:
            self.model.reducer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, stop_requested: bool = False, share: float | None = None) -> StepResult:
        """One optimizer step; ``stop_requested``: this rank wants the run to stop after it (see ``StepResult.stop``).

        ``share``: a number every rank learns from this step's world all-reduce
        (``StepResult.shared``); the worker shares its previous step's compute
        seconds for straggler detection, with no collective of its own.
        """
        training = self.spec.training
        step = self.step + 1
        start = self.clock.start_step()  # host time on every device
        self.recorder.step_start(step, start)
        peak, minimum = training.learning_rates(self.spec.parallelism)
        lr = lr_schedule.lr_at(
            step, peak=peak, minimum=minimum, warmup=training.warmup_steps, total=training.steps
        ) * self.lr_plan.multiplier(step)
        lr_schedule.set_lr(self.optimizer, lr)
        if self.model.reducer is not None:  # compression's exact warm-up counts optimizer steps
            self.model.reducer.start_step(step)
        loss_sum = self.forward_backward()
        clip = (
            self.optimizer.clip_grad_norm
            if isinstance(self.optimizer, zero.ZeroAdamW)
            else clipping.clip_grad_norm
        )
        norm_tensor = clip(
            self.params,
            counted=self._norm_counted,
            max_norm=training.grad_clip,
            groups=self._norm_groups,
            recorder=self.recorder,
            clock=self.clock,
        )
        local_square = None
        if self.noise is not None:  # every rank adds its part, so the all-reduce has one shape
            local_square = self.model.reducer.take_local_square()
            if local_square is None:
                local_square = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        loss, stop, norm, shared, small_square, squares = self._agree(
            loss_sum, stop_requested, norm_tensor, share, local_square, self._squares
        )
        noise = self.noise.update(small_square, norm * norm) if self.noise is not None else None
        verdict = self.guard.judge(loss, norm) if self.guard else None  # same on every rank
        if verdict is None or not verdict.skip:
            self.optimizer.step()
        elif self.model.reducer is not None:
            self.model.reducer.discard_step()
        self.zero_grad()
        self.step = step
        if self._compile_watch is not None:
            self._compile_watch.say_once()
        seconds = time.perf_counter() - start
        tokens = self.sampler.global_batch * self.config.seq_len
        if squares is None:
            self.recorder.step_end(step, loss, tokens, seconds)
        else:  # attention counted over the documents the mask leaves
            flops = gpt.training_flops(self.config, tokens, squares)
            self.recorder.step_end(step, loss, tokens, seconds, model_flops=flops)
        return StepResult(
            step=step,
            loss=loss,
            tokens=tokens,
            seconds=seconds,
            grad_norm=norm,
            lr=lr,
            stop=stop,
            skipped=verdict.reason if verdict is not None and verdict.skip else "",
            shared=shared,
            noise_scale=noise,
        )

    @property
    def compile_fallbacks(self) -> int:
        """Compiled frames that failed to compile and ran eagerly since the engine was built."""
        return self._compile_watch.count() if self._compile_watch is not None else 0

    def evaluate(self) -> float:
        """Mean loss over the fixed evaluation batches (identical on every rank and layout)."""
        executor = self.model.executor
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for index in range(self.spec.training.eval.batches):
            micro = self.eval_sampler.at(index)
            inputs = [self._on_device(mb.inputs) for mb in micro] if executor.needs_inputs else None
            targets = [self._on_device(mb.targets) for mb in micro] if executor.holds_loss else None
            total += executor.forward_only(inputs, targets, self._documents(micro)).double()
        layout = self.mesh.layout
        ranks = layout.tensor * layout.data * layout.context
        share = total / (ranks * self.spec.training.eval.batches)
        dist.all_reduce(share)  # only last-stage ranks hold a loss, each tp rank the same one
        return share.item()


def _token_ids(files: list[token_files.TokenFile], from_hf: str | None) -> special_tokens.TokenIds:
    """:func:`.special_tokens.for_job`, an oversized file it reads refused as a bad dataset is."""
    try:
        return special_tokens.for_job(files, from_hf)
    except token_files.TokenFileError as err:
        raise dataset.DatasetError(str(err)) from None
