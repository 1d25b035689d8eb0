"""Token files on disk: element type, a whole-file vocabulary check, and weighted sources.

A token file is raw little-endian ``uint16`` or ``uint32`` ids (no header),
memory-mapped.  Every id of every file is checked against the model's
vocabulary when the file is opened: an id outside it would otherwise become a
zero embedding under tensor parallelism (the vocabulary-parallel lookup masks
it) and a wrong loss, silently.  The check reads the file in chunks of
:data:`CHECK_CHUNK_TOKENS` with one vectorised ``max`` each, so memory stays
flat on multi-GB files (benchmarks/bench_token_check.py measures GB/s).
"""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path
from typing import Any

import numpy as np

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Element types of token files, by their spec name (``training.tokenDtype``)."""
CHECK_CHUNK_TOKENS = 1 << 24
"""Tokens per vectorised max (32 MiB of uint16): large enough for full memory bandwidth."""
METADATA_SUFFIX = ".json"
"""``meshtrain data prepare`` writes ``FILE.bin.json`` next to ``FILE.bin`` with its dtype and vocabulary."""


class TokenFileError(ValueError):
    """A token file cannot be used; the message names the file and the spec field."""


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """One opened token file."""

    path: Path
    tokens: np.ndarray
    """Read-only memmap of the ids."""
    weight: float
    """Share of the training windows drawn from this file (weights of all files sum to 1)."""


def expand(pattern: str, field: str) -> list[Path]:
    """The files a path or glob names, sorted (the order, and so the sampling, is reproducible)."""
    if glob.has_magic(pattern):
        matches = sorted(Path(p) for p in glob.glob(str(Path(pattern).expanduser())))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise TokenFileError(f"{field}: the glob {pattern!r} matches no token file")
        return files
    path = Path(pattern).expanduser()
    if not path.is_file():
        raise TokenFileError(f"{field}: token file {str(path)!r} does not exist")
    return [path]


def metadata_path(path: Path) -> Path:
    """Where ``meshtrain data prepare`` wrote the metadata of token file ``path``."""
    return path.with_name(path.name + METADATA_SUFFIX)


def check_metadata(path: Path, dtype: str, vocab: int, field: str) -> None:
    """Refuse a file whose ``data prepare`` metadata says another dtype, or a larger vocabulary."""
    meta_path = metadata_path(path)
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text())
    if meta.get("dtype") not in (None, dtype):
        raise TokenFileError(
            f"{field}: {str(path)!r} holds {meta['dtype']} tokens ({meta_path.name}) but "
            f"spec.training.tokenDtype is {dtype}: set tokenDtype: {meta['dtype']}"
        )
    if int(meta.get("vocab", 0)) > vocab:
        raise TokenFileError(
            f"{field}: {str(path)!r} was tokenised with a vocabulary of {meta['vocab']} "
            f"({meta_path.name}), larger than spec.model.vocab={vocab}"
        )


def first_out_of_vocab(tokens: np.ndarray, vocab: int) -> tuple[int, int] | None:
    """(position, id) of the first id >= ``vocab`` in ``tokens``, or None; chunked and vectorised."""
    for start in range(0, len(tokens), CHECK_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + CHECK_CHUNK_TOKENS])
        if chunk.size and int(chunk.max()) >= vocab:
            offset = int(np.argmax(chunk >= vocab))
            return start + offset, int(chunk[offset])
    return None


def open_token_file(path: Path, *, dtype: str, vocab: int, seq_len: int, field: str) -> np.ndarray:
    """The ids of ``path`` as a read-only memmap, every one checked against ``vocab``."""
    itemsize = DTYPES[dtype].itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise TokenFileError(
            f"{field}: {str(path)!r} has {size} bytes, not a multiple of {itemsize}; "
            f"expected {dtype} tokens (spec.training.tokenDtype)"
        )
    if size // itemsize < seq_len + 2:
        raise TokenFileError(
            f"{field}: {str(path)!r} holds {size // itemsize} tokens, fewer than seqLen + 2 = {seq_len + 2}"
        )
    check_metadata(path, dtype, vocab, field)
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    bad = first_out_of_vocab(tokens, vocab)
    if bad is not None:
        position, token = bad
        raise TokenFileError(
            f"{field}: {str(path)!r} has token id {token} >= model vocab {vocab} at position {position} "
            f"(spec.model.vocab, spec.training.tokenDtype={dtype})"
        )
    return tokens


def open_sources(
    entries: list[tuple[str, float, str]], *, dtype: str, vocab: int, seq_len: int
) -> list[TokenFile]:
    """Open (path or glob, weight, spec field) entries; a glob's weight is shared by its files in proportion to their tokens."""
    opened: list[TokenFile] = []
    total_weight = sum(weight for _, weight, _ in entries)
    for pattern, weight, where in entries:
        files = expand(pattern, where)
        arrays = [
            open_token_file(p, dtype=dtype, vocab=vocab, seq_len=seq_len, field=where)
            for p in files
        ]
        counts = sum(len(a) for a in arrays)
        for path, array in zip(files, arrays):
            share = weight / total_weight * len(array) / counts
            opened.append(TokenFile(path=path, tokens=array, weight=share))
    return opened
