"""Token files on disk: element type, a whole-file vocabulary check, and weighted sources.

A token file is raw little-endian ``uint16`` or ``uint32`` ids, no header, memory-mapped (or, in a
bucket, read by byte ranges: :mod:`.ranged_tokens`).  Every
id is checked against the model's vocabulary when the file is opened: under tensor parallelism an
id outside it would silently be a zero embedding and a wrong loss.  The largest id comes from
``data prepare``'s metadata or a scan record when they still describe the file; otherwise the
ranks of a job scan the file once between them (:func:`largest_ids`).  Raw ids carry no element type,
so a file without ``data prepare`` metadata is refused when its first ids look misread
(:func:`misread_as`).
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.api import limits
from meshtrain.trainer import small_files, storage
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


def read_metadata(path: Location) -> Any:
    """The metadata ``data prepare`` wrote beside token file ``path``, parsed; at most
    :data:`~meshtrain.api.limits.MAX_TOKEN_METADATA_BYTES` (a larger file: :class:`TokenFileError`)."""
    return small_files.read_json(
        metadata_path(path),
        limits.MAX_TOKEN_METADATA_BYTES,
        "token file's metadata (data prepare's FILE.bin.json)",
        TokenFileError,
    )


def check_metadata(path: Location, dtype: str, vocab: int, field: str) -> bool:
    """Refuse a file whose ``data prepare`` metadata says another dtype, a larger vocabulary or another size.

    Returns whether the file has metadata (then its element type is known, not guessed).
    """
    meta_path = metadata_path(path)
    if not meta_path.is_file():
        return False
    try:
        meta = read_metadata(path)
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


@dataclasses.dataclass(frozen=True)
class Share:
    """The ranks of a job that open the same files and split a scan between them."""

    rank: int
    """This rank's index among them."""
    size: int
    """How many there are."""
    max_over_ranks: Callable[[list[int]], list[int]]
    """The element-wise maximum of a list every rank passes (a collective: every rank calls it alike)."""


def prepared_largest_id(path: Path, dtype: str) -> int | None:
    """The largest id ``data prepare`` recorded for ``path``, if its metadata still describes the file.

    Checked cheaply: the element type, the byte count and the digest of
    sampled blocks (:func:`.vocab_scan.sampled_digest`, 1 MiB read) must
    match, and the file ``data prepare`` wrote (same device and inode, its
    ``written`` record) must not have been written since; metadata without
    them (older) or that does not match vouches for nothing.
    """
    try:
        meta = read_metadata(path)
    except TokenFileError:
        raise
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("max_id"), int):
        return None
    if meta.get("dtype") != dtype or meta.get("bytes") != path.stat().st_size:
        return None
    if vocab_scan.edited_in_place(path, meta.get("written")):
        return None
    if meta.get("sample_sha256") != vocab_scan.sampled_digest(path):
        return None
    return int(meta["max_id"])


def _known_largest_id(path: Path, dtype: str) -> int | None:
    prepared = prepared_largest_id(path, dtype)
    try:
        return prepared if prepared is not None else vocab_scan.largest_id(path, dtype)
    except vocab_scan.RecordTooLarge as err:
        raise TokenFileError(str(err)) from None


