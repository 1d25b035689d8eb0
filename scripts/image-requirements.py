#!/usr/bin/env python3
"""What the images install, layer by layer, from pyproject.toml and requirements.lock.

Usage:
  scripts/image-requirements.py extras PYPROJECT EXTRA[,EXTRA...]
      the requirements of the base install and the named extras, one a line, as pyproject writes
      them (duplicates dropped, references between extras such as ``meshtrain[hf]`` followed)
  scripts/image-requirements.py closure LOCK PACKAGE
      the lock's pins of PACKAGE and of everything it needs (the lock's ``# via`` graph)

Both Dockerfiles install in layers of their own, at the lock's pins, what these print: the
trainer first torch (constrained by its closure alone, so a lock change elsewhere keeps its
gigabytes cached), then its extras' requirements, and last meshtrain itself through the same
extras.  A code change rebuilds only the last layer, and the lists stay pyproject's and the lock's.
"""

from __future__ import annotations

import re
import sys
import tomllib
from typing import Any

SELF = re.compile(r"meshtrain\s*\[([^\]]*)\]\s*")
"""An extra that names other extras of meshtrain (``meshtrain[hf]``)."""
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==\S+")
"""A pinned line of the lock (``name==version``)."""
VIA = re.compile(r"#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)")
"""A ``# via NAME`` line of the lock, or one ``#   NAME`` of a ``# via`` list."""


def extras(project: dict[str, Any], names: list[str]) -> list[str]:
    """The base requirements and those of the extras ``names``; SystemExit for one pyproject lacks."""
    lists: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: dict[str, None] = dict.fromkeys(project.get("dependencies", []))
    todo, seen = list(names), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in lists:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(lists)})")
        for line in lists[extra]:
            nested = SELF.fullmatch(line)
            if nested:
                todo.extend(name.strip() for name in nested.group(1).split(","))
            else:
                found[line] = None
    return list(found)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(lock: str, package: str) -> list[str]:
    """The pinned lines of ``package`` and of every package it needs, in the lock's order."""
    pins: dict[str, str] = {}
    parents: dict[str, set[str]] = {}
    current = ""
    for line in lock.splitlines():
        pinned = PIN.match(line)
        if pinned:
            current = _canonical(pinned.group(1))
            pins[current] = line.strip()
            parents[current] = set()
        elif current and (via := VIA.search(line)):
            parents[current].add(_canonical(via.group(1)))
    wanted = {_canonical(package)}
    if not wanted <= pins.keys():
        raise SystemExit(f"the lock pins no {package!r}")
    grew = True
    while grew:
        needed = {name for name, of in parents.items() if of & wanted}
        grew = not needed <= wanted
        wanted |= needed
    return [line for name, line in pins.items() if name in wanted]


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("extras", "closure"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "extras":
        with open(argv[1], "rb") as toml:
            lines = extras(tomllib.load(toml)["project"], [e for e in argv[2].split(",") if e])
    else:
        with open(argv[1]) as lock:
            lines = closure(lock.read(), argv[2])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
