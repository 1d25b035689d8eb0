"""``meshtrain export CHECKPOINT -o HF_DIR``: a meshtrain checkpoint as a Hugging Face model directory.

A checkpoint is layout-independent, so one process reads every parameter whole, one shard's worth
at a time (DCP reads only the entries asked for): exporting a 70B model needs the memory of a
shard, not of the model.  :mod:`.to_hf` writes the files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from meshtrain.api import console, exitcodes
from meshtrain.api.spec import model as api_model
from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import state, store
from meshtrain.trainer.data import special_tokens
from meshtrain.trainer.interop import config_json, to_hf
from meshtrain.trainer.models import gpt

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Shard size of the Llama releases on the Hugging Face Hub (huggingface_hub's default too)."""
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``123456`` (decimal units, as transformers reads them)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(
            f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def find_checkpoint(path: store.Location) -> tuple[store.Location, store.Marker]:
    """The checkpoint directory ``path`` names (itself, or its newest), marker read and files verified."""
    if (path / store.MARKER).is_file():
        path = store.approved(path)  # a bucket's step prefix: the attempt its marker approves
        marker = store.read_marker(path)
        store.verify(path, marker, hashes=True)
        return path, marker
    found = store.latest(path)
    if found is None:
        raise store.CheckpointError(f"{path}: no published checkpoint (step-NNNNNNNN) here")
    return found[0].path, found[1]


def model_shapes(directory: store.Location) -> dict[str, tuple[int, ...]]:
    """Dense shape of every model parameter of a checkpoint, by its meshtrain name (metadata only)."""
    metadata = state.read_metadata(directory)
    return {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }


def read_params(directory: store.Location, names: list[str]) -> dict[str, torch.Tensor]:
    """The named model parameters of a checkpoint as whole tensors (one process; reads only these)."""
    metadata = state.read_metadata(directory).state_dict_metadata
    entries = {
        f"model.{name}": torch.empty(
            tuple(metadata[f"model.{name}"].size), dtype=metadata[f"model.{name}"].properties.dtype
        )
        for name in names
    }
    if entries:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(entries, storage_reader=state.reader(directory))
    return {key.removeprefix("model."): value for key, value in entries.items()}


def read_dense(directory: store.Location) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint as a whole tensor, by its meshtrain name (one process)."""
    return read_params(directory, list(model_shapes(directory)))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""A Hugging Face directory's tokenizer, as ``AutoTokenizer.from_pretrained`` reads it."""


def tokenizer_sources(tokenizer: Path | None, from_hf: str | None) -> dict[str, Path]:
    """The tokenizer files an export copies, by their name in the export.

    ``--tokenizer`` wins (with its directory's ``tokenizer_config.json`` and
    ``special_tokens_map.json`` when it is that directory's ``tokenizer.json``),
    else the files of the ``model.init.fromHF`` directory the checkpoint
    started from.
    """
    sources: dict[str, Path] = {}
    if tokenizer is not None:
        sources["tokenizer.json"] = tokenizer
        if tokenizer.name == "tokenizer.json":
            sources |= {n: tokenizer.parent / n for n in TOKENIZER_FILES[1:]}
    elif from_hf and (storage.local_path(from_hf, config_json.FIELD) / "tokenizer.json").is_file():
        sources = {n: storage.local_path(from_hf, config_json.FIELD) / n for n in TOKENIZER_FILES}
    return {name: path for name, path in sources.items() if path.is_file()}


def copy_tokenizer(
    staging: Path, sources: dict[str, Path], token_ids: special_tokens.TokenIds
) -> None:
    """Put a tokenizer into the export so ``AutoTokenizer.from_pretrained(output)`` works.

    ``sources`` (:func:`tokenizer_sources`) are copied into the staging
    directory (read before anything of the output is replaced: they may be
    the output's own files).  A ``tokenizer.json`` without its config gets
    one naming the begin/end-of-text and padding tokens of the exported ids.
    """
    if not sources:
        return
    for name, path in sources.items():
        shutil.copyfile(path, staging / name)
    if "tokenizer_config.json" not in sources:
        loaded = special_tokens.load_tokenizer(sources["tokenizer.json"])

        def token(i: int | None) -> str | None:
            return None if i is None else loaded.id_to_token(i)

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(token_ids.bos),
            "eos_token": token(token_ids.eos[0] if token_ids.eos else None),
            "pad_token": token(token_ids.pad),
        }
        text = json.dumps({k: v for k, v in config.items() if v is not None}, indent=2)
        (staging / "tokenizer_config.json").write_text(text + "\n")


