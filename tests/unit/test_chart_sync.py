"""The chart's embedded copies (CRD, dashboards, rules) are identical to their sources.

helm cannot read files outside the chart, so scripts/chart-sync.sh (make
chart-sync) copies them in; this test fails when someone forgot to run it.
"""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"


def _pairs() -> list[tuple[pathlib.Path, pathlib.Path]]:
    pairs = [
        (src, CHART / "crds" / src.name)
        for src in sorted((ROOT / "manifests" / "crd").glob("*.yaml"))
    ]
    pairs += [
        (src, CHART / "files" / "dashboards" / src.name)
        for src in sorted((ROOT / "dashboards").glob("*.json"))
    ]
    if (ROOT / "dashboards" / "rules.yaml").exists():
        pairs.append((ROOT / "dashboards" / "rules.yaml", CHART / "files" / "rules.yaml"))
    return pairs


def test_the_crd_is_embedded() -> None:
    assert (CHART / "crds" / "trainingjobs.meshtrain.io.yaml").is_file()


def test_copies_are_identical_to_their_sources() -> None:
    stale = [
        str(copy.relative_to(ROOT))
        for src, copy in _pairs()
        if not copy.is_file() or copy.read_bytes() != src.read_bytes()
    ]
    assert not stale, f"run `make chart-sync` (scripts/chart-sync.sh): stale copies {stale}"


def test_no_copy_without_a_source() -> None:
    sources = {src.name for src in (ROOT / "dashboards").glob("*.json")}
    orphans = [
        p.name for p in (CHART / "files" / "dashboards").glob("*.json") if p.name not in sources
    ]
    assert not orphans


def test_sync_script_check_mode_agrees() -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "chart-sync.sh"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
