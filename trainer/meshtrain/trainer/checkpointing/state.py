"""What a meshtrain checkpoint holds, and saving and loading it with ``torch.distributed.checkpoint``.

:func:`state_dict` describes a rank's training state as DCP entries keyed by dense names
(``model.<param>``, ``optim.<param>.exp_avg``, ``trainer``, ``rng.<rank>``, ``compression.*``;
docs/checkpoints.md, "What a checkpoint holds"), each rank contributing its pieces, so DCP's load
plan lets any (dp, pp, tp, zero) layout load any other.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:  # the public module (torch 2.15)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # torch 2.10 has only the private one (2.15 deprecates it)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import sharded, store
from meshtrain.trainer.optim import batch_change
from meshtrain.trainer.parallel import compression, zero, zero3

TRAINER_KEY = "trainer"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _tp_position(engine: Any) -> tuple[int, int]:
    tp = engine.model.tp
    return (tp.rank, tp.size) if tp is not None else (0, 1)


def dense_layout(engine: Any) -> dict[str, tuple[tuple[int, ...], list[sharded.Box]]]:
    """Dense shape and this rank's boxes of every parameter it holds, by dense name."""
    shards = engine.model.tp_plan.shards if engine.model.tp_plan is not None else {}
    rank, size = _tp_position(engine)
    out = {}
    for name, p in engine.model.named_params:
        spec = shards.get(name)
        if spec is None:
            out[name] = (tuple(p.shape), sharded.whole(p.shape))
        else:  # a padded vocabulary: blocks of the padded extent, cut at the true one
            padded = spec.extent and p.shape[spec.dim] * size
            dense = padded or spec.dense_extent(p.shape[spec.dim], size)
            out[name] = sharded.split_boxes(
                tuple(p.shape),
                dim=spec.dim,
                groups=spec.groups,
                rank=rank,
                size=size,
                blocks=spec.local_blocks(dense, size),
                replicas=spec.block_replicas(),
            )
            if spec.extent:
                out[name] = sharded.clip_boxes(*out[name], dim=spec.dim, extent=spec.extent)
    return out


def pieces_of(tensor: torch.Tensor, boxes: list[sharded.Box]) -> list[sharded.Piece]:
    """Views of this rank's elements of a parameter-shaped tensor, as pieces of the dense tensor.

    Under ZeRO-3 the tensor is a DTensor (its shape: the tensor-parallel
    piece's) whose local rows are a flat range of that piece, cut into
    rectangles like a ZeRO-1/2 moment range.
    """
    if isinstance(tensor, DTensor):
        flat = tensor.to_local().reshape(-1)  # a view: a load writes into the live shard
        return sharded.pieces_of_flat(flat, zero3.flat_offset(tensor), tuple(tensor.shape), boxes)
    return sharded.pieces_of(tensor, boxes)


def init_optimizer_state(optimizer: Any) -> None:
    """Create ``torch.optim.AdamW``'s state now (zero moments, step 0), exactly as its first step would.

    Loading needs tensors to read into, and memory accounting wants them to exist.
    """
    if isinstance(optimizer, zero.ZeroAdamW):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_step(optimizer: Any) -> int:
    """AdamW's step count (the bias-correction exponent)."""
    if isinstance(optimizer, zero.ZeroAdamW):
        return optimizer.step_count
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def set_optimizer_step(optimizer: Any, step: int) -> None:
    """Set AdamW's step count on every parameter."""
    if isinstance(optimizer, zero.ZeroAdamW):
        optimizer.step_count = step
        return
    for state in optimizer.state.values():
        state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _moment_pieces(
    engine: Any, layouts: dict[str, tuple[tuple[int, ...], list[sharded.Box]]]
) -> dict[str, list[sharded.Piece]]:
    optimizer = engine.optimizer
    pieces: dict[str, list[sharded.Piece]] = {f"{n}.{m}": [] for n in layouts for m in MOMENTS}
    if isinstance(optimizer, zero.ZeroAdamW):
        for name, p, start, exp_avg, exp_avg_sq in optimizer.owned_state():
            boxes = layouts[name][1]
            for moment, flat in zip(MOMENTS, (exp_avg, exp_avg_sq)):
                pieces[f"{name}.{moment}"] += sharded.pieces_of_flat(
                    flat, start, tuple(p.shape), boxes
                )
        return pieces
    init_optimizer_state(optimizer)
    for name, p in engine.model.named_params:
        state = optimizer.state[p]
        for moment in MOMENTS:
            pieces[f"{name}.{moment}"] += pieces_of(state[moment], layouts[name][1])
    return pieces


def trainer_record(engine: Any) -> dict[str, Any]:
    """The small, replicated part of the state (JSON-able)."""
    training = engine.spec.training
    return {
        "step": engine.step,
        "optimizer_step": optimizer_step(engine.optimizer),
        "data": engine.sampler.state_dict(),
        "loss_guard": engine.guard.state_dict() if engine.guard is not None else None,
        "schedule": {
            "kind": "warmup-cosine",
            "peak": training.learning_rate,
            "minimum": training.min_learning_rate,
            "warmup": training.warmup_steps,
            "total": training.steps,
            "lr": engine.optimizer.param_groups[0]["lr"],
        },
        "batch": batch_change.saved_record(
            training, engine.spec.parallelism, engine.lr_plan, engine.step
        ),
    }