def check_output(output: Path, checkpoint: Path) -> None:
    """Refuse an output that is a file, or is or is inside the checkpoint read (its files would change under it)."""
    if output.exists() and not output.is_dir():
        raise to_hf.OutputError(f"-o/--output {output}: a file, not a directory: name a directory")
    out, source = output.resolve(), checkpoint.resolve()
    if out == source or source in out.parents:
        raise to_hf.OutputError(
            f"-o/--output {output}: inside the checkpoint {checkpoint} it exports, whose files it "
            "must not change: write the Hugging Face directory elsewhere (-o)"
        )


def export(
    checkpoint: str | Path,
    output: str | Path,
    *,
    max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE),
    tokenizer: Path | None = None,
    dtype: str = "float32",
) -> list[Path]:
    """Write the checkpoint's model as a Hugging Face directory into ``output``; returns the weight files.

    ``dtype``: the weights' element type in the export (``float32``, as
    trained; ``bfloat16`` halves the files, as the Llama releases ship).
    Written into a temporary sibling and moved into place when complete
    (:func:`.to_hf.staged`): exporting into the ``fromHF`` directory the
    model came from replaces its weights and tokenizer only with whole new
    ones, and keeps its other files.
    """
    output = to_hf.local_output(output)
    directory, marker = find_checkpoint(store.location(checkpoint))
    if isinstance(directory, Path):  # a bucket checkpoint cannot hold a local output
        check_output(output, directory)
    shape = api_model.ModelShape.model_validate(marker.model)
    token_ids = special_tokens.TokenIds.from_json(marker.extra.get("token_ids") or {})
    if tokenizer is not None:
        token_ids = special_tokens.from_tokenizer_file(tokenizer)
    sources = tokenizer_sources(tokenizer, marker.extra.get("from_hf"))
    # an earlier export's tokenizer files go when a new tokenizer comes (no stale config beside it)
    replaces = to_hf.WEIGHT_FILES + (TOKENIZER_FILES if sources else ())
    with (
        to_hf.staged(output, replaces) as staging,
        console.Phase(f"export {output}", unit="B", scaled=True) as phase,
    ):
        copy_tokenizer(staging, sources, token_ids)

        def written(tensors: int, nbytes: int, total: int) -> None:
            phase.expect(total)
            phase.to(nbytes)
            phase.status(f"{tensors} tensors written")

        files = to_hf.write_sharded(
            staging,
            gpt.GPTConfig.from_shape(shape),
            model_shapes(directory),
            lambda names: read_params(directory, names),
            max_shard_bytes=max_shard_bytes,
            token_ids=token_ids,
            max_positions=marker.extra.get("max_position_embeddings"),
            dtype=dtype,
            written=written,
        )
    return [output / f.name for f in files]


def main(args: argparse.Namespace) -> int:
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2  # a usage error, as argparse reports one
    if args.tokenizer is not None and not args.tokenizer.is_file():
        print(f"--tokenizer: {args.tokenizer} does not exist", file=sys.stderr)
        return 2  # a usage error, as argparse reports one
    try:
        written = export(
            args.checkpoint,
            args.output,
            max_shard_bytes=max_shard_bytes,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
        )
    except store.CheckpointError as err:
        print(err, file=sys.stderr)
        return exitcodes.CHECKPOINT
    except to_hf.OutputError as err:
        print(err, file=sys.stderr)
        return 2  # a usage error, as argparse reports one
    names = ", ".join(p.name for p in written)
    print(
        f"wrote {Path(args.output) / config_json.CONFIG}, {config_json.GENERATION_CONFIG} and {names}"
    )
    return 0
