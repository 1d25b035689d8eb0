"""Every link and repository path the README and docs/*.md name exists.

A relative markdown link must reach a file of the checkout (and its ``#anchor`` a heading of that
page, as GitHub spells anchors); a path in backticks that starts at a top-level folder of the
repository (``trainer/Dockerfile``, ``benchmarks/results/x.json``) or is a root file must exist;
one with ``*`` must match something.  Placeholders (``<name>``, ``{a,b}``, ``$VAR``, ``...``) are
not paths and are left alone.  A chart version (``--version X.Y.Z``) or image tag
(``meshtrain/trainer:X.Y.Z``) a page names is the release's, ``meshtrain.api.release.VERSION``.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from meshtrain.api import release

ROOT = pathlib.Path(__file__).parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
# The folders and root files a repository path in a page starts with.
TOP = (
    "meshtrain/",
    "operator/",
    "trainer/",
    "sandbox/",
    "charts/",
    "manifests/",
    "dashboards/",
    "tests/",
    "benchmarks/",
    "docs/",
    "scripts/",
    ".ci/",
)
ROOT_FILES = {
    "Makefile",
    "pyproject.toml",
    "requirements.lock",
    "requirements-cu12.lock",
    "requirements-cu12.in",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# A section naming old paths on purpose: from its heading to the next heading as high or higher.
HISTORY = re.compile(r"^(#+) Map from old paths.*?(?=^#{1,2} |\Z)", re.M | re.S)
# A chart version or an image tag of ours, as a user would copy it.
PINNED = re.compile(
    r"--version[ =]v?(\d+\.\d+\.\d+)|meshtrain/(?:operator|trainer):v?(\d+\.\d+\.\d+)"
)
# Issue #37's registry part rewrites install.md's image tags; drop it from here once that lands.
NOT_YET_PINNED = {"docs/install.md"}
PLACEHOLDER = re.compile(r"[<>{}$]|\.\.\.|…")


def _name(page: pathlib.Path) -> str:
    """A page as the repository names it (a page outside it by its whole path)."""
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces to dashes)."""
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = sum(1 for a in found if a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a))
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def link_problems(page: pathlib.Path) -> list[str]:
    """Relative links of a page whose file or anchor is missing."""
    problems = []
    for match in LINK.finditer(FENCE.sub("", page.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, oci:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            problems.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            problems.append(f"{target}: no heading #{anchor} in {_name(where)}")
    return problems


def repository_paths(text: str) -> set[str]:
    """What a page names in backticks (inline or in code blocks) that reads as a repository path."""
    words = [w for span in INLINE.findall(FENCE.sub("", text)) for w in span.split()]
    # In code blocks only files: a tree's folders (`meshtrain/operator/` under `operator/`) are relative.
    block_words = [w for block in FENCE.finditer(text) for w in block.group(0).split()]
    paths = set()
    for word, in_block in [(w, False) for w in words] + [(w, True) for w in block_words]:
        word = word.strip("\"'(),;:`").split("::")[0]
        word = re.sub(r":\d+(-\d+)?$", "", word)
        if PLACEHOLDER.search(word) or (in_block and not re.search(r"\.[a-z]+$", word)):
            continue
        if word in ROOT_FILES or (word.startswith(TOP) and "/" in word):
            paths.add(word)
    return paths


def current(text: str) -> str:
    """A page without its sections on the past (architecture.md's map from old paths to new)."""
    return HISTORY.sub("", text)


def path_problems(page: pathlib.Path) -> list[str]:
    """Repository paths a page names that the checkout does not have."""
    problems = []
    for path in sorted(repository_paths(current(page.read_text()))):
        if "*" in path:
            if not any(ROOT.glob(path)):
                problems.append(f"{path}: matches nothing")
        elif not (ROOT / path).exists():
            problems.append(f"{path}: no such file or folder")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert page.exists(), f"{_name(page)} is missing"
    assert not link_problems(page), f"{_name(page)}: {link_problems(page)}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_repository_path_in_backticks_exists(page):
    assert not path_problems(page), f"{_name(page)}: {path_problems(page)}"


def pinned_versions(text: str) -> set[str]:
    """The chart versions and image tags of ours a page names."""
    return {a or b for a, b in PINNED.findall(text)}


@pytest.mark.parametrize("page", [p for p in PAGES if _name(p) not in NOT_YET_PINNED], ids=_name)
def test_every_named_version_is_the_release(page):
    stale = pinned_versions(page.read_text()) - {release.VERSION}
    assert not stale, (
        f"{_name(page)} names {sorted(stale)}; the release is {release.VERSION} "
        "(meshtrain.api.release.VERSION)"
    )


def test_the_checks_fail_on_a_missing_file_anchor_and_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](nowhere.md) [bad](#no-such)\n"
        "`docs/no-such-page.md` `benchmarks/results/none-*.json` `benchmarks/results/<name>.json`\n"
    )
    assert link_problems(page) == [
        "nowhere.md: no such file",
        f"#no-such: no heading #no-such in {page}",
    ]
    assert repository_paths(page.read_text()) == {
        "docs/no-such-page.md",
        "benchmarks/results/none-*.json",
    }
    assert len(path_problems(page)) == 2
    assert pinned_versions("helm install x --version 0.1.0; ghcr.io/meshtrain/trainer:9.9.9") == {
        "0.1.0",
        "9.9.9",
    }
