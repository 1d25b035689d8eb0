"""The deterministic batches of a run, drawn from the job's opened token files.

:class:`BatchSampler` draws every step's global batch from the seed and the step alone
(``sampling: random``, with replacement), or takes the next windows of the seeded epoch order
(``sampling: epochs``, :mod:`.epochs`), so every layout and every resume sees the same batches;
each data-parallel rank takes its slice.  No prefetching workers: the reads are tiny next to a
training step.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from meshtrain.trainer.data import epochs, ranged_tokens, token_files


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
        sampling: str = "random",
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
        self.order = (
            epochs.WindowOrder.of([len(t) for t in self.sources], seq_len=seq_len, seed=seed)
            if sampling == "epochs"
            else None
        )
        """The epoch order of the windows (``sampling: epochs``); None: random draws."""
        self.origin = (0, 0)
        """(batch index, windows of the epoch order drawn before it): where a resume at another
        global batch picks the order up (:meth:`load_state_dict`)."""

    def first_window(self, index: int) -> int:
        """How many windows of the epoch order come before global batch ``index``."""
        step, drawn = self.origin
        return drawn + (index - step) * self.global_batch

    def epoch_at(self, index: int) -> int:
        """The epoch (0-based) of global batch ``index``'s first window (0 under random sampling)."""
        return self.order.epoch_of(self.first_window(index)) if self.order else 0

    def windows(self, index: int) -> list[tuple[int, int]]:
        """(source, start offset) of the ``global_batch`` windows of batch ``index``: a function of seed and index only.

        With several sources each window first picks its source by weight,
        then a uniform start inside it; one source keeps the plain draw.
        """
        if self.order is not None:  # the next global_batch windows of the epoch order
            first = self.first_window(index)
            return [self.order.window(first + i) for i in range(self.global_batch)]
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
        return torch.from_numpy(ranged_tokens.read_windows(self.sources, windows, self.seq_len + 1))

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
        """The data position, for checkpoints (under epochs also the windows drawn so far)."""
        state = {"position": self.position, "seed": self.seed}
        if self.order is not None:
            state["windows"] = self.first_window(self.position)
            state |= self._order_identity()
        return state

    def _order_identity(self) -> dict[str, int]:
        """What the epoch order is a permutation of: its size, seq_len, and a digest of every
        source's first window index (so of each file's window count, in order)."""
        assert self.order is not None
        starts = ",".join(map(str, self.order.starts)).encode()
        digest = int.from_bytes(hashlib.sha256(starts).digest()[:7], "big")  # exact in JSON
        return {"order_size": self.order.size, "seq_len": self.seq_len, "order_digest": digest}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position (the seed must match).

        Under epochs the order continues at the saved window count, so a resume at
        another global batch (a resize) neither repeats nor skips a window; data whose
        windows differ from the saved order's (another file list, other files, another
        seq_len) are refused: the saved count would index another permutation.
        """
        if state["seed"] != self.seed:
            raise ValueError(
                f"data state was saved with seed {state['seed']}, this run uses {self.seed}"
            )
        if self.order is not None and "order_digest" in state:  # older checkpoints: not recorded
            saved, mine = ({k: state[k] for k in self._order_identity()}, self._order_identity())
            if saved != mine:
                raise ValueError(
                    f"sampling: epochs cannot continue the saved epoch order: it was drawn over "
                    f"{saved['order_size']} windows of {saved['seq_len']} tokens (digest "
                    f"{saved['order_digest']:x}), this run's data makes {mine['order_size']} windows "
                    f"of {mine['seq_len']} tokens (digest {mine['order_digest']:x}): "
                    "spec.training.datasets (or spec.training.dataset) and spec.model.seqLen must name "
                    "the files the checkpoint was trained on, in the same order; to train on other "
                    "data, start the job with a new checkpoint.path"
                )
        self.position = int(state["position"])
        drawn = state.get("windows")
        self.origin = (
            self.position,
            int(drawn) if drawn is not None else self.position * self.global_batch,
        )
