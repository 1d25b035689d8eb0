"""``training.sampling: epochs``: every non-overlapping window once per epoch, in a seeded order.

The order is a keyed permutation of the window indices computed one index at a time (a four-round
Feistel network over the next power of four, cycle-walked into range), so no rank holds a table
of every window (a terabyte of tokens is hundreds of millions of windows) and the order depends on
the seed and the epoch alone: not on the data-parallel degree, the batch, or a resume.
"""

from __future__ import annotations

import bisect
import dataclasses

_M64 = (1 << 64) - 1
ROUNDS = 4
"""Feistel rounds (four make a pseudo-random permutation of a balanced network)."""


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer to a well-mixed one."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def permuted(index: int, size: int, key: int) -> int:
    """Where ``index`` goes in the permutation of ``range(size)`` that ``key`` names.

    A bijection on ``range(4**half)`` (``4**half < 4 * size``) walked until it lands
    inside ``range(size)``: a bijection on ``range(size)``, about four steps at most on average.
    """
    if not 0 <= index < size:
        raise ValueError(f"window {index} outside 0..{size - 1}")
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix(key * ROUNDS + r) for r in range(ROUNDS)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for round_key in keys:
            left, right = right, left ^ (_mix(round_key ^ right) & mask)
        x = (left << half) | right
        if x < size:
            return x


@dataclasses.dataclass(frozen=True)
class WindowOrder:
    """The epochs of the non-overlapping windows of some token sources."""

    starts: tuple[int, ...]
    """Index of each source's first window, then the total: source s holds windows
    ``starts[s]`` to ``starts[s + 1] - 1`` (its tokens cut into seq_len + 1 reads that step by seq_len)."""
    seq_len: int
    """Tokens per window (its read holds one more, the last target)."""
    seed: int
    """training.seed: with the epoch, the key of the epoch's permutation."""

    @classmethod
    def of(cls, lengths: list[int], *, seq_len: int, seed: int) -> WindowOrder:
        """The windows of sources of ``lengths`` tokens each."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + max(0, (n - 1) // seq_len))
        return cls(tuple(starts), seq_len, seed)

    @property
    def size(self) -> int:
        """Windows in one epoch."""
        return self.starts[-1]

    def epoch_of(self, flat: int) -> int:
        """The epoch of the ``flat``-th window drawn since the run began (0-based)."""
        return flat // self.size

    def window(self, flat: int) -> tuple[int, int]:
        """(source, start offset) of the ``flat``-th window drawn since the run began."""
        epoch, offset = divmod(flat, self.size)
        index = permuted(offset, self.size, _mix(self.seed * 1_000_003 + epoch))
        source = bisect.bisect_right(self.starts, index) - 1
        return source, (index - self.starts[source]) * self.seq_len
