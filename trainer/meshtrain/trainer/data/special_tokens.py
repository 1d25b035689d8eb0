"""Begin/end-of-text and padding token ids: from a tokenizer through token files and checkpoints to exports.

A Hugging Face model whose config lacks them falls back to its config class's defaults
(``LlamaConfig``: bos 1, eos 2; ``GPT2Config``: 50256), so ``generate`` would stop at whatever
token happens to have that id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from meshtrain.api import limits
from meshtrain.trainer import small_files, storage
from meshtrain.trainer.data import token_files

FROM_HF_FIELD = "spec.model.init.fromHF"

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
"""Begin-of-text tokens of common tokenizers (Llama 3, Llama 2 / Mistral, Gemma, GPT-2's shared one), tried in order."""
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
"""End-of-text tokens of common tokenizers (Llama 3, GPT-2, Llama 2 / Mistral, Gemma), tried in order."""
PAD_CANDIDATES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>")
"""Padding tokens of common tokenizers, tried in order."""


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The special token ids a Hugging Face config carries (None / empty: the tokenizer has none).

    ``eos`` is a tuple: Llama 3 Instruct's generation stops at any of
    ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``; its first id is the one
    ``meshtrain data prepare`` ends documents with.
    """

    bos: int | None = None
    eos: tuple[int, ...] = ()
    pad: int | None = None

    def to_json(self) -> dict[str, int | list[int] | None]:
        """The ``*_token_id`` keys of a Hugging Face ``config.json`` / ``generation_config.json``."""
        eos: int | list[int] | None = (
            list(self.eos) if len(self.eos) > 1 else self.eos[0] if self.eos else None
        )
        return {"bos_token_id": self.bos, "eos_token_id": eos, "pad_token_id": self.pad}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TokenIds:
        """From ``*_token_id`` keys (a config.json, generation_config.json, or a checkpoint marker's record)."""

        def one(value: Any) -> int | None:
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        eos = raw.get("eos_token_id")
        listed = eos if isinstance(eos, list) else [eos]
        return cls(
            bos=one(raw.get("bos_token_id")),
            eos=tuple(i for i in map(one, listed) if i is not None),
            pad=one(raw.get("pad_token_id")),
        )

    def or_else(self, other: TokenIds) -> TokenIds:
        """Each id of ``self``, or ``other``'s where ``self`` has none."""
        return TokenIds(
            bos=self.bos if self.bos is not None else other.bos,
            eos=self.eos or other.eos,
            pad=self.pad if self.pad is not None else other.pad,
        )

    def with_eos(self, more: Iterable[int]) -> TokenIds:
        """``self`` with the end-of-text ids of ``more`` it lacks appended."""
        return dataclasses.replace(self, eos=tuple(dict.fromkeys([*self.eos, *more])))


UNKNOWN = TokenIds()
"""No special token known."""


def _first(tokenizer: Tokenizer, candidates: Iterable[str]) -> int | None:
    ids = (tokenizer.token_to_id(token) for token in candidates)
    return next((i for i in ids if i is not None), None)


def document_template(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer's post-processor puts before and after every document.

    Read from the tokenizer itself (``add_special_tokens=True`` on a
    one-character text, its ``special_tokens_mask``): ``([bos], [])`` for a
    Llama template such as ``<|begin_of_text|> $A``, ``([], [])`` for GPT-2.
    """
    try:
        encoding = tokenizer.encode("a", add_special_tokens=True)
    except Exception:  # noqa: BLE001 - e.g. a WordLevel model without an unknown token: no template to read
        return [], []
    mask = encoding.special_tokens_mask
    lead = next((i for i, special in enumerate(mask) if not special), len(mask))
    tail = next((i for i, special in enumerate(reversed(mask)) if not special), 0)
    return encoding.ids[:lead], encoding.ids[len(mask) - tail :] if tail else []


def from_tokenizer(tokenizer: Tokenizer) -> TokenIds:
    """The ids of the tokenizer's begin-, end-of-text and padding tokens.

    Begin-of-text is the token its post-processor starts documents with, if
    it adds one, else the first of the usual names it has; end-of-text is the
    usual name, else the token the post-processor ends documents with.
    """
    prefix, suffix = document_template(tokenizer)
    bos = prefix[0] if prefix else _first(tokenizer, BOS_CANDIDATES)
    eos = _first(tokenizer, EOS_CANDIDATES)
    if eos is None and suffix:
        eos = suffix[-1]
    return TokenIds(
        bos=bos,
        eos=(eos,) if eos is not None else (),
        pad=_first(tokenizer, PAD_CANDIDATES),
    )


def load_tokenizer(path: Path) -> Tokenizer:
    """A ``tokenizer.json`` without the truncation and padding it may have been saved with.

    ``Tokenizer.from_file`` restores both, which would cut every document to
    ``max_length`` and fill short ones with the padding id, silently.
    """
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def from_tokenizer_file(path: Path) -> TokenIds:
    """:func:`from_tokenizer` of a ``tokenizer.json``."""
    return from_tokenizer(load_tokenizer(path))


def agreed(records: Iterable[TokenIds]) -> TokenIds:
    """The ids every record agrees on (a mixture tokenised with different tokenizers has none it disagrees on)."""
    found = list(records)
    if not found:
        return TokenIds()

    def common(values: list[Any]) -> Any:
        return values[0] if len(set(values)) == 1 else None

    return TokenIds(
        bos=common([r.bos for r in found]),
        eos=common([r.eos for r in found]) or (),
        pad=common([r.pad for r in found]),
    )


def from_token_files(paths: Iterable[token_files.Location]) -> TokenIds:
    """The ids ``meshtrain data prepare`` recorded beside the token files (those without metadata say nothing)."""
    records = []
    for token_file in paths:
        if token_files.metadata_path(token_file).is_file():
            meta = token_files.read_metadata(token_file)
            records.append(
                TokenIds.from_json(
                    {
                        "bos_token_id": meta.get("bos_id"),
                        "eos_token_id": meta.get("eos_id"),
                        "pad_token_id": meta.get("pad_id"),
                    }
                )
            )
    return agreed(records)


def from_hf_directory(directory: Path) -> TokenIds:
    """The ids a Hugging Face directory names: ``generation_config.json``'s (what ``generate`` uses), then ``config.json``'s."""
    found = TokenIds()
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            raw = small_files.read_json(
                path, limits.MAX_HF_JSON_BYTES, "Hugging Face JSON file", token_files.TokenFileError
            )
            if isinstance(raw, dict):
                found = found.or_else(TokenIds.from_json(raw))
    return found


def for_job(files: Iterable[token_files.TokenFile], from_hf: str | None) -> TokenIds:
    """A job's ids: its training files' (prepared with the tokenizer), else its ``model.init.fromHF`` directory's.

    End-of-text ids are merged: the imported model's (all of them, so an instruct
    model still stops at its turn ends), then the data's.
    """
    found = from_token_files(f.path for f in files)
    if not from_hf:
        return found
    imported = from_hf_directory(storage.local_path(from_hf, FROM_HF_FIELD))
    return dataclasses.replace(found.or_else(imported), eos=imported.with_eos(found.eos).eos)


def _prepared(path: token_files.Location) -> dict[str, Any] | None:
    meta_path = token_files.metadata_path(path)
    if not meta_path.is_file():
        return None
    meta = token_files.read_metadata(path)
    return meta if isinstance(meta, dict) else None


def check_agreement(paths: Iterable[token_files.Location], from_hf: str | None) -> None:
    """Refuse data tokenised with different tokenizers, or with one other than the imported model's.

    Judged from what ``meshtrain data prepare`` recorded beside each file
    (files without that metadata say nothing): every file's
    ``tokenizer_sha256`` must be the same, and its begin-of-text id the
    ``model.init.fromHF`` directory's and its end-of-text id one of that
    directory's (``generation_config.json`` and ``config.json`` together, as
    an instruct model stops at several).
    """
    prepared = [(path, meta) for path in paths if (meta := _prepared(path)) is not None]
    hashes: dict[str, token_files.Location] = {}
    for path, meta in prepared:
        digest = meta.get("tokenizer_sha256")
        if digest and hashes and digest not in hashes:
            other = next(iter(hashes.values()))
            raise token_files.TokenFileError(
                f"{token_files.metadata_path(other)} and {token_files.metadata_path(path)} were "
                "prepared with different tokenizers (tokenizer_sha256 differs): ids mean different "
                "tokens in each; prepare every source with the model's tokenizer.json"
            )
        if digest:
            hashes[digest] = path
    if not from_hf or not prepared:
        return
    directory = storage.local_path(from_hf, FROM_HF_FIELD)
    files = [
        directory / n
        for n in ("generation_config.json", "config.json")
        if (directory / n).is_file()
    ]
    imported = from_hf_directory(directory)
    named = " / ".join(str(f) for f in files)
    fix = (
        "the data was tokenised with another tokenizer than the model's: prepare it with "
        f"meshtrain data prepare --tokenizer {directory / 'tokenizer.json'}"
    )
    for path, meta in prepared:
        where = token_files.metadata_path(path)
        bos, eos = meta.get("bos_id"), meta.get("eos_id")
        if bos is not None and imported.bos is not None and bos != imported.bos:
            raise token_files.TokenFileError(
                f"{where}: bos_id={bos} but {named} bos_token_id={imported.bos}: {fix}"
            )
        if eos is not None and imported.eos and eos not in imported.eos:
            raise token_files.TokenFileError(
                f"{where}: eos_id={eos} but {named} eos_token_id={list(imported.eos)}: {fix}"
            )
