"""Training data: a token stream and the deterministic batches drawn from it.

* the default corpus, byte-level tokens (vocab 256) of the Python standard
  library sources that every machine with Python has: the sorted ``*.py``
  files under ``sysconfig.get_paths()['stdlib']``, concatenated, capped to a
  few MB and cached as a uint16 ``.bin`` file;
* user token files (:mod:`.tokens`): raw uint16 or uint32 ids, one file, a
  glob, or several with mixing weights, every id checked when opened;
* :class:`BatchSampler`, which draws the global batch of every step from the
  seed alone (random windows of ``seq_len + 1`` tokens, each from a source
  picked by weight), so every layout and every resume sees
  the same global batches; each data-parallel rank takes a disjoint
  contiguous slice of it and splits that into micro-batches.  Its position
  (the next step) is saved and restored with ``state_dict``.

Not a tokenizer, a shuffling epoch loader or a prefetching
worker pool; the reads are tiny next to a training step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

from meshtrain.trainer.data import special_tokens, token_files, vocab_scan

STDLIB = "stdlib"
"""Dataset name of the default corpus."""
STDLIB_CAP_BYTES = 4 * 1024 * 1024
"""Bytes of standard-library source kept (enough for tests and demos, built in about a second)."""
DATASET_FIELD = "spec.training.dataset"
DATASETS_FIELD = "spec.training.datasets"
EVAL_FIELD = "spec.training.eval"
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
    os.replace(tmp, target)
    return target


def dataset_entries(training) -> list[tuple[str, float]]:  # noqa: ANN001 - a spec Training section
    """(path or glob, weight) of every source ``training`` names ('stdlib' left as is)."""
    if training.datasets:
        return [(source.path, source.weight) for source in training.datasets]
    return [(training.dataset, 1.0)]


def _field(training, index: int) -> str:  # noqa: ANN001
    return f"{DATASETS_FIELD}[{index}]" if training.datasets else DATASET_FIELD


def check_dataset(training, *, vocab: int, from_hf: str | None = None) -> None:  # noqa: ANN001
    """Raise :class:`DatasetError` early (before processes start): a missing file, an empty glob,
    uint16 files for a vocabulary they cannot hold, a file of another element type
    (:func:`.tokens.check_type`; the whole-file id scan is left to the ranks), or files prepared
    with another tokenizer than each other or than the ``fromHF`` model's
    (:func:`.special_tokens.check_agreement`)."""
    entries = dataset_entries(training)
    try:
        every: list[Path] = []
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
    except token_files.TokenFileError as err:
        raise DatasetError(
            f"{err} (expected raw {training.token_dtype} tokens, or '{STDLIB}' for the built-in corpus)"
        ) from None


def open_dataset(training, *, vocab: int, seq_len: int) -> list[token_files.TokenFile]:  # noqa: ANN001
    """Every source of ``training`` opened and checked, id by id, against the model vocabulary."""
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
            entries, dtype=training.token_dtype, vocab=vocab, seq_len=seq_len
        )
    except token_files.TokenFileError as err:
        raise DatasetError(str(err)) from None


def open_eval(training, files: list[token_files.TokenFile], *, vocab: int, seq_len: int):  # noqa: ANN001, ANN201
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


def load_tokens(dataset: str, *, vocab: int, seq_len: int, dtype: str = "uint16") -> np.ndarray:
    """One token file (or 'stdlib') as a read-only memmap, every id checked against ``vocab``."""
    path = stdlib_corpus() if dataset == STDLIB else Path(dataset).expanduser()
    try:
        token_files.expand(str(path), DATASET_FIELD)
        return token_files.open_token_file(
            path, dtype=dtype, vocab=vocab, seq_len=seq_len, field=DATASET_FIELD
        )
    except token_files.TokenFileError as err:
        raise DatasetError(str(err)) from None


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Inputs and next-token targets of one micro-batch."""

    inputs: torch.Tensor
    """(micro_batch, seq_len) int64 token ids."""
    targets: torch.Tensor
    """(micro_batch, seq_len) int64: the inputs shifted by one."""


class BatchSampler:
    """Deterministic global batches, sliced for one data-parallel rank."""

    def __init__(
        self,
        tokens: np.ndarray | list[token_files.TokenFile],
        *,
        seq_len: int,
        micro_batch: int,
        micro_batches: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        files = tokens if isinstance(tokens, list) else None
        self.sources = [f.tokens for f in files] if files else [tokens]
        """Token arrays windows are drawn from."""
        self.weights = torch.tensor(
            [f.weight for f in files] if files else [1.0], dtype=torch.float64
        )
        """Share of the windows drawn from each source."""
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.micro_batches = micro_batches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.global_batch = micro_batch * micro_batches * dp_size
        """Sequences per optimizer step."""
        self.position = 0
        """Index of the next global batch (steps drawn so far)."""

    def windows(self, index: int) -> list[tuple[int, int]]:
        """(source, start offset) of the ``global_batch`` windows of batch ``index``: a function of seed and index only.

        With several sources each window first picks its source by weight,
        then a uniform start inside it; one source keeps the plain draw.
        """
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        highs = [len(t) - self.seq_len - 1 for t in self.sources]
        if len(self.sources) == 1:
            starts = torch.randint(0, highs[0], (self.global_batch,), generator=generator)
            return [(0, o) for o in starts.tolist()]
        picks = torch.multinomial(self.weights, self.global_batch, True, generator=generator)
        uniform = torch.rand(self.global_batch, generator=generator, dtype=torch.float64)
        return [
            (s, min(int(u * highs[s]), highs[s] - 1))
            for s, u in zip(picks.tolist(), uniform.tolist())
        ]

    def global_batch_at(self, index: int) -> torch.Tensor:
        """All windows of batch ``index``: (global_batch, seq_len + 1) int64."""
        return self._read(self.windows(index))

    def _read(self, windows: list[tuple[int, int]]) -> torch.Tensor:
        rows = [
            np.asarray(self.sources[s][o : o + self.seq_len + 1], dtype=np.int64)
            for s, o in windows
        ]
        return torch.from_numpy(np.stack(rows))

    def next(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch; advances the position."""
        self.position += 1
        return self.at(self.position - 1)

    def at(self, index: int) -> list[MicroBatch]:
        """This rank's micro-batches of global batch ``index`` (the position is left alone)."""
        per_rank = self.global_batch // self.dp_size
        # every rank draws the same global list of windows (cheap) but reads only its own rows
        windows = self.windows(index)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        mine = self._read(windows)  # (G/dp, T+1)
        return [
            MicroBatch(inputs=mb[:, :-1], targets=mb[:, 1:]) for mb in mine.split(self.micro_batch)
        ]

    def state_dict(self) -> dict[str, int]:
        """The data position, for checkpoints."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position (the seed must match)."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"data state was saved with seed {state['seed']}, this run uses {self.seed}"
            )
        self.position = int(state["position"])
