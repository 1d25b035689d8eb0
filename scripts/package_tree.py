"""Run a tool on the import package ``meshtrain`` laid out as one folder tree.

pyproject.toml maps ``operator/`` and ``trainer/`` into the ``meshtrain``
namespace (setuptools ``package-dir``).  Tools that find modules by walking
folders (mypy, import-linter) cannot follow that mapping, so this script
mirrors the mapping as a tree of symlinks under ``build/package-tree`` (one
per source file), runs the command there and prints its output with the
repository's own paths.

    python scripts/package_tree.py mypy -p meshtrain
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "build" / "package-tree"


def build_tree() -> dict[str, str]:
    """Mirror every package folder into TREE; returns tree path prefix -> repository path prefix."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders: dict[str, str] = config["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    # longest package first, so that a mapped subpackage replaces what its parent mirrored
    for package, folder in sorted(folders.items(), key=lambda item: -len(item[0])):
        source = REPO / folder
        target = TREE / package.replace(".", "/")
        for path in source.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            link = target / path.relative_to(source)
            if link.exists():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return {
        package.replace(".", "/") + "/": folder.rstrip("/") + "/"
        for package, folder in sorted(folders.items(), key=lambda item: -len(item[0]))
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    prefixes = build_tree()
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    done = subprocess.run(argv, cwd=TREE, env=env, capture_output=True, text=True)
    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        for line in text.splitlines(keepends=True):
            for tree_prefix, repo_prefix in prefixes.items():
                if line.startswith(tree_prefix):
                    line = repo_prefix + line[len(tree_prefix) :]
                    break
            stream.write(line)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
