"""Meshtrain weights written as a Hugging Face directory: safetensors shards, index and configs.

Shards are written as transformers writes them (``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``; one shard is ``model.safetensors``), one shard's parameters
in memory at a time.  Everything is written into a temporary sibling directory first
(:func:`staged`) and moved into place only once complete, so no file of the target directory
(the model the checkpoint was imported from, say) is removed or overwritten before its
replacement is whole; the files get the umask's modes. Moving them in removes the old config and
index first, so a crash midway leaves a directory that fails to load, never two exports mixed.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshtrain.trainer.data import file_modes, special_tokens
from meshtrain.trainer.interop import config_json, name_map
from meshtrain.trainer.models import gpt, llama

WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Element types an export can write, by the name ``config.json``'s ``torch_dtype`` gives them."""


def shard_file_name(index: int, count: int) -> str:
    """File of shard ``index`` (0-based) of ``count``: transformers' ``model-00001-of-00003.safetensors``."""
    return (
        config_json.WEIGHTS if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    )


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive items (name, bytes) grouped into shards of at most ``max_bytes``; an item larger than that is a shard alone."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return [s for s in shards if s]


WEIGHT_FILES = (config_json.WEIGHTS, config_json.WEIGHTS_INDEX, "model-*-of-*.safetensors")
"""Names (globs) of an export's weights: an earlier export's that the new one does not rewrite are
stale (a stale shard would be loaded beside the new ones) and go once the new files are in place."""
_PUBLISH_LAST = (config_json.WEIGHTS_INDEX, config_json.CONFIG)
"""Moved into place after the shards they name, config last: a loader finds nothing to load before."""
_ENTRY_POINTS = (config_json.WEIGHTS_INDEX, config_json.WEIGHTS, config_json.CONFIG)
"""What a loader opens first: an earlier export's go before any new file arrives, so that a crash
midway leaves a directory that fails to load (no config, no index), never old and new shards mixed."""


STALE_STAGING_S = 3600.0
"""A staging directory nothing was written into for this long is an abandoned export's."""
MAX_STAGING_ENTRIES = 10_000
"""Entries of one directory looked at for staging leftovers (a hostile directory is not walked whole)."""
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
"""An output given as a URL (``s3://``, ``gs://``, ``hf://``), which is no local directory."""


class OutputError(ValueError):
    """An output the export cannot write; the message names ``-o/--output`` and the fix."""


def local_output(directory: str | Path) -> Path:
    """``directory`` as a path; a URL is refused (``Path`` would make ``s3://b/x`` a local ``s3:/b/x``)."""
    if URL.match(str(directory)):
        raise OutputError(
            f"-o/--output {directory}: a URL; export writes a local directory: export to one, "
            "then upload it with your own tools (aws s3 cp --recursive, huggingface-cli upload)"
        )
    return Path(directory)


