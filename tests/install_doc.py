"""docs/install.md's tested commands: the code blocks marked ``<!-- install-test: NAME -->``.

One reader for the unit test (versions on the page) and the e2e test (the blocks run against the
sandbox), so the page and the test cannot drift: the test runs what the page says, with only the
substitutions :func:`for_sandbox` names.
"""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "install.md"
ORDER = ("release", "install", "claim", "job")
"""The marked blocks, in the order a user runs them."""
_BLOCK = re.compile(r"<!-- install-test: ([a-z-]+) -->\n```sh\n(.*?)\n```", re.DOTALL)
VERSIONS = re.compile(r"(?:operator:|trainer:|--version |meshtrain-|version |\()(\d+\.\d+\.\d+)\b")
"""Where the page names meshtrain's own version (images' tags, the chart's version)."""
MAX_PAGE_BYTES = 200_000


def blocks(page: pathlib.Path = PAGE) -> dict[str, str]:
    """NAME -> the block's shell text; ValueError when a name repeats."""
    text = page.read_text()[:MAX_PAGE_BYTES]
    found: dict[str, str] = {}
    for name, body in _BLOCK.findall(text):
        if name in found:
            raise ValueError(f"{page}: two blocks are marked install-test: {name}")
        found[name] = body
    return found


def for_sandbox(name: str, body: str, registry_prefix: str) -> str:
    """The block as the e2e test runs it: the sandbox's registry (plain HTTP) and its release's values kept.

    ``REGISTRY`` is set to ``registry_prefix`` instead of the page's example; ``make release``
    gets ``PLAIN_HTTP=1`` and ``helm`` ``--plain-http --reuse-values`` (the sandbox's release
    already carries its own settings: CPU profile, Prometheus ingress).
    """
    body = re.sub(r"^export REGISTRY=\S+$", f"export REGISTRY={registry_prefix}", body, flags=re.M)
    body = body.replace(
        "make release REGISTRY=$REGISTRY", "make release REGISTRY=$REGISTRY PLAIN_HTTP=1"
    )
    body = body.replace(
        "helm upgrade --install", "helm upgrade --install --plain-http --reuse-values"
    )
    if name == "release" and f"export REGISTRY={registry_prefix}" not in body:
        raise ValueError("the release block must set REGISTRY (export REGISTRY=...)")
    return body
