"""Training data: a token stream and the deterministic batches drawn from it.

What it is:

* the default corpus, byte-level tokens (vocab 256) of the Python standard
  library sources that every machine with Python has: the sorted ``*.py``
  files under ``sysconfig.get_paths()['stdlib']``, concatenated, capped to a
  few MB and cached as a uint16 ``.bin`` file;
* a user token file: raw little-endian uint16 tokens, memory-mapped;
* :class:`BatchSampler`, which draws the global batch of every step from the
  seed alone (random windows of ``seq_len + 1`` tokens), so every layout sees
  the same global batches; each data-parallel rank takes a disjoint
  contiguous slice of it and splits that into micro-batches.  Its position
  (the next step) is saved and restored with ``state_dict``.

What it is not: a tokenizer, a shuffling epoch loader or a prefetching
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

STDLIB = "stdlib"
"""Dataset name of the default corpus."""
STDLIB_CAP_BYTES = 4 * 1024 * 1024
"""Bytes of standard-library source kept (enough for tests and demos, built in about a second)."""
DATASET_FIELD = "spec.training.dataset"


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the path and the spec field."""


def cache_dir() -> Path:
    """Where the corpus cache lives: $MESHTRAIN_CACHE_DIR, else ~/.cache/meshtrain."""
    env = os.environ.get("MESHTRAIN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "meshtrain"


def stdlib_corpus(directory: Path | None = None, cap_bytes: int = STDLIB_CAP_BYTES) -> Path:
    """The cached uint16 token file of the standard-library corpus (built once, atomically)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{stdlib}|{cap_bytes}".encode()).hexdigest()[:12]
    directory = directory or cache_dir()
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


def dataset_path(dataset: str) -> Path:
    """The token file a ``training.dataset`` value names; checks it exists without building anything."""
    if dataset == STDLIB:
        return stdlib_corpus()
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise DatasetError(
            f"{DATASET_FIELD}: token file {str(path)!r} does not exist (expected raw uint16 tokens, "
            f"or '{STDLIB}' for the built-in corpus)"
        )
    return path


def check_dataset(dataset: str) -> None:
    """Raise :class:`DatasetError` early (before processes start) for a missing user file."""
    if dataset != STDLIB:
        dataset_path(dataset)


def load_tokens(dataset: str, *, vocab: int, seq_len: int) -> np.ndarray:
    """The token stream as a read-only uint16 memmap, checked against the model shape."""
    path = dataset_path(dataset)
    size = path.stat().st_size
    if size % 2:
        raise DatasetError(
            f"{DATASET_FIELD}: {str(path)!r} has an odd byte count ({size}); expected uint16 tokens"
        )
    if size // 2 < seq_len + 2:
        raise DatasetError(
            f"{DATASET_FIELD}: {str(path)!r} holds {size // 2} tokens, fewer than seqLen + 2 = {seq_len + 2}"
        )
    tokens = np.memmap(path, dtype="<u2", mode="r")
    largest = int(tokens[: 1 << 20].max())
    if largest >= vocab:
        raise DatasetError(
            f"{DATASET_FIELD}: {str(path)!r} has token id {largest} >= model vocab {vocab}"
        )
    return tokens


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
        tokens: np.ndarray,
        *,
        seq_len: int,
        micro_batch: int,
        micro_batches: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.tokens = tokens
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

    def offsets(self, index: int) -> torch.Tensor:
        """Start offsets of the ``global_batch`` windows of batch ``index``: a function of seed and index only."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        high = len(self.tokens) - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=generator)

    def global_batch_at(self, index: int) -> torch.Tensor:
        """All windows of batch ``index``: (global_batch, seq_len + 1) int64."""
        rows = [
            np.asarray(self.tokens[o : o + self.seq_len + 1]) for o in self.offsets(index).tolist()
        ]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def next(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch; advances the position."""
        batch = self.global_batch_at(self.position)  # (G, T+1)
        self.position += 1
        per_rank = self.global_batch // self.dp_size
        mine = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]  # (G/dp, T+1)
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
