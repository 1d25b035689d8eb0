"""Token files on disk: element type, a whole-file vocabulary check, and weighted sources.

A token file is raw little-endian ``uint16`` or ``uint32`` ids, no header, memory-mapped (or, in a
bucket, read by byte ranges: :mod:`.ranged_tokens`).  Every
id is checked against the model's vocabulary when the file is opened: under tensor parallelism an
id outside it would silently be a zero embedding and a wrong loss.  Raw ids carry no element type,
so a file without ``data prepare`` metadata is refused when its first ids look misread
(:func:`misread_as`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.trainer import storage
from meshtrain.trainer.data import ranged_tokens, vocab_scan

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Element types of token files, by their spec name (``training.tokenDtype``)."""
CHECK_CHUNK_TOKENS = 1 << 24
"""Tokens per vectorised max (32 MiB of uint16): large enough for full memory bandwidth."""
METADATA_SUFFIX = ".json"
"""``meshtrain data prepare`` writes ``FILE.bin.json`` next to ``FILE.bin`` with its dtype and vocabulary."""
SNIFF_TOKENS = 1 << 16
"""Ids at the start of a file looked at for the signs of a wrong element type (cheap, and far more than enough)."""
HIGH_HALF_LIMIT = 3
"""uint32 ids below 2^18 (every vocabulary in use: Llama 3 has 128,256) have high halves of at most 3."""


Location = Path | storage.ObjectPath
"""A token file on disk, or an object of a bucket (``s3://``)."""


class TokenFileError(ValueError):
    """A token file cannot be used; the message names the file and the spec field."""


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """One opened token file."""

    path: Location
    tokens: np.ndarray | ranged_tokens.RangedTokens
    """Read-only memmap of the ids (a ranged reader for an object)."""
    weight: float
    """Share of the training windows drawn from this file (weights of all files sum to 1)."""


def expand(pattern: str, field: str) -> list[Location]:
    """The files a path or glob names, sorted (the order, and so the sampling, is reproducible)."""
    if storage.is_url(pattern):
        return _expand_objects(pattern, field)
    if glob.has_magic(pattern):
        matches = sorted(Path(p) for p in glob.glob(str(Path(pattern).expanduser())))
        files: list[Location] = [p for p in matches if p.is_file() and not _is_sidecar(p)]
        if not files:
            raise TokenFileError(f"{field}: the glob {pattern!r} matches no token file")
        return files
    path = Path(pattern).expanduser()
    if not path.is_file():
        raise TokenFileError(f"{field}: token file {str(path)!r} does not exist")
    return [path]


def _expand_objects(pattern: str, field: str) -> list[Location]:
    """:func:`expand` in a bucket: one listing, the sidecars told apart by name."""
    if glob.has_magic(pattern):
        matches = storage.glob(pattern)
        names = set(matches)
        sidecars = (vocab_scan.SUFFIX, METADATA_SUFFIX)
        files: list[Location] = [
            storage.ObjectPath(url)
            for url in matches
            if not any(url.endswith(s) and url[: -len(s)] in names for s in sidecars)
        ]
        if not files:
            raise TokenFileError(f"{field}: the glob {pattern!r} matches no token object")
        return files
    if not storage.ObjectPath(pattern).is_file():
        raise TokenFileError(f"{field}: token object {pattern!r} does not exist")
    return [storage.ObjectPath(pattern)]


def _is_sidecar(path: Path) -> bool:
    """``FILE.bin.json`` and ``FILE.bin.scan.json``: meshtrain's notes on a token file, never token files."""
    return any(
        path.name.endswith(suffix) and path.with_name(path.name[: -len(suffix)]).is_file()
        for suffix in (vocab_scan.SUFFIX, METADATA_SUFFIX)
    )


def metadata_path(path: Location) -> Location:
    """Where ``meshtrain data prepare`` wrote the metadata of token file ``path``."""
    return path.with_name(path.name + METADATA_SUFFIX)


def check_metadata(path: Location, dtype: str, vocab: int, field: str) -> bool:
    """Refuse a file whose ``data prepare`` metadata says another dtype, a larger vocabulary or another size.

    Returns whether the file has metadata (then its element type is known, not guessed).
    """
    meta_path = metadata_path(path)
    if not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise TokenFileError(
            f"{field}: {str(path)!r} has unreadable metadata {meta_path.name} ({err}): prepare it "
            f"again (meshtrain data prepare) or delete {meta_path.name}"
        ) from None
    recorded = meta.get("dtype")
    if recorded not in (None, dtype):
        raise TokenFileError(
            f"{field}: {str(path)!r} holds {recorded} tokens ({meta_path.name}) but "
            f"spec.training.tokenDtype is {dtype}: set tokenDtype: {recorded}"
        )
    if int(meta.get("vocab", 0)) > vocab:
        raise TokenFileError(
            f"{field}: {str(path)!r} was tokenised with a vocabulary of {meta['vocab']} "
            f"({meta_path.name}), larger than spec.model.vocab={vocab}: use the model's tokenizer "
            "or raise spec.model.vocab"
        )
    size = path.stat().st_size
    expected = meta.get("bytes")
    if expected is None and isinstance(meta.get("tokens"), int):
        expected = meta["tokens"] * DTYPES[dtype].itemsize
    if expected is not None and expected != size:
        raise TokenFileError(
            f"{field}: {str(path)!r} has {size} bytes but {meta_path.name} describes a file of "
            f"{expected} bytes: the metadata belongs to another version of the file; prepare it "
            f"again (meshtrain data prepare) or delete {meta_path.name}"
        )
    return True


