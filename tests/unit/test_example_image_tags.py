"""No stale pins: examples and docs name meshtrain's images and chart at the one version or not at all.

A TrainingJob without ``spec.image`` runs the chart's trainer image, tagged with the chart's
appVersion (``meshtrain.api.release.VERSION``); an example or a doc that names a meshtrain
image with another tag sends users to an image of another release.
"""

from __future__ import annotations

import pathlib
import re

import yaml

from meshtrain.api import release

ROOT = pathlib.Path(__file__).resolve().parents[2]

MESHTRAIN_IMAGE = re.compile(r"\bmeshtrain/(operator|trainer):([0-9][\w.+-]*)")
"""A meshtrain image with a literal tag (a ``$VERSION`` placeholder is not one)."""
CHART_PIN = re.compile(
    r"\bmeshtrain-([0-9]+\.[0-9]+\.[0-9]+[\w.+-]*?)\.tgz\b"
    r"|--version[ =]([0-9]+\.[0-9]+\.[0-9]+[\w.+-]*)"
)
"""A chart archive or a ``helm --version`` with a literal version, which goes stale at the next bump."""


def _examples() -> list[pathlib.Path]:
    return sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def _docs() -> list[pathlib.Path]:
    return [
        *_examples(),
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "charts" / "meshtrain").glob("*.md")),
        ROOT / "operator" / "Dockerfile",
        ROOT / "trainer" / "Dockerfile",
    ]


CUDA_VARIANT = re.compile(r"-cu[0-9]+$")
"""The trainer image built for another CUDA major (``--build-arg CUDA=12``) carries ``-cu12``."""


def _stale(text: str) -> list[str]:
    images = [
        m.group(0)
        for m in MESHTRAIN_IMAGE.finditer(text)
        if CUDA_VARIANT.sub("", m.group(2)) != release.VERSION
    ]
    charts = [
        m.group(0)
        for m in CHART_PIN.finditer(text)
        if (m.group(1) or m.group(2)) != release.VERSION
    ]
    return images + charts


def test_the_pattern_finds_a_stale_pin_and_passes_the_version() -> None:
    assert _stale("image: ghcr.io/meshtrain/trainer:0.0.9") == ["meshtrain/trainer:0.0.9"]
    assert _stale(f"-t REGISTRY/meshtrain/operator:{release.VERSION} .") == []
    assert _stale('TRAINER_IMAGE="ghcr.io/meshtrain/trainer:$VERSION"') == []
    assert _stale("helm install m meshtrain-0.0.9.tgz") == ["meshtrain-0.0.9.tgz"]
    assert _stale("helm install m oci://r/charts/meshtrain --version 0.0.9 \\") == [
        "--version 0.0.9"
    ]
    assert _stale(f"tar xzf meshtrain-{release.VERSION}.tgz --version {release.VERSION}") == []
    assert _stale("helm show crds meshtrain-NEW.tgz") == []
    assert _stale(f"-t meshtrain/trainer:{release.VERSION}-cu12 .") == []
    assert _stale("-t meshtrain/trainer:0.0.9-cu12 .") == ["meshtrain/trainer:0.0.9-cu12"]


def test_no_example_or_doc_pins_a_meshtrain_image_of_another_release() -> None:
    stale = {
        str(path.relative_to(ROOT)): found
        for path in _docs()
        if path.exists() and (found := _stale(path.read_text()))
    }
    assert stale == {}, f"tag these {release.VERSION} or drop the tag/image: {stale}"


def test_an_example_image_if_any_is_tagged_with_the_version() -> None:
    """Any image, not only meshtrain's: an example names the trainer it was written for."""
    assert _examples()
    for path in _examples():
        for job in yaml.safe_load_all(path.read_text()):
            image = (job or {}).get("spec", {}).get("image")
            if image:
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                assert tag == release.VERSION, f"{path.name}: spec.image {image}: omit it or tag it"
