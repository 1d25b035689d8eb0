"""docs/install.md names the one version and keeps its tested blocks (run by tests/e2e/test_install_doc.py)."""

from __future__ import annotations

import re
import tomllib

from meshtrain.api import release
from tests import install_doc


def test_every_version_on_the_page_is_the_release_version() -> None:
    found = install_doc.VERSIONS.findall(install_doc.PAGE.read_text())
    assert found, "the page names no version of meshtrain"
    assert set(found) == {release.VERSION}, (
        f"docs/install.md names versions {sorted(set(found))}; meshtrain.api.release.VERSION is "
        f"{release.VERSION}: update the page"
    )


def test_the_tested_blocks_are_there_and_name_both_repositories() -> None:
    blocks = install_doc.blocks()
    assert list(blocks) == list(install_doc.ORDER)
    install = blocks["install"]
    assert "oci://$REGISTRY/charts/meshtrain" in install
    assert "image.repository=$REGISTRY/operator" in install
    assert "trainer.image.repository=$REGISTRY/trainer" in install


def test_the_sandbox_substitutions_are_the_documented_ones() -> None:
    blocks = install_doc.blocks()
    release_block = install_doc.for_sandbox(
        "release", blocks["release"], "10.201.7.1:5000/meshtrain"
    )
    assert "export REGISTRY=10.201.7.1:5000/meshtrain" in release_block
    assert "PLAIN_HTTP=1" in release_block
    assert "--plain-http --reuse-values" in install_doc.for_sandbox(
        "install", blocks["install"], "x"
    )


def _extras_table() -> dict[str, set[str]]:
    """The page's extras table: extra -> the names in backticks of its "adds" column."""
    text = install_doc.PAGE.read_text()
    table = text[text.index("| extra | adds | for |") :].split("\n\n", 1)[0]
    rows = [line.split("|") for line in table.splitlines()[2:]]
    return {row[1].strip().strip("`"): set(re.findall(r"`([^`]+)`", row[2])) for row in rows}


def test_the_extras_table_lists_every_requirement_of_every_extra() -> None:
    """The table against pyproject.toml: each extra's packages, and the extras it includes."""
    project = tomllib.loads((install_doc.REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    table = _extras_table()
    assert set(table) == set(extras), f"extras {sorted(extras)}, the table lists {sorted(table)}"
    for extra, requirements in extras.items():
        if extra == "all":
            continue
        wanted = set()
        for requirement in requirements:
            included = re.fullmatch(r"meshtrain\[([a-z,]+)\]", requirement)
            name = re.match(r"[A-Za-z0-9_.-]+", requirement)
            assert name is not None
            wanted |= set(included.group(1).split(",")) if included else {name.group(0)}
        assert table[extra] == wanted, (
            f"{extra}: the table lists {sorted(table[extra])}, pyproject.toml {sorted(wanted)}"
        )