@contextlib.contextmanager
def staged(directory: str | Path, replaces: tuple[str, ...] = WEIGHT_FILES) -> Iterator[Path]:
    """A temporary directory to write into; its files are moved into ``directory`` on success.

    Nothing of ``directory`` is touched before the block completes: then each
    new file replaces its namesake (:func:`_publish`), the entries of
    ``directory`` matching ``replaces`` that the block did not write are
    removed, and every other file of ``directory`` stays.  A new directory
    is the staging directory renamed.  On an exception only the staging
    directory goes.  The staging directory is a sibling of ``directory``
    (``.NAME.tmp-HOST-PID-*``), or inside it when its parent is not
    writable; an earlier export's left there is removed first (:func:`remove_stale`).
    """
    # the real directory (not a symlink to it): staged beside it, renames stay on its filesystem
    directory = local_output(directory).resolve()
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"-o/--output {directory}: a file, not a directory: name a directory"
        )
    prefix = f".{directory.name}.tmp-"
    where = _staging_parent(directory)
    for place in (directory.parent, directory):
        remove_stale(place, prefix)
    host = socket.gethostname()
    staging = Path(tempfile.mkdtemp(dir=where, prefix=f"{prefix}{host}-{os.getpid()}-"))
    try:
        yield staging
        _publish(staging, directory, replaces)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_parent(directory: Path) -> Path:
    """Where the staging directory goes: beside ``directory``, else inside it (its parent read-only)."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(
            f"-o/--output {directory}: its parent cannot be created ({err}): name a "
            "directory you may write"
        ) from None
    if os.access(directory.parent, os.W_OK | os.X_OK):
        return directory.parent
    if directory.is_dir() and os.access(directory, os.W_OK | os.X_OK):
        return directory
    raise OutputError(
        f"-o/--output {directory}: neither it nor its parent {directory.parent} is writable: "
        "name a directory you may write"
    )


def remove_stale(where: Path, prefix: str) -> list[Path]:
    """Remove the staging directories ``prefix*`` in ``where`` that a killed export left; returns them.

    Stale: named for this host and a process that is gone, or with nothing
    written into it for :data:`STALE_STAGING_S` (another host's, or its
    process id reused).  A running export's is kept.
    """
    removed = []
    try:
        with os.scandir(where) as entries:
            candidates = [
                Path(e.path)
                for _, e in zip(range(MAX_STAGING_ENTRIES), entries)
                if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []
    for staging in candidates:
        if _abandoned(staging, staging.name[len(prefix) :]):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _abandoned(staging: Path, tail: str) -> bool:
    host, _, pid = tail.rpartition("-")[0].rpartition("-")  # HOST-PID-RANDOM
    if host == socket.gethostname() and pid.isdigit() and not _running(int(pid)):
        return True
    try:
        with os.scandir(staging) as entries:
            times = [staging.stat().st_mtime] + [
                e.stat(follow_symlinks=False).st_mtime
                for _, e in zip(range(MAX_STAGING_ENTRIES), entries)
            ]
    except OSError:
        return False
    return time.time() - max(times) > STALE_STAGING_S


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _publish(staging: Path, directory: Path, replaces: tuple[str, ...]) -> None:
    """Move the staged files into ``directory``, so that no crash leaves a loadable mix of two exports.

    Shards of two exports share names (``model-00001-of-00003.safetensors``),
    so a crash between two renames could leave new and old shards under the
    old index. Hence: the old entry points (:data:`_ENTRY_POINTS`) go first,
    then the new shards and other files, then the index and the config
    (:data:`_PUBLISH_LAST`), then the stale shards the new index does not
    name. Interrupted, the directory has no ``config.json``, which
    transformers and :func:`.from_hf.check_directory` refuse: export again.
    """
    written = sorted(p.name for p in staging.iterdir())
    for name in written:
        file_modes.publish(staging / name)  # mkdtemp's 0700, safetensors' 0600
    if not directory.exists():
        file_modes.publish(staging)
        os.rename(staging, directory)
        return

    def replaced(name: str) -> bool:
        return name in written or any(fnmatch.fnmatch(name, g) for g in replaces)

    for name in _ENTRY_POINTS:
        if replaced(name):
            (directory / name).unlink(missing_ok=True)
    for name in sorted(written, key=lambda n: (n in _PUBLISH_LAST, n == config_json.CONFIG)):
        os.replace(staging / name, directory / name)
    for old in sorted(directory.iterdir()):
        if old.name not in written and replaced(old.name):
            old.unlink(missing_ok=True)


Loader = Callable[[list[str]], dict[str, torch.Tensor]]
"""Dense meshtrain parameters by name, read when asked for."""


def write_sharded(
    directory: str | Path,
    config: gpt.GPTConfig,
    shapes: dict[str, tuple[int, ...]],
    load: Loader,
    *,
    max_shard_bytes: int,
    token_ids: special_tokens.TokenIds = special_tokens.UNKNOWN,
    max_positions: int | None = None,
    dtype: str = "float32",
    written: Callable[[int, int, int], None] | None = None,
) -> list[Path]:
    """Write the model as Hugging Face safetensors shards of at most ``max_shard_bytes`` into the new
    directory ``directory`` (see :func:`staged`); returns the files.

    ``dtype`` (a :data:`WEIGHT_DTYPES` name) is what the weights are rounded
    to on the way out (``bfloat16``: round to nearest even, as ``Tensor.to``).

    ``shapes`` names every dense parameter; ``load`` is asked for one
    shard's parameters at a time, so no more than one shard (plus the
    largest parameter) is in memory.  More than one shard gets
    ``model.safetensors.index.json``; one is ``model.safetensors``.  All of a
    parameter's pieces (q, k, v of a fused QKV) go to one shard.  ``written`` is told after each
    shard: (tensors written, bytes written, bytes in all), for the export's progress.
    """
    directory = Path(directory)
    order = {name: i for i, (name, _) in enumerate(_model_order(config))}
    names = sorted(shapes, key=lambda n: order.get(n, len(order)))
    element = WEIGHT_DTYPES[dtype]
    itemsize = element.itemsize
    sizes = [(n, math.prod(shapes[n]) * itemsize) for n in names]
    biases = name_map.zero_biases(config)
    sizes += [(key, n * itemsize) for key, n in biases.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    files = []
    for index, members in enumerate(shards):
        file = shard_file_name(index, len(shards))
        dense = load([n for n in members if n not in biases])
        tensors: dict[str, torch.Tensor] = {}
        for name in members:
            if name in biases:
                tensors[name] = torch.zeros(biases[name], dtype=element)
            else:
                whole = dense.pop(name).detach().float().cpu()
                pieces = name_map.hf_tensors(config, name, whole)
                tensors.update({key: t.to(element).contiguous() for key, t in pieces.items()})
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        files.append(directory / file)
        if written is not None:
            written(len(weight_map), total, sum(nbytes for _, nbytes in sizes))
        del dense, tensors
    if len(shards) > 1:
        index_doc = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (directory / config_json.WEIGHTS_INDEX).write_text(json.dumps(index_doc, indent=2) + "\n")
        files.append(directory / config_json.WEIGHTS_INDEX)
    (directory / config_json.CONFIG).write_text(
        json.dumps(config_json.hf_config(config, token_ids, max_positions, dtype), indent=2) + "\n"
    )
    (directory / config_json.GENERATION_CONFIG).write_text(
        json.dumps(config_json.generation_config(token_ids), indent=2) + "\n"
    )
    return files


def _model_order(config: gpt.GPTConfig) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        return list(llama.build(config).named_parameters())


def write(
    directory: str | Path,
    config: gpt.GPTConfig,
    dense: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int = 1 << 62,
    token_ids: special_tokens.TokenIds = special_tokens.UNKNOWN,
    max_positions: int | None = None,
    dtype: str = "float32",
) -> list[Path]:
    """:func:`write_sharded` for parameters already in memory (meshtrain names), through :func:`staged`."""
    with staged(directory) as staging:
        files = write_sharded(
            staging,
            config,
            {name: tuple(t.shape) for name, t in dense.items()},
            lambda names: {n: dense[n] for n in names},
            max_shard_bytes=max_shard_bytes,
            token_ids=token_ids,
            max_positions=max_positions,
            dtype=dtype,
        )
    return [Path(directory) / f.name for f in files]
