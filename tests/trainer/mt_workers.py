"""Functions the multi-process tests run on every rank, and the single-device reference.

:func:`train_cases` (build the mesh, take step-1 gradients
gathered to dense tensors, then train a few steps and return the losses) for
a list of specs of one world size, and :func:`reference`, a plain one-process
training loop written without any meshtrain parallel or optimizer code (dense
GPT, ``F.cross_entropy`` on the whole global batch, ``clip_grad_norm_``,
``torch.optim.AdamW`` and torch's own warmup + cosine LR schedulers).

Not tests; assertions live in the test modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.trainer import engine
from meshtrain.trainer.data import batches, dataset
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.parallel import state_bytes, tensor, zero
from meshtrain.trainer.telemetry import live_bytes, recording


def second_step_peak(raw: dict) -> tuple[int, int]:
    """This rank's pipeline stage and the peak live bytes of its second training step of job ``raw``
    (the training state registered first; the first step creates what is created lazily)."""
    job = loading.parse_spec(raw)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    eng = engine.Engine(job, mesh)
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
    with tracker:
        eng.train_step()  # creates what is lazily created (AdamW's moments)
        tracker.reset_peak()
        eng.train_step()
    return mesh.coords.pp, tracker.peak


def dense_grads(eng: engine.Engine) -> dict[str, torch.Tensor]:
    """Gradients of this rank's parameters as dense tensors (gathered over TP); only dp0/tp0 ranks return them."""
    mesh, plan = eng.mesh, eng.model.tp_plan
    out = {}
    sharded = (
        _gather_grad_shards(eng) if isinstance(eng.model.reducer, zero.ShardedGradReducer) else {}
    )
    for name, param in eng.model.named_params:
        grad = sharded[name] if sharded else param.grad.detach().clone()
        if isinstance(grad, DTensor):  # ZeRO-3: rows spread over dp
            grad = grad.full_tensor()
        if plan is not None and name in plan.shards:
            pieces = [torch.empty_like(grad) for _ in range(mesh.layout.tensor)]
            dist.all_gather(pieces, grad.contiguous(), group=mesh.group("tp"))
            grad = tensor.unshard(pieces, plan.shards[name])
        out[name] = grad
    return out if mesh.coords.dp == 0 and mesh.coords.tp == 0 else {}


def _gather_grad_shards(eng: engine.Engine) -> dict[str, torch.Tensor]:
    """ZeRO-2 keeps only this rank's shard of every gradient bucket: all-gather them over dp (x cp), by name."""
    names = {id(p): n for n, p in eng.model.named_params}
    group, size = eng.mesh.grad_group
    out = {}
    for bucket in eng.model.reducer.buckets:
        full = torch.empty(bucket.buffer.numel() * size, dtype=bucket.buffer.dtype)
        dist.all_gather_into_tensor(full, bucket.buffer, group=group)
        offset = 0
        for p, first, numel in bucket.members():  # a large parameter spans several buckets
            grad = out.setdefault(names[id(p)], torch.zeros_like(p))
            grad.view(-1)[first : first + numel] = full[offset : offset + numel]
            offset += numel
    return out


def train_cases(cases: list[tuple[str, dict]], steps: int) -> dict[str, dict]:
    """For each (id, spec dict): step-1 dense gradients and ``steps`` losses, plus DP collective counts."""
    results, meshes = {}, {}
    for case_id, raw in cases:
        job = loading.parse_spec(raw)
        layout = job.parallelism.layout
        if layout not in meshes:  # group creation is slow on a busy machine: one mesh per layout
            meshes[layout] = mesh_mod.build_mesh(layout, torch.device("cpu"))
        mesh = meshes[layout]
        first = engine.Engine(job, mesh)
        first.forward_backward()
        grads = dense_grads(first)
        recorder = recording.MemoryRecorder()
        eng = engine.Engine(job, mesh, recorder=recorder)
        losses, norms, dp_collectives, computes = [], [], [], []
        for _ in range(steps):
            result = eng.train_step()
            losses.append(result.loss)
            norms.append(result.grad_norm)
            dp_collectives.append(
                sum(
                    1
                    for e in recorder.events
                    if e.what == "collective"
                    and e.group == "dp"
                    and e.kind == "all_reduce"
                    and e.bucket is not None
                )
            )
            computes.append(
                sorted(
                    (e.kind, e.microbatch, e.chunk) for e in recorder.events if e.what == "compute"
                )
            )
        dp_levels: dict[str, list[int]] = {}  # "op/level" -> [calls, bytes] of the last step
        for e in recorder.events:
            if e.what == "collective" and e.group == "dp" and e.bucket is not None:
                entry = dp_levels.setdefault(f"{e.kind}/{e.level}", [0, 0])
                entry[0] += 1
                entry[1] += e.nbytes
        buckets = len(eng.model.reducer.buckets) if eng.model.reducer else 0
        results[case_id] = {
            "grads": grads,
            "losses": losses,
            "norms": norms,
            "dp_collectives": dp_collectives,
            "buckets": buckets,
            "dp_levels": dp_levels,
            "bucket_bytes": [
                b.buffer.numel() * b.buffer.element_size() for b in eng.model.reducer.buckets
            ]
            if eng.model.reducer
            else [],
            "param_tensors": len(eng.model.named_params),
            "computes": computes,
            "tp_collectives": recorder.count("collective", "tp"),
            "recv_waits": recorder.count("wait"),
        }
    return results