def misread_as(sample: np.ndarray, dtype: str, vocab: int) -> str | None:
    """The element type ``sample`` (the first ids of a file read as ``dtype``) really has, when it looks misread.

    * read as uint16, uint32 ids show every second value (the high halves) at
      most :data:`HIGH_HALF_LIMIT` while the others are not;
    * read as uint32, uint16 ids fuse in pairs into ids mostly outside the
      vocabulary, while the same bytes read as uint16 all fit it.
    """
    if dtype == "uint16":
        pairs = sample[: len(sample) // 2 * 2].reshape(-1, 2)  # (pairs, 2): low, high halves
        if len(pairs) >= 64 and pairs[:, 1].max() <= HIGH_HALF_LIMIT < pairs[:, 0].max():
            return "uint32"
        return None
    fused = sample >= vocab
    if fused.size and fused.mean() > 0.5 and sample.view("<u2").max() < vocab:
        return "uint16"
    return None


def first_out_of_vocab(tokens: np.ndarray, vocab: int) -> tuple[int, int] | None:
    """(position, id) of the first id >= ``vocab`` in ``tokens``, or None; chunked and vectorised."""
    for start in range(0, len(tokens), CHECK_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + CHECK_CHUNK_TOKENS])
        if chunk.size and int(chunk.max()) >= vocab:
            offset = int(np.argmax(chunk >= vocab))
            return start + offset, int(chunk[offset])
    return None


def largest_id(tokens: np.ndarray) -> int:
    """The largest id in ``tokens``; chunked and vectorised like :func:`first_out_of_vocab`."""
    found = 0
    for start in range(0, len(tokens), CHECK_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + CHECK_CHUNK_TOKENS])
        if chunk.size:
            found = max(found, int(chunk.max()))
    return found


def scanned_largest_id(path: Path, tokens: np.ndarray, dtype: str) -> int:
    """The largest id of the file: from its scan record when the file is unchanged, else scanned and recorded."""
    known = vocab_scan.largest_id(path, dtype)
    if known is not None:
        return known
    before = vocab_scan.fingerprint(path, dtype)
    found = largest_id(tokens)
    vocab_scan.record(path, dtype, found, before)
    return found


def _misread_error(path: Location, dtype: str, actual: str, field: str) -> TokenFileError:
    return TokenFileError(
        f"{field}: {str(path)!r} looks like {actual} tokens read as {dtype} "
        f"(spec.training.tokenDtype={dtype}; its first {SNIFF_TOKENS} ids are what {actual} ids read "
        f"as {dtype} look like): set spec.training.tokenDtype: {actual}, or prepare the file with "
        "meshtrain data prepare, whose metadata names its type"
    )


def check_type(path: Location, *, dtype: str, vocab: int, field: str) -> None:
    """The cheap checks of a file's element type, before any process starts: metadata, byte count, first ids."""
    described = check_metadata(path, dtype, vocab, field)
    itemsize = DTYPES[dtype].itemsize
    size = path.stat().st_size
    if size % itemsize:
        other = "uint16" if dtype == "uint32" else "uint32"
        raise TokenFileError(
            f"{field}: {str(path)!r} has {size} bytes, not a multiple of {itemsize}; "
            f"expected {dtype} tokens (spec.training.tokenDtype): if it holds {other} tokens set "
            f"tokenDtype: {other}, else the file is truncated"
        )
    if described:
        return
    first = _first_ids(path, DTYPES[dtype], min(SNIFF_TOKENS, size // itemsize))
    actual = misread_as(first, dtype, vocab)
    if actual is not None:
        raise _misread_error(path, dtype, actual, field)


def _first_ids(path: Location, dtype: np.dtype[Any], count: int) -> np.ndarray:
    """The first ``count`` ids of a file (one ranged read of an object)."""
    if isinstance(path, storage.ObjectPath):
        data = storage.read_ranges([(path.url, 0, count * dtype.itemsize)])[0]
        return np.frombuffer(data, dtype=dtype)
    return np.fromfile(path, dtype=dtype, count=count)


def open_token_file(
    path: Location, *, dtype: str, vocab: int, seq_len: int, field: str
) -> np.ndarray | ranged_tokens.RangedTokens:
    """The ids of ``path`` as a read-only memmap, every one checked against ``vocab``.

    An object is read by ranges, its ids checked as they are read (:mod:`.ranged_tokens`).
    """
    check_type(path, dtype=dtype, vocab=vocab, field=field)
    count = path.stat().st_size // DTYPES[dtype].itemsize
    if count < seq_len + 2:
        raise TokenFileError(
            f"{field}: {str(path)!r} holds {count} tokens, fewer than seqLen + 2 = {seq_len + 2}"
        )
    if isinstance(path, storage.ObjectPath):
        return ranged_tokens.RangedTokens(path.url, DTYPES[dtype], vocab)
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    if scanned_largest_id(path, tokens, dtype) < vocab:
        return tokens
    bad = first_out_of_vocab(tokens, vocab)
    if bad is None:  # the file changed between the scan and now: scanned again, all in range
        return tokens
    position, token = bad
    raise TokenFileError(
        f"{field}: {str(path)!r} has token id {token} >= model vocab {vocab} at position {position} "
        f"(spec.model.vocab, spec.training.tokenDtype={dtype}): use data tokenised for this "
        "model's vocabulary, or raise spec.model.vocab"
    )


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