def largest_ids(
    files: list[tuple[Path, np.ndarray]], dtype: str, share: Share | None = None
) -> list[int]:
    """The largest id of every file: from ``data prepare``'s metadata or a scan record when they
    vouch for it, else scanned (and the scan recorded, :mod:`.vocab_scan`).

    Alone, a process scans what no record vouches for.  With ``share``,
    rank 0 alone checks the records (the other ranks read no file for it)
    and one ``max_over_ranks`` tells every rank what they vouch for (-1:
    nothing); a file no record vouches for is scanned once between the
    ranks: each scans its ``1/size`` of the ids, one ``max_over_ranks``
    combines them (three collectives in all, whatever the number of files:
    the last waits for the record), and rank 0 records the result; at the
    next start no rank reads it.
    """
    rank, size = (share.rank, share.size) if share else (0, 1)
    known = [_known_largest_id(path, dtype) if rank == 0 else None for path, _ in files]
    if share:
        vouched = share.max_over_ranks([-1 if k is None else k for k in known])
        known = [None if k < 0 else k for k in vouched]
    needed = [int(k is None) for k in known]
    if not any(needed):
        return [k for k in known if k is not None]
    before = {
        i: vocab_scan.fingerprint(files[i][0], dtype) if rank == 0 else {}
        for i, n in enumerate(needed)
        if n
    }
    partial = [-1] * len(files)
    for i in before:
        tokens = files[i][1]
        part = tokens[len(tokens) * rank // size : len(tokens) * (rank + 1) // size]
        partial[i] = largest_id(part) if len(part) else -1
    if share:
        partial = share.max_over_ranks(partial)
    if rank == 0:
        for i, fingerprint in before.items():
            vocab_scan.record(files[i][0], dtype, partial[i], fingerprint)
    if share:  # no rank opens the files again before the record exists (it would scan them again)
        share.max_over_ranks([0])
    return [partial[i] if needed[i] or k is None else k for i, k in enumerate(known)]


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


Tokens = np.ndarray | ranged_tokens.RangedTokens
"""A file's ids: a memmap on disk, or ranged reads of an object (its ids checked as read)."""


def _open(path: Location, *, dtype: str, vocab: int, seq_len: int, field: str) -> Tokens:
    """The ids of ``path`` once its type and length are checked (a memmap's ids not yet)."""
    check_type(path, dtype=dtype, vocab=vocab, field=field)
    count = path.stat().st_size // DTYPES[dtype].itemsize
    if count < seq_len + 2:
        raise TokenFileError(
            f"{field}: {str(path)!r} holds {count} tokens, fewer than seqLen + 2 = {seq_len + 2}"
        )
    if isinstance(path, storage.ObjectPath):
        return ranged_tokens.RangedTokens(path.url, DTYPES[dtype], vocab)
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


def _check_ids(
    path: Path, tokens: np.ndarray, largest: int, *, dtype: str, vocab: int, field: str
) -> None:
    """Refuse a file whose largest id is outside the vocabulary, naming the first such id and where."""
    if largest < vocab:
        return
    bad = first_out_of_vocab(tokens, vocab)
    if bad is None:  # the file changed between the scan and now: scanned again, all in range
        return
    position, token = bad
    raise TokenFileError(
        f"{field}: {str(path)!r} has token id {token} >= model vocab {vocab} at position {position} "
        f"(spec.model.vocab, spec.training.tokenDtype={dtype}): use data tokenised for this "
        "model's vocabulary, or raise spec.model.vocab"
    )


def open_token_file(path: Location, *, dtype: str, vocab: int, seq_len: int, field: str) -> Tokens:
    """The ids of ``path``, every one checked against ``vocab`` (one process; an object's as read)."""
    tokens = _open(path, dtype=dtype, vocab=vocab, seq_len=seq_len, field=field)
    if isinstance(tokens, np.ndarray):
        [largest] = largest_ids([(path, tokens)], dtype)  # type: ignore[list-item]
        _check_ids(path, tokens, largest, dtype=dtype, vocab=vocab, field=field)  # type: ignore[arg-type]
    return tokens


def open_sources(
    entries: list[tuple[str, float, str]],
    *,
    dtype: str,
    vocab: int,
    seq_len: int,
    share: Share | None = None,
) -> list[TokenFile]:
    """Open (path or glob, weight, spec field) entries; a glob's weight is shared by its files in proportion to their tokens.

    Every id is checked against ``vocab``; with ``share`` (every rank of a
    job calls this alike) the files no record vouches for are scanned once
    between the ranks, not by each (:func:`largest_ids`).
    """
    total_weight = sum(weight for _, weight, _ in entries)
    sources = []
    for pattern, weight, where in entries:
        files = expand(pattern, where)
        arrays = [_open(p, dtype=dtype, vocab=vocab, seq_len=seq_len, field=where) for p in files]
        sources.append((weight, where, list(zip(files, arrays))))
    # objects are not scanned (a scan would download them whole): their ids are checked as read
    every = [(p, a) for _, _, pairs in sources for p, a in pairs if isinstance(a, np.ndarray)]
    largest = iter(largest_ids(every, dtype, share))  # type: ignore[arg-type]
    opened: list[TokenFile] = []
    for weight, where, pairs in sources:
        counts = sum(len(a) for _, a in pairs)
        for path, array in pairs:
            if isinstance(array, np.ndarray):
                _check_ids(path, array, next(largest), dtype=dtype, vocab=vocab, field=where)  # type: ignore[arg-type]
            share_ = weight / total_weight * len(array) / counts
            opened.append(TokenFile(path=path, tokens=array, weight=share_))
    return opened
