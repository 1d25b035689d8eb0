"""The cluster's shape as the placement algorithm sees it: fabric levels, domains, free pod slots.

The known fabric label families and their detection, the default level weights, each node's
*path* (its domain at every fabric level, then its NVLink domain) and the tree of domains with
free pod slots that :mod:`.algorithm` walks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable, Mapping, Sequence

from meshtrain.placement import values

FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "nvidia",
        (
            "network.topology.nvidia.com/block",
            "network.topology.nvidia.com/spine",
            "network.topology.nvidia.com/leaf",
        ),
    ),
    ("gke", ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock")),
    (
        "aws",
        (
            "topology.k8s.aws/network-node-layer-1",
            "topology.k8s.aws/network-node-layer-2",
            "topology.k8s.aws/network-node-layer-3",
        ),
    ),
)
"""Label families understood without configuration, each listed top level first
(AWS numbers its layers from the top: layer-1 is the highest)."""

LEVEL_WEIGHT_BASE = 4.0
"""Default weight of a fabric level: this base to the power of its height above the
NVLink domain (leaf crossing 4, spine 16, block 64): each level up is scarcer bandwidth."""

DOMAIN_WEIGHT = 1.0
"""Default weight of leaving an NVLink domain inside the lowest fabric domain."""


def detect_levels(nodes: Iterable[values.Node]) -> tuple[values.FabricLevel, ...]:
    """The label family most nodes carry, as preferred levels; () when none is present.

    Only the family's labels that some node carries become levels: a cluster
    labelled with blocks and leaves but no spines has two levels, not a spine
    level where every node would be a domain of its own.
    """
    nodes = list(nodes)
    counts = [
        sum(1 for node in nodes if not labels_set.isdisjoint(node.labels))
        for labels_set in _FAMILY_SETS
    ]
    best = max(range(len(FAMILIES)), key=lambda i: (counts[i], -i))
    if counts[best] == 0:
        return ()
    return tuple(
        values.FabricLevel(label=label)
        for label in FAMILIES[best][1]
        if any(label in node.labels for node in nodes)
    )


_FAMILY_SETS = tuple(frozenset(labels) for _, labels in FAMILIES)
"""Each family's labels as a set, for fast detection."""


def level_keys(
    levels: Sequence[values.FabricLevel], nvlink_domain_label: str | None
) -> tuple[str, ...]:
    """Keys of the places traffic can cross, most expensive first.

    The fabric level labels (top first), then the NVLink-domain label (or
    ``kubernetes.io/hostname``), then ``"nvlink"`` for pods inside one domain.
    """
    domain_key = nvlink_domain_label or values.HOSTNAME_LABEL
    return (*(level.label for level in levels), domain_key, values.NVLINK)


def weights(levels: Sequence[values.FabricLevel]) -> tuple[float, ...]:
    """Weight per level key, aligned with :func:`level_keys`."""
    height = len(levels)
    fabric = tuple(
        level.weight if level.weight is not None else LEVEL_WEIGHT_BASE ** (height - index)
        for index, level in enumerate(levels)
    )
    return (*fabric, DOMAIN_WEIGHT, 0.0)


def node_path(
    node: values.Node, levels: Sequence[values.FabricLevel], nvlink_domain_label: str | None
) -> tuple[str, ...]:
    """The node's domain value at each level, then its NVLink domain.

    Domains nest by path: two nodes share a leaf domain only if they also share
    the spine and block above it, so a leaf name reused under two spines names
    two leaves.  A missing label becomes ``<node-name>`` (label values cannot
    contain ``<``, so this never collides with a real domain): the node is a
    domain of its own at that level and below, far from everything.
    """
    values = [domain_of(node.name, node.labels, level.label) for level in levels]
    own = f"<{node.name}>"
    values.append(
        domain_of(node.name, node.labels, nvlink_domain_label) if nvlink_domain_label else own
    )
    return tuple(values)


