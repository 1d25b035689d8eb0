"""The install's optional parts (pyproject's extras) and the message when a command needs one.

``pip install meshtrain`` is the light base (validate, plan, report, timeline); torch, kopf, the
Kubernetes clients and cryptography come with extras.  A command that needs an extra calls
:func:`require` before it imports anything of it, so a missing one reads as the line to run, not
as an ImportError traceback; the CLI exits with :data:`EXIT_CODE` then.
"""

from __future__ import annotations

import importlib.util

from meshtrain.cli import exitcodes

EXIT_CODE = exitcodes.MISSING_EXTRA
"""Exit status of a command whose extra is not installed (listed with every code in exitcodes)."""

PROBES: dict[str, tuple[str, ...]] = {
    "hf": ("tokenizers", "safetensors", "fsspec", "s3fs"),
    "trainer": (
        "torch",
        "torchao",
        "prometheus_client",
        "pynvml",
        "safetensors",
        "tokenizers",
        "fsspec",
        "s3fs",
    ),
    "operator": (
        "kopf",
        "kubernetes",
        "kubernetes_asyncio",
        "aiohttp",
        "prometheus_client",
        "celpy",
    ),
    "sandbox": ("cryptography",),
}
"""Import names of each extra's packages (tests/unit/test_packaging.py holds them to pyproject's)."""


class MissingExtra(Exception):
    """A command needs an extra that is not installed; the message says what to install."""


def missing(extra: str) -> str | None:
    """The first import name of ``extra`` that cannot be found (None: installed).

    Looks the modules up without importing them: the check costs no torch import.
    """
    for name in PROBES[extra]:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a blocked import, or a module stubbed out as None
            found = None
        if found is None:
            return name
    return None


def require(extra: str, command: str) -> None:
    """Raise :class:`MissingExtra` naming ``command`` and the install line unless ``extra`` is installed."""
    absent = missing(extra)
    if absent is not None:
        raise MissingExtra(
            f"{command} needs the {extra} extra: pip install 'meshtrain[{extra}]' "
            f"(no module named {absent!r})"
        )
