"""``meshtrain plan --calibrate``: measure this machine into a device profile file.

It starts the job's processes and measures, all at once (so shared cores and other load are in
the figures), what the planner's time model needs: the trainer's block FLOP/s, one small
operation's fixed cost, and each collective's latency and bandwidth fitted to the ring formulas,
over wall and CPU time (docs/planner.md, "Calibration").  It lives with the trainer because the
planner imports no torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import multiprocessing
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.api import console
from meshtrain.api import spec as api_spec
from meshtrain.planner import parameters, profiles
from meshtrain.planner.timing import network, stage_work
from meshtrain.trainer import launch
from meshtrain.trainer.calibration import step_loop, steps
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import mesh, tensor

MESSAGE_BYTES = (1 << 8, 1 << 14, 1 << 18, 1 << 21)
"""Payload sizes a collective is timed at (full buffer, as the trainer's recorder counts)."""

COLLECTIVE_TIMEOUT_S = 300
"""A calibration whose peer died fails after this instead of hanging."""


def _seconds_per_call(fn: Any, budget: float, sync: Any) -> float:
    """Wall seconds per call of ``fn`` after one warm-up (see :func:`_timed_calls`)."""
    return _timed_calls(fn, budget, sync)[0]


def _timed_calls(
    fn: Any, budget: float, sync: Any, repeats: int | None = None, between: Any = None
) -> tuple[float, float]:
    """Wall and CPU seconds per call of ``fn`` after one warm-up.

    Without ``repeats``: calls fill ``budget`` seconds and the result is wall
    time over calls, so time the process was not scheduled counts (other
    ranks and other load share the cores), and the process's CPU time over
    calls, which does not.  Collectives pass ``repeats`` (every member must
    make the same number of calls) and ``between``, run untimed before each
    call: the compute a collective follows in training.  They get the mean
    wall time (a step pays the sum of its calls, so their slow tail counts:
    a peer that blocked must be woken) and the median CPU time.
    """
    fn()
    sync()
    samples: list[float] = []
    cpu_samples: list[float] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    while (
        len(samples) < repeats
        if repeats is not None
        else (time.perf_counter() - started < budget or len(samples) < 3)
    ):
        if between is not None:
            between()
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
        cpu_samples.append(time.process_time() - c0)
    if repeats is None:
        calls = len(samples)
        return (
            (time.perf_counter() - started) / calls,
            (time.process_time() - cpu_started) / calls,
        )
    return statistics.fmean(samples), statistics.median(cpu_samples)


def gemm_shapes(job: api_spec.TrainingJobSpec) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of the job's block GEMMs on one tensor-parallel rank: QKV, projection, MLP in and out."""
    shape = job.model.shape()
    t = job.parallelism.tensor
    rows = job.training.micro_batch * shape.seq_len
    h, f = shape.hidden, shape.ffn_hidden
    return [(rows, h, 3 * h // t), (rows, h // t, h), (rows, h, f // t), (rows, f // t, h)]


def matmul_flops(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, budget: float
) -> float:
    """FLOP/s of the shapes' forward and backward GEMMs together (total FLOPs over total seconds)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops = seconds = 0.0
    for rows, inner, cols in shapes:
        x = torch.randn(rows, inner, dtype=dtype, device=device)
        w = torch.randn(inner, cols, dtype=dtype, device=device)
        g = torch.randn(rows, cols, dtype=dtype, device=device)

        def step(x: torch.Tensor = x, w: torch.Tensor = w, g: torch.Tensor = g) -> None:
            x @ w  # forward
            g @ w.t()  # input gradient
            x.t() @ g  # weight gradient

        seconds += _seconds_per_call(step, budget / len(shapes), sync)
        flops += 6 * rows * inner * cols
    return flops / seconds


@dataclasses.dataclass(frozen=True)
class BlockRate:
    """The trainer's block at the job's shapes, forward and backward, as one rank measured it."""

    flops: float
    """FLOP/s over wall time (other ranks and other load sharing the cores included)."""
    core_flops: float
    """FLOP/s over this process's CPU time (the work itself, whatever the load)."""
    share: float
    """CPU seconds over wall seconds: the cores this rank received while every rank computed."""


def rank_block(job: api_spec.TrainingJobSpec, solo: dist.ProcessGroup | None) -> torch.nn.Module:
    """The trainer's block as one tensor-parallel rank runs it, without its communication.

    The block is sharded by the trainer's own
    :func:`~meshtrain.trainer.parallel.tensor.apply_tensor_parallel` (its heads and MLP
    columns, 1/t of the GEMMs) while its norms and residuals stay whole,
    as on every tensor-parallel rank.  The region's reductions run over ``solo``, a group
    of this process alone, so they cost a call and move nothing: the collectives are
    measured on their own.  Sequence parallelism is not reproduced (its norms run on 1/t
    of the tokens; the block measured here runs them on all).
    """
    shape = job.model.shape()
    degree = job.parallelism.tensor
    one_layer = dataclasses.replace(
        gpt.GPTConfig.from_shape(shape), layers=1, vocab=8 * degree, tie_embeddings=False
    )
    if degree == 1:
        return gpt.Block(one_layer)
    assert solo is not None, "a tensor-parallel block needs its one-process group"
    model = gpt.GPT(one_layer)
    model.tok_emb = model.pos_emb = model.norm = model.head = None
    tensor.apply_tensor_parallel(model, tensor.TPContext(group=solo, rank=0, size=degree))
    return model.blocks["0"]


def block_flops(
    job: api_spec.TrainingJobSpec,
    dtype: torch.dtype,
    device: torch.device,
    budget: float,
    overhead: tuple[float, float],
    solo: dist.ProcessGroup | None = None,
) -> BlockRate:
    """FLOP/s of one rank's block at the job's width, sequence, micro-batch and tensor degree, forward and backward.

    Counted as the planner counts it (``6 x the rank's block parameters +
    12 s h / t`` per token) over the block's time less the fixed cost of its
    operations (``overhead``: wall and CPU seconds per operation), so that
    FLOPs at this rate plus :data:`~meshtrain.planner.timing.stage_work.BLOCK_OPS` x
    overhead is the block's measured time: the layer norms, attention,
    activation and copies are in the rate, not only the GEMMs.  Under tensor
    parallelism the rank's GEMMs shrink and its norms do not (:func:`rank_block`),
    so the rate is lower than the whole block's.
    """
    shape = job.model.shape()
    tensor = job.parallelism.tensor
    block = rank_block(job, solo).to(device=device, dtype=dtype)
    x = torch.randn(
        job.training.micro_batch, shape.seq_len, shape.hidden, dtype=dtype, device=device
    )
    x.requires_grad_(True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        block(x).sum().backward()

    seconds, cpu = _timed_calls(step, budget, sync)
    tokens = job.training.micro_batch * shape.seq_len
    flops = (
        6 * parameters.layer_params(shape, tensor) + 12 * shape.seq_len * shape.hidden / tensor
    ) * tokens
    ops = sum(stage_work.BLOCK_OPS)
    return BlockRate(
        flops=flops / max(seconds - ops * overhead[0], 0.1 * seconds),
        core_flops=flops / max(cpu - ops * overhead[1], 0.1 * cpu),
        share=cpu / seconds,
    )


def op_overhead(device: torch.device, budget: float) -> tuple[float, float]:
    """Wall and CPU seconds per operation of a chain of tiny element-wise ops, forward and backward (dispatch, autograd, launch)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    chain = 32
    x = torch.ones(8, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    # Each link is one forward op and one backward op; sum, fill and accumulation add three.
    wall, cpu = _timed_calls(step, budget, sync)
    return wall / (2 * chain + 3), cpu / (2 * chain + 3)


def _call(
    op: str,
    full: torch.Tensor,
    shard: torch.Tensor,
    group: Any,
    peer: int | None,
    sends_first: bool,
) -> None:
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, shard, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, group=group)
    elif peer is not None:  # ping-pong between pipeline neighbours: one way is half
        first, second = (dist.send, dist.recv) if sends_first else (dist.recv, dist.send)
        first(full, peer, group=group)
        second(full, peer, group=group)


@dataclasses.dataclass(frozen=True)
class _Task:
    job: api_spec.TrainingJobSpec
    processes: int
    threads: int
    shapes: list[tuple[int, int, int]]
    groups: dict[str, list[list[int]]]
    backend: str
    dtype: torch.dtype
    budget: float
    repeats: int
    out: str
    port: int
    progress: Any = None
    """A queue rank 0 names each finished measurement on (the parent's progress)."""


def _worker(rank: int, task: _Task) -> None:
    """One of the job's processes: matmuls and small ops while all run at once, then every collective."""
    # stdout is the command's result (the plan): what the process group's C++ side prints goes to
    # stderr (torch 2.10's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks" on stdout).
    os.dup2(2, 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(task.port))
    torch.set_num_threads(task.threads)
    use_cuda = task.backend == "nccl"
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(
        task.backend,
        rank=rank,
        world_size=task.processes,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    dist.barrier()
    gemm = matmul_flops(task.shapes, task.dtype, device, task.budget)
    steps.done(task.progress, rank, steps.FIXED[0])
    overhead = op_overhead(device, task.budget)
    steps.done(task.progress, rank, steps.FIXED[1])
    solos = [dist.new_group([r]) for r in range(task.processes)]  # every rank creates every group
    solo = solos[rank]
    assert isinstance(solo, dist.ProcessGroup)  # a member of it: not the non-member sentinel
    flops = block_flops(task.job, task.dtype, device, task.budget, overhead, solo)
    steps.done(task.progress, rank, steps.FIXED[2])
    element = torch.tensor([], dtype=task.dtype).element_size()
    results: list[dict[str, Any]] = []
    rows, inner, cols = task.shapes[0]  # the block's first GEMM: what a collective follows
    a = torch.randn(rows, inner, dtype=task.dtype, device=device)
    b = torch.randn(inner, cols, dtype=task.dtype, device=device)
    compute = functools.partial(torch.mm, a, b)
    for axis, groups in task.groups.items():
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group
        mine = next(i for i, g in enumerate(groups) if rank in g)
        group, members = handles[mine], groups[mine]
        n = len(members)
        index = members.index(rank)
        peer = members[index ^ 1] if index ^ 1 < n else None
        for op in profiles.COLLECTIVE_OPS:
            for nbytes in MESSAGE_BYTES:
                numel = max(n, nbytes // element // n * n)
                full = torch.zeros(numel, dtype=task.dtype, device=device)
                shard = torch.zeros(numel // n, dtype=task.dtype, device=device)
                call = functools.partial(_call, op, full, shard, group, peer, index % 2 == 0)
                dist.barrier()
                seconds, cpu = _timed_calls(
                    call, task.budget, sync, repeats=task.repeats, between=compute
                )
                if op == "send":
                    seconds, cpu = seconds / 2, cpu / 2
                results.append(
                    {
                        "op": op,
                        "members": n,
                        "bytes": numel * element,
                        "seconds": seconds,
                        "cpu_seconds": cpu,
                    }
                )
                steps.done(task.progress, rank, f"{axis} {op}, {numel * element:,} B, {n} ranks")
        dist.barrier()
    gathered: list[Any] = [None] * task.processes
    dist.all_gather_object(
        gathered,
        {
            "flops": flops.flops,
            "core_flops": flops.core_flops,
            "share": flops.share,
            "gemm": gemm,
            "overhead": overhead[0],
            "core_overhead": overhead[1],
            "collectives": results,
            **device_memory(device),  # after every communicator has run: their buffers are held
        },
    )
    if rank == 0:
        Path(task.out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    mesh.exit_now(0)  # a teardown abort must not fail a calibration whose result is written


def fit(
    op: str,
    members: int,
    samples: dict[int, float],
    processes: int,
    cpu_samples: dict[int, float] | None = None,
) -> profiles.CollectiveFit:
    """Alpha from the smallest message, bus bandwidth from the largest (robust on a loaded host).

    ``cpu_samples`` (CPU seconds per call of one member, by payload) give the
    CPU cost per call and per byte the same way.
    """
    small, large = min(samples), max(samples)
    alpha = samples[small] / network.ring_steps(op, members)
    transfer = max(samples[large] - samples[small], 0.1 * samples[large])
    bandwidth = network.bus_factor(op, members) * (large - small) / transfer
    cpu_call = cpu_bandwidth = 0.0
    if cpu_samples:
        cpu_call = cpu_samples[small]
        cpu_transfer = max(cpu_samples[large] - cpu_samples[small], 0.1 * cpu_samples[large])
        cpu_bandwidth = (large - small) / cpu_transfer if cpu_transfer > 0 else 0.0
    return profiles.CollectiveFit(
        op=op,
        members=members,
        alpha=alpha,
        bandwidth=bandwidth,
        processes=processes,
        cpu_call_seconds=cpu_call,
        cpu_bandwidth=cpu_bandwidth,
    )


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What the job's processes measured together."""

    flops: float
    """Median over ranks of one rank's FLOP/s through the trainer's block at the job's shapes."""
    gemm_flops: float
    """Median over ranks of one rank's FLOP/s of the block's GEMMs alone."""
    op_overhead: float
    """Median over ranks of the seconds per small operation."""
    collectives: list[profiles.CollectiveFit]
    """Fits per op and group size (the slowest member of each sample)."""
    core_flops: float = 0.0
    """Median over ranks of one rank's block FLOP/s per CPU second."""
    core_op_overhead: float = 0.0
    """Median over ranks of the CPU seconds per small operation."""
    available_cores: float = 0.0
    """Sum over ranks of CPU over wall seconds while all computed the block: the cores the job received."""
    device_memory: float = 0.0
    """The smallest device's total memory as CUDA reports it (0: not measured, a CPU host)."""
    outside_tensors: float = 0.0
    """The most device memory a rank held beyond PyTorch's allocator once its communicators were up
    (of CUDA's total: the driver's own share is not in it)."""


def device_memory(device: torch.device) -> dict[str, float]:
    """The device's total memory and what this process holds of it beyond PyTorch's allocator.

    ``total - free`` is everything in use on the device; less the allocator's
    reservation it is the CUDA context, NCCL's buffers and library workspaces
    of this process (the rank has the device to itself, as a pod does).
    """
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "device_memory": float(total),
        "outside_tensors": float(total - free - torch.cuda.memory_reserved(device)),
    }


def measure(
    job: api_spec.TrainingJobSpec,
    processes: int,
    threads: int,
    backend: str,
    dtype: torch.dtype,
    budget: float,
) -> Measurement:
    """Run ``processes`` processes of ``threads`` threads, as the job would, and measure."""
    grid = job.parallelism.layout
    groups = {
        axis: grid.all_groups(axis)
        for axis in ("dp", "tp", "pp")
        if len(grid.all_groups(axis)[0]) > 1 and processes == job.world_size
    }
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        task = _Task(
            job=job,
            processes=processes,
            threads=threads,
            shapes=gemm_shapes(job),
            groups=groups,
            backend=backend,
            dtype=dtype,
            budget=budget,
            repeats=max(3, round(budget * 18)),
            out=str(Path(tmp) / "out.json"),
            port=launch.free_port(),
            progress=context.Queue(),
        )
        workers = [context.Process(target=_worker, args=(rank, task)) for rank in range(processes)]
        for worker in workers:
            worker.start()
        with console.Phase(
            f"calibrating {job.parallelism.layout_string} ({processes} processes)",
            total=steps.count(len(groups), len(MESSAGE_BYTES)),
            unit="measurements",
        ) as phase:
            steps.follow(workers, task.progress, phase)
        failed = [rank for rank, worker in enumerate(workers) if worker.exitcode]
        if failed:
            raise RuntimeError(f"calibration process(es) {failed} failed; see their output above")
        per_rank = json.loads(Path(task.out).read_text())
    # A collective ends when its slowest member does: the maximum over ranks of each sample.
    # Its CPU cost is each member's own: the mean over ranks.
    slowest: dict[tuple[str, int], dict[int, float]] = {}
    cpu: dict[tuple[str, int], dict[int, list[float]]] = {}
    for measured in per_rank:
        for row in measured["collectives"]:
            key = (row["op"], row["members"])
            table = slowest.setdefault(key, {})
            table[row["bytes"]] = max(table.get(row["bytes"], 0.0), row["seconds"])
            cpu.setdefault(key, {}).setdefault(row["bytes"], []).append(row["cpu_seconds"])
    return Measurement(
        flops=statistics.median(m["flops"] for m in per_rank),
        gemm_flops=statistics.median(m["gemm"] for m in per_rank),
        op_overhead=statistics.median(m["overhead"] for m in per_rank),
        collectives=[
            fit(
                op,
                n,
                samples,
                processes,
                {b: statistics.fmean(v) for b, v in cpu[(op, n)].items()},
            )
            for (op, n), samples in sorted(slowest.items())
        ],
        core_flops=statistics.median(m["core_flops"] for m in per_rank),
        core_op_overhead=statistics.median(m["core_overhead"] for m in per_rank),
        available_cores=sum(m["share"] for m in per_rank),
        device_memory=min((m.get("device_memory", 0.0) for m in per_rank), default=0.0),
        outside_tensors=max((m.get("outside_tensors", 0.0) for m in per_rank), default=0.0),
    )


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def calibrate(
    job: api_spec.TrainingJobSpec, base: profiles.Profile, name: str, *, budget: float = 0.5
) -> profiles.Profile:
    """Measure this machine for ``job`` and return ``base`` with the measured figures.

    ``budget``: seconds each matmul and overhead measurement runs; collectives
    repeat ``18 x budget`` times (at least 3) per op and size.
    """
    use_cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if job.training.precision != "fp32" and use_cuda else torch.float32
    cores = 0 if use_cuda else (os.cpu_count() or 1)
    load_before = load_average()
    processes = min(job.world_size, torch.cuda.device_count()) if use_cuda else job.world_size
    threads = max(1, cores // processes) if cores else 1  # as meshtrain run sets OMP_NUM_THREADS
    backend = "nccl" if use_cuda else "gloo"
    measured = measure(job, processes, threads, backend, dtype, budget)
    flops = measured.flops
    overhead = measured.op_overhead
    fits = measured.collectives
    changes: dict[str, Any] = {
        "name": name,
        "description": f"{base.description}; calibrated on {socket.gethostname()}",
        "source": f"measured by meshtrain plan --calibrate on {socket.gethostname()}, "
        f"other figures from profile {base.name}: {base.source}",
        "op_overhead": overhead,
        "cores": cores,
        "flops_by_ranks": {processes: flops} if cores else {},
        "core_flops": measured.core_flops if cores else 0.0,
        "core_op_overhead": measured.core_op_overhead if cores else 0.0,
        "available_cores": round(min(measured.available_cores, cores), 3) if cores else 0.0,
        "collectives": tuple(fits),
        "calibration": {
            "host": socket.gethostname(),
            "device": torch.cuda.get_device_name(0) if use_cuda else _cpu_model(),
            "backend": backend,
            "dtype": str(dtype).removeprefix("torch."),
            "processes": processes,
            "threads_per_process": threads,
            "job_layout": job.parallelism.layout_string,
            "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "load_average": load_before,
            "torch": str(torch.__version__),
            "collectives_measured": bool(fits),
            "gemm_flops": measured.gemm_flops,
        },
    }
    if use_cuda:
        changes["achievable_fraction"] = min(1.0, flops / base.peak_flops)
        if measured.device_memory:  # what this device has, and what its context and NCCL keep
            changes["memory_bytes"] = measured.device_memory
            # a floor, not a replacement: calibration loads fewer kernels and communicators than
            # a training process (compiled and attention kernels, the trainer's own groups)
            changes["reserved_bytes"] = max(measured.outside_tensors, base.reserved_bytes)
            changes["calibration"]["outside_tensors_bytes"] = measured.outside_tensors
        return dataclasses.replace(base, **changes)
    changes.update(peak_flops=flops, achievable_fraction=1.0)
    return measure_step_loop(job, dataclasses.replace(base, **changes))


def measure_step_loop(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> profiles.Profile:
    """``profile`` with the figures of a step-loop run of ``job``'s layout on this CPU host.

    The step loop's CPU and its share between actions, the tensor-parallel
    calls' wall and CPU costs and the pipeline's message latencies are the
    layout's own (:mod:`.step_loop`); the micro-benchmarks' figures stay.
    ``--search --calibrate`` measures its best layouts this way.  A GPU
    profile is returned as is.
    """
    if not profile.cpu_time_model:
        return profile
    # Another layout's step-loop figures (a profile calibrated for the job, measuring a
    # candidate of --search) say nothing here and must not be subtracted from this run.
    micro_benchmarks = dataclasses.replace(
        profile,
        rank_step_cpu_seconds=0.0,
        step_loop_between_share=1.0,
        tp_collectives=(),
        activation_message_seconds=0.0,
        gradient_message_seconds=0.0,
    )
    with console.Phase(f"calibrating {job.parallelism.layout_string}: step-loop run", unit="runs"):
        loop_run = step_loop.run(job)
    # The calls' own costs first: the step loop is what the run spent beyond them.
    fitted = dataclasses.replace(
        micro_benchmarks,
        tp_collectives=step_loop.in_situ_tp_fits(
            loop_run["tp_calls"], job.parallelism.tensor, micro_benchmarks
        ),
        activation_message_seconds=step_loop.message_seconds(loop_run, "activations"),
        gradient_message_seconds=step_loop.message_seconds(loop_run, "gradients"),
    )
    loop_cpu, predicted = step_loop.rank_step_cpu(job, fitted, loop_run)
    return dataclasses.replace(
        fitted,
        rank_step_cpu_seconds=loop_cpu,
        step_loop_between_share=step_loop.between_share(loop_run, job, fitted, loop_cpu),
        calibration={
            **profile.calibration,
            "step_loop_layout": job.parallelism.layout_string,
            "step_loop_run": {**loop_run, "predicted_rank0_cpu_seconds": predicted},
        },
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
