"""The fuzz corpus through ``kubectl apply`` against the real API server (issue #32 item 8;
integration tier, ``make test``): every file kubectl can read is refused, as ``meshtrain
validate`` refuses it (tests/unit/test_loading_fuzz_corpus.py), and the valid jobs at the
bounds are accepted, so the CRD's bounds are the model's, neither looser nor tighter.

Server-side dry runs: the CRD's schema and CEL rules judge, nothing is stored.
"""

from __future__ import annotations

import json

import pytest

from meshtrain.api import loading
from tests import fuzz_corpus

pytestmark = pytest.mark.integration

READABLE = [name for name, case in fuzz_corpus.INDEX.items() if case["yaml"]]
"""Corpus files that are YAML text (binary and non-UTF-8 files kubectl cannot read at all)."""


def _apply(cluster, namespace: str, *args: str, stdin: str | None = None):
    return cluster.kubectl("apply", "--dry-run=server", "-n", namespace, *args, stdin=stdin)


def test_kubectl_apply_refuses_every_readable_file_validate_refuses(cluster, namespace):
    accepted = {}
    for name in READABLE:
        path = fuzz_corpus.CASES / name
        with pytest.raises(loading.SpecError):
            loading.load_manifest(path)
        result = _apply(cluster, namespace, "-f", str(path))
        if result.returncode == 0:
            accepted[name] = result.stdout
    assert not accepted, sorted(accepted)
    assert len(READABLE) >= 100


@pytest.mark.parametrize("name", list(fuzz_corpus.VALID_AT_BOUNDS))
def test_the_api_server_accepts_a_job_at_the_bounds(cluster, namespace, name):
    manifest = fuzz_corpus.VALID_AT_BOUNDS[name]
    loading.parse_manifest(manifest)  # meshtrain validate's verdict
    result = _apply(cluster, namespace, "-f", "-", stdin=json.dumps(manifest))
    assert result.returncode == 0, result.stderr
