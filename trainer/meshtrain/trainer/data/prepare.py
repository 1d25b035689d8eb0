"""``meshtrain data prepare``: text or JSONL tokenised with a user's ``tokenizer.json`` into a token file.

Documents are encoded as ``transformers`` encodes them (with the tokenizer's own special tokens)
and each ends with the end-of-text token, so windows that cross documents see the boundary.  The
metadata written beside the output (dtype, vocabulary, size, tokenizer hash, special ids, the
largest id and a digest of sampled blocks) is what :mod:`.token_files` checks when a job opens
the file: with it, no rank scans the file for its largest id.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from meshtrain.api import console, loading
from meshtrain.trainer.data import file_modes, special_tokens, token_files, vocab_scan

BATCH_DOCUMENTS = 256
"""Documents per ``encode_batch`` call (the library parallelises inside a batch)."""


class PrepareError(ValueError):
    """Input that cannot be prepared; the message names the file and the option."""


def choose_dtype(requested: str, vocab: int, tokenizer_path: Path) -> str:
    """The output dtype: ``auto`` picks uint16 when every id fits, else uint32."""
    if requested == "auto":
        return "uint16" if vocab <= 65536 else "uint32"
    if requested == "uint16" and vocab > 65536:
        raise PrepareError(
            f"--dtype uint16: {tokenizer_path} has a vocabulary of {vocab}, ids up to {vocab - 1} do not "
            "fit in uint16 (at most 65535): use --dtype uint32 (and training.tokenDtype: uint32)"
        )
    return requested


def vocab_size(tokenizer: Tokenizer) -> int:
    """Rows the model's embedding needs: the largest id plus one (ids need not be contiguous)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def documents(paths: list[Path], text_field: str) -> Iterator[str]:
    """Every document of the inputs, in order."""
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_field]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        text = None
                    if not isinstance(text, str):
                        raise PrepareError(
                            f"{path}:{number}: not a JSON object with a {text_field!r} string "
                            "(--text-field)"
                        )
                    yield text
        else:
            yield path.read_text(encoding="utf-8")


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file: one path resolved (symlinks), or one inode (hard links)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: not the same file
        return False


def check_output(inputs: list[Path], tokenizer_path: Path, output: Path) -> None:
    """Refuse an ``-o`` whose token file or metadata file is one of the inputs or the tokenizer."""
    written = [output, output.with_name(output.name + token_files.METADATA_SUFFIX)]
    for source in [*inputs, tokenizer_path]:
        for target in written:
            if _same_file(source, target):
                what = "the tokenizer (--tokenizer)" if source == tokenizer_path else "an input"
                raise PrepareError(
                    f"-o/--output {output}: {target} is {what} {source}; preparing would overwrite "
                    "it: write the token file to another path (-o)"
                )


def document_ids(encoded: list[int], eos: int | None) -> list[int]:
    """One document's ids as written: the tokenizer's encoding, then end-of-text unless it ends with one."""
    if eos is None or encoded[-1:] == [eos]:
        return encoded
    return [*encoded, eos]


def prepare(
    inputs: list[Path],
    tokenizer_path: Path,
    output: Path,
    *,
    dtype: str = "auto",
    model_vocab: int | None = None,
    text_field: str = "text",
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``output`` (atomically) and write its metadata; returns the metadata.

    The previous metadata goes before the new token file is moved into place, and the new one is
    written through a temporary file: a crash leaves the new file with no metadata (a job checks
    it as raw ids), never with the previous run's.
    """
    missing = [str(p) for p in [tokenizer_path, *inputs] if not p.is_file()]
    if missing:
        raise PrepareError(f"no such file: {', '.join(missing)}")
    check_output(inputs, tokenizer_path, output)
    tokenizer = special_tokens.load_tokenizer(tokenizer_path)
    vocab = vocab_size(tokenizer)
    if model_vocab is not None and vocab > model_vocab:
        raise PrepareError(
            f"{tokenizer_path}: vocabulary of {vocab} tokens exceeds the model's spec.model.vocab={model_vocab}; "
            "ids past it would be refused at training: use the model's tokenizer or raise model.vocab"
        )
    dtype = choose_dtype(dtype, vocab, tokenizer_path)
    special = special_tokens.from_tokenizer(tokenizer)
    eos = special.eos[0] if special.eos else None  # the document separator
    prefix, _ = special_tokens.document_template(tokenizer)
    output.parent.mkdir(parents=True, exist_ok=True)
    meta_path = output.with_name(output.name + token_files.METADATA_SUFFIX)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=output.name, suffix=".tmp")
    count = documents_count = squares = 0  # squares: sum of squared document lengths
    max_id = -1  # recorded, so no rank of a job scans the file for it (token_files.largest_ids)
    total_bytes = sum(p.stat().st_size for p in inputs)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            console.Phase(
                f"tokenising into {output}",
                total=total_bytes,
                unit="B",
                scaled=True,
                disable=not progress,
            ) as bar,
        ):
            for batch in _batches(documents(inputs, text_field), BATCH_DOCUMENTS):
                encoded = tokenizer.encode_batch(batch, add_special_tokens=True)
                ids: list[int] = []
                documents_count += len(encoded)
                for e in encoded:
                    document = document_ids(e.ids, eos)
                    ids += document
                    squares += len(document) ** 2
                flat = np.asarray(ids, dtype=np.int64)
                out.write(flat.astype(token_files.DTYPES[dtype]).tobytes())
                count += len(flat)
                max_id = max(max_id, int(flat.max(initial=-1)))
                bar.update(sum(len(doc.encode("utf-8")) for doc in batch))
                bar.status(f"{documents_count:,} documents, {count:,} tokens")
        file_modes.publish(tmp)  # mkstemp's 0600 would hide it from pods of another UID
        # the previous run's metadata would describe the new file (its max_id vouching for it)
        meta_path.unlink(missing_ok=True)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    metadata = {
        "dtype": dtype,
        "vocab": vocab,
        "tokens": count,
        "documents": documents_count,
        # sum(d^2) / sum(d): the documents' attention-weighted length (training.documentLength)
        "attention_length": round(squares / count, 1) if count else 0,
        "eos_id": eos,
        "bos_id": special.bos,
        "pad_id": special.pad,
        "bos_per_document": bool(prefix),
        "eos_per_document": eos is not None,
        "bytes": output.stat().st_size,
        "max_id": max_id,
        "sample_sha256": vocab_scan.sampled_digest(output),
        "written": vocab_scan.identity(output),
        "tokenizer_sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest(),
        "inputs": [str(p) for p in inputs],
    }
    file_modes.write_atomically(meta_path, json.dumps(metadata, indent=2) + "\n")
    return metadata


def main(args: argparse.Namespace) -> int:
    try:
        model_vocab = args.model_vocab
        if args.job is not None:
            model_vocab = loading.load_spec_file(args.job).model.shape().vocab
        meta = prepare(
            args.inputs,
            args.tokenizer,
            args.output,
            dtype=args.dtype,
            model_vocab=model_vocab,
            text_field=args.text_field,
        )
    except (PrepareError, loading.SpecError) as err:
        print(err, file=sys.stderr)
        return 2
    print(
        f"wrote {meta['tokens']:,} {meta['dtype']} tokens to {args.output} "
        f"(vocabulary {meta['vocab']}); train with training.dataset: {args.output}, tokenDtype: {meta['dtype']}"
    )
    return 0
