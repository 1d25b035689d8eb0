"""Process groups: the default group from torchrun's environment and the (pp, dp, [cp,] tp) mesh.

:func:`build_mesh` creates the DeviceMesh of shape ``(pipeline, data, tensor)``, whose row-major
order is DESIGN's ``rank = (pp*data + dp)*tensor + tp`` (with context parallelism
``(pipeline, data, context, tensor)`` named ``(pp, dp, cp, tp)``, ``rank = ((pp*data + dp)*context
+ cp)*tensor + tp``); :class:`Mesh` checks it against :class:`meshtrain.api.layout.ParallelLayout`
and adds a second pipeline group and a second context group, so activations and gradients travel
apart (NCCL ignores point-to-point tags), and the data x context group that reduces gradients.  Groups time out, so a dead peer is an error, not a hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import sys
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import device_mesh

from meshtrain.api import layout as layout_mod

DEFAULT_TIMEOUT_S = 300
"""Collective timeout; a peer that died is reported after this at worst (the launcher kills sooner)."""


def device_for(local_rank: int, *, use_cuda: bool) -> torch.device:
    """The device a rank computes on."""
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(*, use_cuda: bool, timeout_s: float | None = None) -> None:
    """Join the default group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    timeout_s = timeout_s or float(os.environ.get("MESHTRAIN_PG_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )


def exit_now(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown.

    After ``destroy_process_group`` a gloo rank can still abort while Python
    finalises (``terminate called without an active exception``, SIGABRT: one
    run in about twenty of our two-rank tests), which would turn a finished
    run's exit 0 into 134 and make the operator restart a job that succeeded.
    Everything worth keeping is written by now; flush the streams and leave.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclasses.dataclass
class Mesh:
    """This rank's groups along each axis of the layout."""

    layout: layout_mod.ParallelLayout
    """Degrees and rank arithmetic."""
    rank: int
    """Global rank."""
    coords: layout_mod.RankCoords
    """(pp, dp, cp, tp) of this rank."""
    device_mesh: device_mesh.DeviceMesh
    """The DeviceMesh named (pp, dp, tp), or (pp, dp, cp, tp) with context parallelism."""
    device: torch.device
    """Where this rank computes."""
    pp_backward_group: dist.ProcessGroup
    """A second pipeline group, for gradients."""
    dp_cp_group: dist.ProcessGroup | None = None
    """The data x context ranks holding this rank's parameters (None without context parallelism)."""
    cp_backward_group: dist.ProcessGroup | None = None
    """A second context group, for the ring's key/value gradients (None without context parallelism)."""

    dp_levels: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = dataclasses.field(
        default_factory=dict
    )
    """(intra-node, inter-node) data-parallel groups by ranks per node, made on first use."""

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group along ``axis`` ('pp', 'dp', 'tp', or 'cp' with context parallelism)."""
        return self.device_mesh.get_group(axis)

    @property
    def grad_group(self) -> tuple[dist.ProcessGroup, int]:
        """The group that sums replicated parameters' gradients, and its size: data-parallel ranks,
        times context-parallel ones (which hold the same parameters and other tokens)."""
        if self.dp_cp_group is None:
            return self.group("dp"), self.layout.data
        return self.dp_cp_group, self.layout.data * self.layout.context

    def grad_mesh(self) -> torch.distributed.device_mesh.DeviceMesh:
        """The 1D DeviceMesh of :attr:`grad_group`, over which ZeRO-3 (FSDP2) shards parameters."""
        if self.dp_cp_group is None:
            return self.device_mesh["dp"]
        return device_mesh.DeviceMesh.from_group(
            self.dp_cp_group, self.device.type, mesh_dim_names=("dp_cp",)
        )

    def dp_level_groups(self, gpus_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """This rank's data-parallel peers on its node, and its peers at the same position on the other nodes.

        Collective the first time (every rank creates every group).
        """
        if gpus_per_node not in self.dp_levels:
            intra, inter = self.layout.dp_levels(gpus_per_node)
            hostnames: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(hostnames, socket.gethostname())
            local_world = os.environ.get("LOCAL_WORLD_SIZE")
            check_nodes(hostnames, int(local_world) if local_world else None, gpus_per_node, intra)
            intra_group, _ = dist.new_subgroups_by_enumeration(intra)
            inter_group, _ = dist.new_subgroups_by_enumeration(inter)
            # every rank is in one group of each list, so neither is None here
            self.dp_levels[gpus_per_node] = (
                cast(dist.ProcessGroup, intra_group),
                cast(dist.ProcessGroup, inter_group),
            )
        return self.dp_levels[gpus_per_node]


def check_nodes(
    hostnames: list[str], local_world_size: int | None, gpus_per_node: int, intra: list[list[int]]
) -> None:
    """Refuse a hierarchical all-reduce whose node groups (``rank // gpusPerNode``) are not the real hosts.

    ``hostnames[rank]`` is each rank's host.  All ranks on one host (a local
    run simulating nodes) are always correct; across hosts every host must
    run ``gpusPerNode`` ranks (``LOCAL_WORLD_SIZE``) and every intra-node
    group must sit on one host, or the "intra-node" stage would cross the network.
    """
    if len(set(hostnames)) == 1:
        return
    fix = "set resources.gpusPerNode to the GPUs (ranks) each pod runs, or use allReduce: flat"
    if local_world_size is not None and local_world_size != gpus_per_node:
        raise ValueError(
            f"parallelism.allReduce hierarchical: this host runs {local_world_size} ranks "
            f"(LOCAL_WORLD_SIZE) but resources.gpusPerNode is {gpus_per_node}: {fix}"
        )
    for group in intra:
        hosts = sorted({hostnames[rank] for rank in group})
        if len(hosts) > 1:
            raise ValueError(
                f"parallelism.allReduce hierarchical: the intra-node group {group} spans hosts "
                f"{hosts} (ranks must be placed gpusPerNode={gpus_per_node} consecutive ranks per "
                f"node): {fix}"
            )


def build_mesh(layout: layout_mod.ParallelLayout, device: torch.device) -> Mesh:
    """Create every group of the layout (collective: all ranks call it together)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise RuntimeError(
            f"WORLD_SIZE={world} but the layout {layout} needs {layout.world_size} processes"
        )
    context = layout.context > 1
    shape, names = (
        (layout.mesh_shape_4d, ("pp", "dp", "cp", "tp"))
        if context
        else (layout.mesh_shape, ("pp", "dp", "tp"))
    )
    mesh = device_mesh.init_device_mesh(device.type, shape, mesh_dim_names=names)
    coords = layout.coords(rank)
    got = tuple(mesh.get_local_rank(name) for name in names)
    want = tuple(getattr(coords, name) for name in names)
    if got != want:
        raise RuntimeError(
            f"DeviceMesh places rank {rank} at {got}, meshtrain.api.layout at {coords}"
        )
    backward_group, _ = dist.new_subgroups_by_enumeration(layout.all_groups("pp"))
    dp_cp_group = cp_backward_group = None
    if context:  # the dp x cp block of each (pp, tp): data and context are adjacent in the rank
        dp_cp_group, _ = dist.new_subgroups_by_enumeration(dp_cp_groups(layout))
        cp_backward_group, _ = dist.new_subgroups_by_enumeration(layout.all_groups("cp"))
    return Mesh(
        layout=layout,
        rank=rank,
        coords=coords,
        device_mesh=mesh,
        device=device,
        pp_backward_group=backward_group,
        dp_cp_group=dp_cp_group,
        cp_backward_group=cp_backward_group,
    )


def dp_cp_groups(layout: layout_mod.ParallelLayout) -> list[list[int]]:
    """Every group of ranks with the same (pp, tp): the data x context ranks that hold the same parameters."""
    return [
        [
            layout.rank_of(pp, dp, tp, cp)
            for dp in range(layout.data)
            for cp in range(layout.context)
        ]
        for pp in range(layout.pipeline)
        for tp in range(layout.tensor)
    ]
