"""Makes the packages named in $MESHTRAIN_BLOCKED_IMPORTS unimportable, as if not installed.

Put this folder first on PYTHONPATH: Python imports ``sitecustomize`` at startup, and the finder
below, first on ``sys.meta_path``, raises ModuleNotFoundError for those top-level names (and their
submodules) whether they are installed or not.  Every name a process tried is appended to the
file $MESHTRAIN_BLOCKED_REPORT (when set) at exit, so a test sees attempts that code caught.
"""

import atexit
import importlib.abc
import os
import sys

BLOCKED = frozenset(filter(None, os.environ.get("MESHTRAIN_BLOCKED_IMPORTS", "").split(",")))
TRIED: set[str] = set()


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in BLOCKED:
            TRIED.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def _report() -> None:
    target = os.environ.get("MESHTRAIN_BLOCKED_REPORT")
    if target and TRIED:
        with open(target, "a") as out:
            out.write("".join(f"{name}\n" for name in sorted(TRIED)))


sys.meta_path.insert(0, Blocker())
atexit.register(_report)
