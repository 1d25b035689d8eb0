"""A token file in a bucket, read by byte ranges: :class:`RangedTokens`.

It stands where a local file's ``np.memmap`` stands: ``len()``, slicing (a lazy view, as a
memmap's slice is) and ``np.asarray`` of a view, which fetches just that view's bytes. The batch
sampler reads each step's windows with :func:`read_windows`, one concurrent round of ranged GETs
for all of them. Windows are drawn at random offsets, so a block cache would only multiply the
bytes read: each request is exactly one window (``seqLen + 1`` ids), and a view larger than
:data:`MAX_READ_TOKENS` is refused rather than read (nothing reads a remote file whole).

Every id read is checked against the model's vocabulary (the whole-file scan of a local file is
not made: the file's ``data prepare`` metadata vouches for it, and this check catches a file that
was replaced since).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshtrain.trainer import storage

MAX_READ_TOKENS = 1 << 24
"""Ids one read may fetch (32 MiB of uint16): far above a window, far below a corpus."""


class RangedTokens:
    """Ids ``[start, stop)`` of a token object, fetched on demand."""

    def __init__(
        self, url: str, dtype: np.dtype[Any], vocab: int, start: int = 0, stop: int | None = None
    ) -> None:
        self.url = url
        self.dtype = dtype
        self.vocab = vocab
        self.start = start
        self.stop = stop if stop is not None else storage.size(url) // dtype.itemsize

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> RangedTokens:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("RangedTokens takes plain slices only")
        lo, hi, _ = index.indices(len(self))
        return RangedTokens(
            self.url, self.dtype, self.vocab, self.start + lo, self.start + max(lo, hi)
        )

    def request(self) -> tuple[str, int, int]:
        """(url, first byte, end byte) of this view."""
        if len(self) > MAX_READ_TOKENS:
            raise storage.ObjectStorageError(
                f"{self.url}: a read of {len(self)} ids at once is refused (at most {MAX_READ_TOKENS}): "
                "token files in a bucket are read by windows"
            )
        size = self.dtype.itemsize
        return self.url, self.start * size, self.stop * size

    def decode(self, data: bytes) -> np.ndarray:
        """The ids of ``data`` (this view's bytes), checked against the vocabulary."""
        ids = np.frombuffer(data, dtype=self.dtype)
        if ids.size and int(ids.max()) >= self.vocab:
            at = int(np.argmax(ids >= self.vocab))
            raise storage.ObjectStorageError(
                f"{self.url}: token id {int(ids[at])} >= model vocab {self.vocab} at position "
                f"{self.start + at} (spec.model.vocab): the file is not what its data prepare "
                "metadata describes; prepare it again"
            )
        return ids

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        ids = self.decode(storage.read_ranges([self.request()])[0])
        return ids.astype(dtype) if dtype is not None else ids


def read_windows(sources: list[Any], windows: list[tuple[int, int]], length: int) -> np.ndarray:
    """Rows ``sources[s][o : o + length]`` of each (source, offset) as int64; ranged sources in one round."""
    views = [sources[s][o : o + length] for s, o in windows]
    remote = [i for i, view in enumerate(views) if isinstance(view, RangedTokens)]
    rows: list[Any] = list(views)
    if remote:
        fetched = storage.read_ranges([views[i].request() for i in remote])
        for i, data in zip(remote, fetched):
            rows[i] = views[i].decode(data)
    return np.stack([np.asarray(row, dtype=np.int64) for row in rows])
