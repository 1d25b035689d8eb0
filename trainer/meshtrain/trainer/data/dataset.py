"""The job's dataset: the token files ``training.dataset(s)`` names, checked and opened.

The default ``stdlib`` corpus (byte-level tokens of the Python standard library's sources, which
every machine with Python has), user token files (:mod:`.token_files`) and the evaluation data.
:func:`check_dataset` refuses an unusable dataset before any process starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from meshtrain.api.spec import training as api_training
from meshtrain.trainer import storage
from meshtrain.trainer.data import (
    file_modes,
    ranged_tokens,
    special_tokens,
    token_files,
    vocab_scan,
)

STDLIB = "stdlib"
"""Dataset name of the default corpus."""
STDLIB_CAP_BYTES = 4 * 1024 * 1024
"""Bytes of standard-library source kept (enough for tests and demos, built in about a second)."""
DATASET_FIELD = "spec.training.dataset"
DATASETS_FIELD = "spec.training.datasets"
EVAL_FIELD = "spec.training.eval"
DOCUMENT_MASK_FIELD = "spec.training.documentMask"
UINT16_VOCAB = 65536
"""Largest vocabulary uint16 token files can hold."""


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the path and the spec field."""


def stdlib_corpus(directory: Path | None = None, cap_bytes: int = STDLIB_CAP_BYTES) -> Path:
    """The cached uint16 token file of the standard-library corpus (built once, atomically)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{stdlib}|{cap_bytes}".encode()).hexdigest()[:12]
    directory = directory or vocab_scan.cache_dir()
    target = directory / f"stdlib-{key}.bin"
    if target.exists():
        return target
    chunks, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: cap_bytes - size])
        size += len(chunks[-1])
        if size >= cap_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    directory.mkdir(parents=True, exist_ok=True)
    # Several ranks may build it at once: write a private file, then rename.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=target.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as out:
        out.write(tokens.astype("<u2").tobytes())
    file_modes.publish(tmp)
    os.replace(tmp, target)
    return target


def dataset_entries(training: api_training.Training) -> list[tuple[str, float]]:
    """(path or glob, weight) of every source ``training`` names ('stdlib' left as is)."""
    if training.datasets:
        return [(source.path, source.weight) for source in training.datasets]
    return [(training.dataset, 1.0)]


def _field(training: api_training.Training, index: int) -> str:
    return f"{DATASETS_FIELD}[{index}]" if training.datasets else DATASET_FIELD


def check_dataset(
    training: api_training.Training, *, vocab: int, from_hf: str | None = None
) -> None:
    """Raise :class:`DatasetError` early (before processes start): a missing file, an empty glob,
    uint16 files for a vocabulary they cannot hold, a file of another element type
    (:func:`.token_files.check_type`; the whole-file id scan is left to the ranks), or files prepared
    with another tokenizer than each other or than the ``fromHF`` model's
    (:func:`.special_tokens.check_agreement`)."""
    entries = dataset_entries(training)
    try:
        every: list[token_files.Location] = []
        named = [(p, _field(training, i)) for i, (p, _) in enumerate(entries) if p != STDLIB]
        if training.eval.interval and training.eval.dataset:
            named.append((training.eval.dataset, EVAL_FIELD + ".dataset"))
        for pattern, field in named:
            files = token_files.expand(pattern, field)
            if training.token_dtype == "uint16" and vocab > UINT16_VOCAB:
                raise token_files.TokenFileError(
                    f"{field}: {str(files[0])!r} is read as uint16 (ids up to "
                    f"{UINT16_VOCAB - 1}) but spec.model.vocab={vocab}: write uint32 tokens and set "
                    "spec.training.tokenDtype: uint32"
                )
            for path in files:
                token_files.check_type(path, dtype=training.token_dtype, vocab=vocab, field=field)
            every += files
        special_tokens.check_agreement(every, from_hf)
    except (token_files.TokenFileError, storage.ObjectStorageError) as err:
        raise DatasetError(
            f"{err} (expected raw {training.token_dtype} tokens, or '{STDLIB}' for the built-in corpus)"
        ) from None
    if training.document_mask:
        if any(pattern == STDLIB for pattern, _ in entries):
            raise DatasetError(
                f"{DOCUMENT_MASK_FIELD}: the built-in '{STDLIB}' corpus has no end-of-text id: train on "
                "token files from meshtrain data prepare, or set documentMask: false"
            )
        document_end(every)


def document_end(paths: Iterable[token_files.Location]) -> int:
    """The end-of-text id that closes every document of ``paths`` (``training.documentMask``).

    Read from what ``meshtrain data prepare`` recorded beside each file: a file
    without that record, or with no end-of-text id, or whose documents start with
    a begin-of-text id equal to it, or files that end documents with different ids
    are refused (the mask would cut documents wrongly).
    """
    found: dict[int, token_files.Location] = {}
    for path in paths:
        ids = special_tokens.from_token_files([path])
        if not ids.eos:
            raise DatasetError(
                f"{DOCUMENT_MASK_FIELD}: {str(path)!r} has no end-of-text id in "
                f"{token_files.metadata_path(path).name} (written by meshtrain data prepare): prepare "
                "it with meshtrain data prepare and a tokenizer that has an end-of-text token, or set "
                "documentMask: false"
            )
        if ids.bos == ids.eos[0] and _bos_per_document(path):
            raise DatasetError(
                f"{DOCUMENT_MASK_FIELD}: {str(path)!r} starts every document with id {ids.bos}, "
                "which is also its end-of-text id: the mask would make every begin-of-text a "
                "one-token document; prepare it with a tokenizer whose begin- and end-of-text "
                "ids differ (or whose template adds no begin-of-text), or set documentMask: false"
            )
        found.setdefault(ids.eos[0], path)
    if len(found) != 1:
        named = ", ".join(f"{eos} ({str(path)!r})" for eos, path in found.items())
        raise DatasetError(
            f"{DOCUMENT_MASK_FIELD}: the token files end documents with different ids ({named or 'no files'}): "
            "prepare them with one tokenizer"
        )
    return next(iter(found))


def _bos_per_document(path: token_files.Location) -> bool:
    """Whether ``meshtrain data prepare`` started every document of ``path`` with a begin-of-text id."""
    meta = token_files.read_metadata(path)
    return bool(meta.get("bos_per_document", False))


def open_dataset(
    training: api_training.Training,
    *,
    vocab: int,
    seq_len: int,
    share: token_files.Share | None = None,
) -> list[token_files.TokenFile]:
    """Every source of ``training`` opened and checked, id by id, against the model vocabulary.

    ``share``: the job's ranks, which scan a file no record vouches for once between them.
    """
    check_dataset(training, vocab=vocab)
    if not training.datasets and training.dataset == STDLIB:  # byte tokens, always uint16
        tokens = load_tokens(STDLIB, vocab=vocab, seq_len=seq_len)
        return [token_files.TokenFile(path=stdlib_corpus(), tokens=tokens, weight=1.0)]
    try:
        entries = [
            (pattern, weight, _field(training, index))
            for index, (pattern, weight) in enumerate(dataset_entries(training))
        ]
        return token_files.open_sources(
            entries, dtype=training.token_dtype, vocab=vocab, seq_len=seq_len, share=share
        )
    except (token_files.TokenFileError, storage.ObjectStorageError) as err:
        raise DatasetError(str(err)) from None


def open_eval(
    training: api_training.Training,
    files: list[token_files.TokenFile],
    *,
    vocab: int,
    seq_len: int,
    share: token_files.Share | None = None,
) -> tuple[list[token_files.TokenFile], list[token_files.TokenFile] | None]:
    """(training files, evaluation files or None): ``eval.dataset`` opened, or ``eval.heldOut`` cut off the end of each file."""
    ev = training.eval
    if not ev.interval:
        return files, None
    if ev.dataset:
        try:
            held = token_files.open_sources(
                [(ev.dataset, 1.0, EVAL_FIELD + ".dataset")],
                dtype=training.token_dtype,
                vocab=vocab,
                seq_len=seq_len,
                share=share,
            )
        except token_files.TokenFileError as err:
            raise DatasetError(str(err)) from None
        return files, held
    train, held = [], []
    for f in files:
        cut = int(len(f.tokens) * (1 - ev.held_out))
        if min(cut, len(f.tokens) - cut) < seq_len + 2:
            raise DatasetError(
                f"{EVAL_FIELD}.heldOut: {str(f.path)!r} holds {len(f.tokens)} tokens; a {ev.held_out} share "
                f"leaves fewer than seqLen + 2 = {seq_len + 2} on one side: raise heldOut or use eval.dataset"
            )
        train.append(dataclasses.replace(f, tokens=f.tokens[:cut]))
        held.append(dataclasses.replace(f, tokens=f.tokens[cut:]))
    return train, held


def load_tokens(
    dataset: str, *, vocab: int, seq_len: int, dtype: str = "uint16"
) -> np.ndarray | ranged_tokens.RangedTokens:
    """One token file (or 'stdlib') as a read-only memmap, every id checked against ``vocab``."""
    path = stdlib_corpus() if dataset == STDLIB else Path(dataset).expanduser()
    try:
        token_files.expand(str(path), DATASET_FIELD)
        return token_files.open_token_file(
            path, dtype=dtype, vocab=vocab, seq_len=seq_len, field=DATASET_FIELD
        )
    except token_files.TokenFileError as err:
        raise DatasetError(str(err)) from None