def domain_of(name: str, labels: Mapping[str, str], label: str) -> str:
    """The domain of node ``name`` at ``label``: its value, or ``<name>`` where it has none (label
    values cannot hold ``<``, so the node is a domain of its own that meets no real one)."""
    return labels.get(label, f"<{name}>")


def paths(
    nodes: Iterable[values.Node],
    names: Container[str],
    levels: Sequence[values.FabricLevel],
    nvlink_domain_label: str | None,
) -> dict[str, tuple[str, ...]]:
    """Path of every node whose name is in ``names``."""
    return {
        node.name: node_path(node, levels, nvlink_domain_label)
        for node in nodes
        if node.name in names
    }


def crossing(path_a: Sequence[str], path_b: Sequence[str]) -> int:
    """Index into :func:`level_keys` of the highest level two paths differ at."""
    for index, (a, b) in enumerate(zip(path_a, path_b)):
        if a != b:
            return index
    return len(path_a)


class Domain:
    """A domain of the tree: the root, a fabric domain, an NVLink domain or a node.

    Mutable only while the tree is built; the planner reads it.
    """

    __slots__ = ("value", "depth", "children", "cap", "maxcap", "node")

    def __init__(
        self, value: str, depth: int, children: list[Domain], cap: int, node: str | None
    ) -> None:
        self.value = value
        """Domain value at its level (the node name for a node)."""
        self.depth = depth
        """0 for the root, level index + 1 for fabric levels, then NVLink domain, then node."""
        self.children = children
        """Sub-domains in label order."""
        self.cap = cap
        """Free pod slots inside."""
        self.node = node
        """Node name when this is a node, else None."""
        self.maxcap: list[int] = [cap]
        """Largest free pod slots of one sub-domain at each relative depth (0 = itself)."""
        if len(children) == 1:
            self.maxcap.extend(children[0].maxcap)
        elif children:
            self.maxcap.extend(map(max, *(child.maxcap for child in children)))

    def fit_depth(self, pods: int) -> int:
        """Deepest relative depth at which one sub-domain holds ``pods`` (-1 if none)."""
        for depth in range(len(self.maxcap) - 1, -1, -1):
            if self.maxcap[depth] >= pods:
                return depth
        return -1


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Eligible nodes arranged by their paths, with free pod slots."""

    root: Domain
    """Root of the domain tree (only nodes with at least one free slot)."""
    paths: Mapping[str, tuple[str, ...]]
    """Path of every eligible node, by name."""
    keys: tuple[str, ...]
    """Level keys, most expensive first (see :func:`level_keys`)."""
    weights: tuple[float, ...]
    """Weight per level key."""


def build(
    slots: Mapping[str, int],
    paths: Mapping[str, tuple[str, ...]],
    keys: tuple[str, ...],
    level_weights: tuple[float, ...],
    node_is_domain: bool,
) -> Fabric:
    """The domain tree of the nodes in ``slots`` (name -> free pod slots > 0).

    With ``node_is_domain`` (no NVLink-domain label) the node stands for its
    own NVLink domain: the tree has one level less and the same answers.
    """
    if node_is_domain:
        entries = sorted((paths[name][:-1], name, slots[name]) for name in slots)
    else:
        entries = sorted((paths[name], name, slots[name]) for name in slots)
    root = _subtree("", 0, entries)
    return Fabric(root=root, paths=dict(paths), keys=keys, weights=level_weights)


def _subtree(value: str, depth: int, entries: list[tuple[tuple[str, ...], str, int]]) -> Domain:
    """Domain at ``depth`` over sorted entries (path above the nodes, node name, slots)."""
    if depth == len(entries[0][0]):
        nodes = [Domain(name, depth + 1, [], cap, name) for _, name, cap in entries]
        return Domain(value, depth, nodes, sum(node.cap for node in nodes), None)
    children = []
    start = 0
    while start < len(entries):
        child_value = entries[start][0][depth]
        stop = start + 1
        while stop < len(entries) and entries[stop][0][depth] == child_value:
            stop += 1
        children.append(_subtree(child_value, depth + 1, entries[start:stop]))
        start = stop
    return Domain(value, depth, children, sum(child.cap for child in children), None)