def compression_entries(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's error-feedback and Q tensors (live, loaded in place), under layout-specific keys.

    ``compression.<run>.<rank>.<key>``: ``<run>`` names the mode and its parameters, the layout
    and the bucket size, because bucket ``b`` member ``i`` means the same tensor only when all of
    those are the same; otherwise the state starts fresh (zero error, the seeded Q), as at step 1.
    """
    grad_reducer = engine.model.reducer
    if not isinstance(grad_reducer, compression.Compressing):
        return {}
    par = engine.spec.parallelism
    sharded = "-z2" if par.zero_stage == 2 else ""  # ZeRO-2's error covers the padded bucket
    run = (
        f"{grad_reducer.mode}-r{grad_reducer.rank}-k{grad_reducer.topk_ratio}-"
        f"dp{par.data}pp{par.pipeline}tp{par.tensor}v{par.virtual_stages}-b{par.bucket_mb}{sharded}"
    ).replace(".", "_")
    rank = dist.get_rank()
    return {f"compression.{run}.{rank}.{key}": t for key, t in grad_reducer.state.items()}


def state_dict(engine: Any, *, rng: bool = True) -> dict[str, Any]:
    """This rank's DCP state dict: views of its live tensors under dense names (docs/checkpoints.md).

    Every entry is a piece of a dense tensor, so DCP's load plan reads each rank's pieces from
    whatever pieces were written.
    """
    layouts = dense_layout(engine)
    entries: dict[str, Any] = {}
    named = dict(engine.model.named_params)
    for name, (shape, boxes) in layouts.items():
        p = named[name]
        entries[f"model.{name}"] = sharded.chunked(shape, pieces_of(p.detach(), boxes), p.dtype)
    for key, pieces in _moment_pieces(engine, layouts).items():
        name = key.rsplit(".", 1)[0]
        entries[f"optim.{key}"] = sharded.chunked(layouts[name][0], pieces, named[name].dtype)
    entries[TRAINER_KEY] = json.dumps(trainer_record(engine), sort_keys=True)
    entries.update(compression_entries(engine))
    if rng:
        entries[f"rng.{dist.get_rank()}"] = torch.get_rng_state()
    return entries


def writer(directory: store.Location) -> StorageWriter:
    """DCP's writer of ``directory``: its file-system writer, or over fsspec (s3fs) for a bucket."""
    if isinstance(directory, storage.ObjectPath):
        return FsspecWriter(directory.url, **storage.options())
    directory.mkdir(parents=True, exist_ok=True)
    return dcp.FileSystemWriter(str(directory))


def reader(directory: store.Location) -> StorageReader:
    """DCP's reader of ``directory`` (over fsspec for a bucket)."""
    if isinstance(directory, storage.ObjectPath):
        return FsspecReader(directory.url, **storage.options())
    return dcp.FileSystemReader(str(directory))


def save_into(storage_writer: StorageWriter, entries: dict[str, Any]) -> None:
    """Every rank writes its entries with its :func:`writer` (collective; the writer is made before,
    so a rank failing to make one fails before any rank enters DCP's collectives)."""
    dcp.save(entries, storage_writer=storage_writer)


def read_metadata(directory: store.Location) -> Any:
    """DCP's global metadata of a checkpoint; raises CheckpointError naming the file."""
    try:
        return reader(directory).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file
        raise store.CheckpointError(
            f"{directory / '.metadata'}: unreadable DCP metadata ({err})"
        ) from None


def check_compatible(directory: store.Location, entries: dict[str, Any], metadata: Any) -> None:
    """Refuse before reading data when a tensor this rank needs is absent or has another dense shape."""
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor) or key.startswith("rng."):
            continue
        if key not in stored:
            problems.append(f"{key}: not in the checkpoint")
        elif tuple(stored[key].size) != tuple(value.shape):
            problems.append(
                f"{key}: checkpoint has shape {tuple(stored[key].size)}, this job has {tuple(value.shape)}"
            )
    if problems:
        listing = "\n  ".join(problems[:10]) + (
            f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        )
        raise store.CheckpointError(f"{directory}: does not fit this job's model:\n  {listing}")


def prepare_load(directory: store.Location, engine: Any) -> tuple[dict[str, Any], bool]:
    """This rank's entries to load from ``directory`` and whether its RNG state is there (local, no collective).

    Refuses (CheckpointError) before any data is read when the checkpoint does not fit the model.
    """
    init_optimizer_state(engine.optimizer)
    entries = state_dict(engine)
    metadata = read_metadata(directory)
    rng_key = f"rng.{dist.get_rank()}"
    rng_ok = rng_key in metadata.state_dict_metadata and tuple(
        metadata.state_dict_metadata[rng_key].size
    ) == tuple(entries[rng_key].shape)
    if not rng_ok:
        del entries[rng_key]
    stored = metadata.state_dict_metadata
    for key in compression_entries(engine):  # another run's (or none): this one starts fresh
        if key not in stored or tuple(stored[key].size) != tuple(entries[key].shape):
            del entries[key]
    check_compatible(directory, entries, metadata)
    return entries, rng_ok


def load_prepared(
    directory: store.Location, prepared: tuple[dict[str, Any], bool], storage_reader: StorageReader
) -> dict[str, Any]:
    """Load the entries of :func:`prepare_load` into the live tensors with ``storage_reader`` (collective).

    Returns the trainer record.  The reader is made before (:func:`reader`), with the other local steps.
    """
    entries, rng_ok = prepared
    try:
        dcp.load(entries, storage_reader=storage_reader)
    except Exception as err:  # DCP wraps per-rank failures; name the checkpoint
        raise store.CheckpointError(f"{directory}: loading failed: {err}") from err
    record: dict[str, Any] = json.loads(entries[TRAINER_KEY])
    if rng_ok:
        torch.set_rng_state(entries[f"rng.{dist.get_rank()}"])
    return record
