"""Fail when two modules of the meshtrain packages share a file name.

A name like ``memory`` in two packages makes call sites (``memory.measure``)
ambiguous to a reader; docs/architecture.md, "Layers, and the checks that
hold them".  Package markers (``__init__``, ``__main__``) do not count.
"""

from __future__ import annotations

import collections
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    seen: dict[str, list[str]] = collections.defaultdict(list)
    for folder in sorted(set(folders["package-dir"].values())):
        for path in (REPO / folder).rglob("*.py"):
            if path.stem not in ("__init__", "__main__") and "__pycache__" not in path.parts:
                seen[path.name].append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    for name, paths in sorted(clashes.items()):
        print(f"module name {name} is used {len(paths)} times: {', '.join(sorted(paths))}")
    return 1 if clashes else 0


if __name__ == "__main__":
    sys.exit(main())
