"""Cluster description files: the nodes ``meshtrain plan --cluster`` places a job on.

A small YAML format (``nodes:``, a list of nodes with a name, a GPU count and labels; a bare list
works too; docs/planner.md shows it) read into placement :class:`~meshtrain.placement.Node` values,
with errors that name the file, the entry and the line.  A live cluster is read by
:mod:`meshtrain.cli.cluster_nodes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshtrain import placement

NODE_KEYS = ("name", "gpus", "labels", "unschedulable")
"""Keys a node entry may have."""


class ClusterError(ValueError):
    """A cluster file that cannot be used; the message says where and why."""


def _line(node: yaml.Node | None) -> str:
    return f"line {node.start_mark.line + 1}" if node is not None else "unknown line"


def _entry_nodes(root: yaml.Node | None) -> list[yaml.Node] | None:
    """The YAML nodes of the entries (for line numbers), or None when the layout is wrong."""
    if isinstance(root, yaml.SequenceNode):
        return list(root.value)
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if (
                isinstance(key, yaml.ScalarNode)
                and key.value == "nodes"
                and isinstance(value, yaml.SequenceNode)
            ):
                return list(value.value)
    return None


def _value_line(entry: yaml.Node, key: str) -> yaml.Node:
    if isinstance(entry, yaml.MappingNode):
        for k, v in entry.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return v
    return entry


def parse_text(text: str, source: str = "cluster") -> list[placement.Node]:
    """Nodes of a cluster YAML document; raises :class:`ClusterError` naming the entry and line."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ClusterError(f"{source}: not valid YAML: {err}") from None
    entries: Any = data.get("nodes") if isinstance(data, dict) else data
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"nodes"})
        if unknown:
            raise ClusterError(
                f"{source}: unknown top-level key(s) {', '.join(map(str, unknown))}; expected 'nodes'"
            )
    if not isinstance(entries, list) or not entries:
        raise ClusterError(
            f"{source}: expected a non-empty list of nodes (a top-level list, or under 'nodes:')"
        )
    yaml_entries = _entry_nodes(root) or [None] * len(entries)
    nodes: list[placement.Node] = []
    seen: dict[str, int] = {}
    for index, (entry, ynode) in enumerate(zip(entries, yaml_entries)):
        where = f"{source}: nodes[{index}] ({_line(ynode)})"
        if not isinstance(entry, dict):
            raise ClusterError(
                f"{where}: expected a mapping with name, gpus, labels; got {entry!r}"
            )
        unknown = sorted(set(map(str, entry)) - set(NODE_KEYS))
        if unknown:
            raise ClusterError(
                f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(NODE_KEYS)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        where = f"{source}: nodes[{index}] {name!r} ({_line(ynode)})"
        if name in seen:
            raise ClusterError(f"{where}: duplicate node name (first at nodes[{seen[name]}])")
        seen[name] = index
        gpus = entry.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            line = _line(_value_line(ynode, "gpus")) if ynode is not None else "unknown line"
            raise ClusterError(
                f"{source}: nodes[{index}] {name!r} ({line}): 'gpus' must be an integer >= 0, got {gpus!r}"
            )
        labels = entry.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(k, str) for k in labels):
            raise ClusterError(
                f"{where}: 'labels' must be a mapping of label name to value, got {labels!r}"
            )
        bad = [k for k, v in labels.items() if isinstance(v, (dict, list)) or v is None]
        if bad:
            raise ClusterError(
                f"{where}: label {bad[0]!r} must have a scalar value, got {labels[bad[0]]!r}"
            )
        unschedulable = entry.get("unschedulable", False)
        if not isinstance(unschedulable, bool):
            raise ClusterError(
                f"{where}: 'unschedulable' must be true or false, got {unschedulable!r}"
            )
        nodes.append(
            placement.Node(
                name=name,
                allocatable_gpus=gpus,
                labels={k: str(v) for k, v in labels.items()},
                unschedulable=unschedulable,
            )
        )
    return nodes


def load(path: str | Path) -> list[placement.Node]:
    """Read a cluster YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ClusterError(f"{path}: cannot read cluster file: {err.strerror or err}") from None
    return parse_text(text, str(path))
