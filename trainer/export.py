"""``meshtrain export CHECKPOINT -o HF_DIR``: a meshtrain checkpoint as a Hugging Face model directory.

``CHECKPOINT`` is one published checkpoint (``step-NNNNNNNN``, with its
``COMPLETE`` marker) or a checkpoint root, whose newest checkpoint is taken.
The checkpoint is layout-independent (:mod:`.checkpointing.state`), so one
process reads every parameter whole, whatever layout wrote it, and
:mod:`.hf` writes ``config.json`` + ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from meshtrain.api import exitcodes
from meshtrain.api import spec as spec_mod
from meshtrain.trainer import hf
from meshtrain.trainer import model as gpt
from meshtrain.trainer.checkpointing import state, store


def find_checkpoint(path: Path) -> tuple[Path, store.Marker]:
    """The checkpoint directory ``path`` names (itself, or its newest), marker read and files verified."""
    if (path / store.MARKER).is_file():
        marker = store.read_marker(path)
        store.verify(path, marker, hashes=True)
        return path, marker
    found = store.latest(path)
    if found is None:
        raise store.CheckpointError(f"{path}: no published checkpoint (step-NNNNNNNN) here")
    return found[0].path, found[1]


def read_dense(directory: Path) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint as a whole tensor, by its meshtrain name (one process)."""
    metadata = state.read_metadata(directory)
    entries = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(entries, storage_reader=FileSystemReader(str(directory)))
    return {key.removeprefix("model."): value for key, value in entries.items()}


def export(checkpoint: str | Path, output: str | Path) -> Path:
    """Write the checkpoint's model as ``config.json`` + ``model.safetensors`` into ``output``."""
    directory, marker = find_checkpoint(Path(checkpoint))
    shape = spec_mod.ModelShape.model_validate(marker.model)
    return hf.write(output, gpt.GPTConfig.from_shape(shape), read_dense(directory))


def main(args: argparse.Namespace) -> int:
    try:
        written = export(args.checkpoint, args.output)
    except store.CheckpointError as err:
        print(err, file=sys.stderr)
        return exitcodes.CHECKPOINT
    print(f"wrote {written / hf.CONFIG} and {written / hf.WEIGHTS}")
    return 0