def whole_batches(files: list, job: api_spec.TrainingJobSpec, seed: int) -> batches.BatchSampler:
    """A sampler of whole global batches (one device, one micro-batch)."""
    return batches.BatchSampler(
        files,
        seq_len=job.model.shape().seq_len,
        micro_batch=job.global_batch,
        micro_batches=1,
        dp_rank=0,
        dp_size=1,
        seed=seed,
    )


def reference(raw: dict, steps: int, forward=None) -> dict:
    """Single process, no parallel code: step-1 gradients and per-step losses.

    ``forward(model, inputs)`` gives the (G, T, V) logits (default: ``model(inputs)``).
    """
    forward = forward or (lambda model, inputs: model(inputs))
    job = loading.parse_spec(raw)
    t = job.training
    config = gpt.GPTConfig.from_shape(job.model.shape())
    tokens = dataset.open_dataset(t, vocab=config.vocab, seq_len=config.seq_len)
    sampler = whole_batches(tokens, job, t.seed)

    def loss_of(model: gpt.GPT, index: int) -> torch.Tensor:
        batch = sampler.global_batch_at(index)  # (G, T+1)
        logits = forward(model, batch[:, :-1])  # (G, T, V)
        return F.cross_entropy(logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1))

    model = llama.build(config, seed=t.seed)
    loss_of(model, 0).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    model = llama.build(config, seed=t.seed)
    opt, schedule = _torch_adamw_with_schedule(model, job)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, step)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return {"grads": grads, "losses": losses, "norms": norms}


def _torch_adamw_with_schedule(model: torch.nn.Module, job: api_spec.TrainingJobSpec):
    """torch's AdamW (decay on matrices only, betas as GPT-3) and torch's LR schedulers.

    Linear warmup from lr/warmup at step 1 to the peak at step ``warmup``, then
    cosine annealing to the minimum over the remaining steps: the schedule the
    spec documents, built from torch's own classes.
    """
    t = job.training
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=t.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    if t.warmup_steps < 1:
        raise ValueError("the reference schedule needs warmupSteps >= 1")
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(1, t.steps - t.warmup_steps), eta_min=t.min_learning_rate
    )
    warm = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / t.warmup_steps, total_iters=max(1, t.warmup_steps - 1)
    )
    return opt, torch.optim.lr_scheduler.SequentialLR(
        opt, [warm, cosine], milestones=[t.warmup_steps - 1]
    )


def evaluate_cases(cases: list[tuple[str, dict]], steps: int) -> dict[str, list[float]]:
    """For each (id, spec dict): the validation loss before training and after ``steps`` steps.

    A blocking point-to-point call raises: the pipeline batches all of them
    (``batch_isend_irecv``), evaluation included.
    """
    results = {}

    def blocking(*args: object, **kwargs: object) -> None:
        raise AssertionError("blocking send/recv: pipeline p2p must go through batch_isend_irecv")

    dist.recv = dist.send = blocking  # type: ignore[assignment]  # a spawned worker's own module
    for case_id, raw in cases:
        job = loading.parse_spec(raw)
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        losses = [eng.evaluate()]
        for _ in range(steps):
            eng.train_step()
        losses.append(eng.evaluate())
        results[case_id] = losses
    return results


def reference_eval(raw: dict) -> float:
    """Validation loss of the initial dense model, without meshtrain's parallel code or engine."""
    job = loading.parse_spec(raw)
    t = job.training
    config = gpt.GPTConfig.from_shape(job.model.shape())
    files = dataset.open_dataset(t, vocab=config.vocab, seq_len=config.seq_len)
    _, held_out = dataset.open_eval(t, files, vocab=config.vocab, seq_len=config.seq_len)
    sampler = whole_batches(held_out, job, t.seed + 1)
    model = llama.build(config, seed=t.seed)
    total = 0.0
    with torch.no_grad():
        for index in range(t.eval.batches):
            batch = sampler.global_batch_at(index)
            logits = model(batch[:, :-1])
            total += F.cross_entropy(
                logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1)
            ).item()
    return total / t.eval.batches
