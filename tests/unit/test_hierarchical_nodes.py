"""A hierarchical all-reduce's node groups (``rank // gpusPerNode``) are checked against the real hosts.

Hostnames as ``dist.all_gather_object`` would give them at startup, for
layouts from :mod:`meshtrain.api.layout`: a placement whose consecutive ranks
are not on one host, or a host running another number of ranks than
``gpusPerNode``, is refused naming the field; one host (a local run) and a
matching placement pass.
"""

from __future__ import annotations

import pytest

from meshtrain.api import layout as layout_mod
from meshtrain.trainer.parallel import mesh

DP4 = layout_mod.ParallelLayout(pipeline=1, data=4, tensor=1)
INTRA = DP4.dp_levels(2)[0]


def test_matching_hosts_and_one_host_pass() -> None:
    mesh.check_nodes(["a", "a", "b", "b"], 2, 2, INTRA)
    mesh.check_nodes(["a"] * 4, 4, 2, INTRA)  # one host simulating two nodes


def test_ranks_interleaved_over_hosts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"spans hosts.*resources.gpusPerNode"):
        mesh.check_nodes(["a", "b", "a", "b"], 2, 2, INTRA)


def test_a_host_running_other_than_gpus_per_node_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE.*gpusPerNode is 2"):
        mesh.check_nodes(["a", "a", "b", "b"], 4, 2, INTRA)
