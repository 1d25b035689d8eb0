"""Rank-layout arithmetic for data x pipeline x context x tensor parallelism: :class:`ParallelLayout`.

Degrees, world size, a rank's coordinates and each process group's members, in the order the
design fixes (pipeline outermost, tensor innermost, context just outside tensor as Megatron
orders tp-cp-dp-pp)::

    rank = ((pp * data + dp) * context + cp) * tensor + tp

so a tensor-parallel group is a block of consecutive local ranks of one pod, and a context group
the next block out (it spans pods once ``tensor x context`` exceeds a pod's ranks).  With
``context = 1`` this is the 3D formula ``(pp * data + dp) * tensor + tp``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the (pp, dp, cp, tp) grid."""

    pp: int
    """Pipeline stage index."""
    dp: int
    """Data-parallel replica index."""
    tp: int
    """Tensor-parallel shard index."""
    cp: int = 0
    """Context-parallel index: which slice of the sequence this rank holds."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The degrees of a parallel job and the arithmetic on them."""

    data: int
    """Data-parallel degree."""
    pipeline: int
    """Pipeline-parallel degree (stages)."""
    tensor: int
    """Tensor-parallel degree."""
    context: int = 1
    """Context-parallel degree: ranks that split each sequence."""

    def __post_init__(self) -> None:
        for name in ("data", "pipeline", "tensor", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} degree must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.data * self.pipeline * self.context * self.tensor

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """Shape of the (pp, dp, tp) device mesh in rank order (3D layouts only: see :attr:`mesh_shape_4d`)."""
        if self.context != 1:
            raise ValueError(f"{self} has a context axis: use mesh_shape_4d")
        return (self.pipeline, self.data, self.tensor)

    @property
    def mesh_shape_4d(self) -> tuple[int, int, int, int]:
        """Shape of the (pp, dp, cp, tp) device mesh in rank order."""
        return (self.pipeline, self.data, self.context, self.tensor)

    def __str__(self) -> str:
        context = f"·cp{self.context}" if self.context > 1 else ""
        return f"dp{self.data}·pp{self.pipeline}{context}·tp{self.tensor}"

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """Global rank at the given coordinates."""
        inside = (
            0 <= pp < self.pipeline
            and 0 <= dp < self.data
            and 0 <= cp < self.context
            and 0 <= tp < self.tensor
        )
        if not inside:
            raise ValueError(f"coordinates (pp={pp}, dp={dp}, cp={cp}, tp={tp}) outside {self}")
        return ((pp * self.data + dp) * self.context + cp) * self.tensor + tp

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size} of {self}")
        tp = rank % self.tensor
        cp = (rank // self.tensor) % self.context
        dp = (rank // (self.tensor * self.context)) % self.data
        pp = rank // (self.tensor * self.context * self.data)
        return RankCoords(pp=pp, dp=dp, tp=tp, cp=cp)

    def tp_group(self, rank: int) -> list[int]:
        """Ranks sharing this rank's layers and sequence slice (same pp, dp, cp)."""
        c = self.coords(rank)
        return [self.rank_of(c.pp, c.dp, t, c.cp) for t in range(self.tensor)]

    def cp_group(self, rank: int) -> list[int]:
        """Ranks splitting this rank's sequences, slice 0 first (same pp, dp, tp)."""
        c = self.coords(rank)
        return [self.rank_of(c.pp, c.dp, c.tp, k) for k in range(self.context)]

    def dp_group(self, rank: int) -> list[int]:
        """Ranks holding replicas of this rank's shard and the same sequence slice (same pp, cp, tp).

        With context parallelism the ranks holding replicas of the shard are :meth:`dp_cp_group`'s
        (data x context): they sum its gradients.
        """
        c = self.coords(rank)
        return [self.rank_of(c.pp, d, c.tp, c.cp) for d in range(self.data)]

    def dp_cp_group(self, rank: int) -> list[int]:
        """Ranks holding replicas of this rank's shard, whatever their sequence slice (same pp, tp), in
        rank order (dp-major, cp-minor): the group that sums its gradients (Megatron-Core's dp-cp);
        :meth:`dp_group` without context parallelism."""
        c = self.coords(rank)
        return [
            self.rank_of(c.pp, d, c.tp, k) for d in range(self.data) for k in range(self.context)
        ]

    def pp_group(self, rank: int) -> list[int]:
        """Ranks forming this rank's pipeline, stage 0 first (same dp, cp, tp)."""
        c = self.coords(rank)
        return [self.rank_of(p, c.dp, c.tp, c.cp) for p in range(self.pipeline)]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ('tp', 'cp', 'dp', 'dp_cp' or 'pp'), each listed once, in rank order.

        A group is ``count`` ranks ``stride`` apart from its first (the rank formula), so the
        groups cost O(world) to list rather than O(world x group) to collect rank by rank.
        """
        stride, count = {
            "tp": (1, self.tensor),
            "cp": (self.tensor, self.context),
            "dp": (self.tensor * self.context, self.data),
            "dp_cp": (self.tensor, self.data * self.context),  # data and context are adjacent
            "pp": (self.tensor * self.context * self.data, self.pipeline),
        }[axis]
        firsts = (r for r in range(self.world_size) if (r // stride) % count == 0)
        return [list(range(first, first + stride * count, stride)) for first in firsts]

    def dp_levels(self, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every data-parallel group split by node: (intra-node groups, inter-node groups).

        An intra group is the dp peers one pod holds; an inter group takes the
        peer at the same position of every pod (the same local rank offset),
        the ranks a hierarchical all-reduce sums a shard over.
        """
        intra: list[list[int]] = []
        inter: list[list[int]] = []
        for group in self.all_groups("dp"):
            by_pod: dict[int, list[int]] = {}
            for rank in group:
                by_pod.setdefault(self.pod_of(rank, gpus_per_node), []).append(rank)
            blocks = list(by_pod.values())
            intra += blocks
            inter += [list(peers) for peers in zip(*blocks)]
        return intra, inter

    def tensor_fits_pod(self, gpus_per_node: int) -> bool:
        """Whether every tensor-parallel group lies inside one pod of ``gpus_per_node`` ranks.

        Groups are blocks of ``tensor`` consecutive ranks and pods blocks of
        ``gpus_per_node``, so over whole pods every group stays in one exactly when
        ``tensor`` divides ``gpus_per_node``.
        """
        return gpus_per_node % self.tensor == 0

    def fills_pods(self, gpus_per_node: int) -> bool:
        """Whether the ranks fill whole pods of ``gpus_per_node`` (the world size is a multiple of it)."""
        return self.world_size % gpus_per_node == 0

    def tensor_split_problem(self, gpus_per_node: int) -> str | None:
        """Why a tensor-parallel group would leave a pod of ``gpus_per_node`` ranks, or None (:meth:`tensor_fits_pod`)."""
        if self.tensor_fits_pod(gpus_per_node):
            return None
        return (
            f"tensor={self.tensor} does not divide gpusPerNode={gpus_per_node}; a tensor-parallel group must "
            f"stay inside one node's NVLink domain: choose tensor from the divisors of {gpus_per_node}"
        )

    def pod_fill_problem(self, gpus_per_node: int) -> str | None:
        """Why the ranks do not fill whole pods of ``gpus_per_node``, or None (:meth:`fills_pods`)."""
        if self.fills_pods(gpus_per_node):
            return None
        return (
            f"world size data x pipeline x context x tensor = {self} = {self.world_size} is not a multiple of "
            f"gpusPerNode={gpus_per_node}; every pod runs gpusPerNode ranks: change the degrees or gpusPerNode"
        )

    def pod_problem(self, gpus_per_node: int) -> str | None:
        """Why pods of ``gpus_per_node`` ranks cannot run this layout, or None.

        The spec's rules judge each half on its own field; a placement request,
        which has no spec, refuses the first.
        """
        return self.tensor_split_problem(gpus_per_node) or self.pod_fill_problem(gpus_per_node)

    def dp_ranks_per_pod(self, gpus_per_node: int) -> int:
        """Ranks of one data-parallel group in one pod of ``gpus_per_node``: ``gpusPerNode / (tensor x context)``, at most ``data``."""
        return min(max(gpus_per_node // (self.tensor * self.context), 1), self.data)

    def pods(self, gpus_per_node: int) -> int:
        """Pods in the gang, one per node slot of ``gpus_per_node`` ranks."""
        return self.world_size // gpus_per_node

    def pod_of(self, rank: int, gpus_per_node: int) -> int:
        """Pod (node slot) index holding a rank: pod i holds [i*g, (i+1)*g)."""
        return rank // gpus_per_node

    def ranks_of_pod(self, pod: int, gpus_per_node: int) -> range:
        """Global ranks run by one pod."""
        return range(pod * gpus_per_node, (pod + 1) * gpus_per_node)

    def stages_of_pod(self, pod: int, gpus_per_node: int) -> list[int]:
        """Pipeline stages a pod's ranks belong to (sorted, distinct)."""
        return sorted({self.coords(r).pp for r in self.ranks_of_pod(pod, gpus_per_node)})


TP_OVERLAP_CHUNKS = 2
"""Chunks an overlapped tensor-parallel linear splits its sequence into (``parallelism.overlap.tensor``):
chunk k's collective runs beside chunk k+1's matmul, so about 1/k of it stays exposed.  The trainer
runs it and the planner prices it."""

VOCAB_ALIGNMENT = 64
"""Rows of a vocabulary shard are a multiple of this when the vocabulary has to be padded (GPU tiles)."""


def padded_vocab(vocab: int, tensor: int) -> int:
    """Rows of the vocabulary-parallel tables over ``tensor`` ranks.

    The vocabulary itself when it splits evenly; else rounded up to a
    multiple of ``VOCAB_ALIGNMENT x tensor`` (Megatron-LM's
    ``make-vocab-size-divisible-by``), the added rows zero and masked out of
    the loss.  Checkpoints and exports keep the true vocabulary.
    """
    if vocab % tensor == 0:
        return vocab
    step = VOCAB_ALIGNMENT * tensor
    return -(-vocab // step) * step
