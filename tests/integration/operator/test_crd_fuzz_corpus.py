"""The fuzz corpus through ``kubectl apply`` against the real API server (issue #32 item 8;
integration tier, ``make test``): every file is refused, as ``meshtrain validate`` refuses it
(tests/unit/test_loading_fuzz_corpus.py), within 2 s, and kubectl's error names the field
validate names, so the verdicts are the same.  Where kubectl cannot name that field (a file
its own YAML reader refuses, duplicate keys it collapses silently, ...), the corpus index
says so per file (``make_corpus.KUBECTL``) and the test holds kubectl to what it says then.
The base job every file changes one thing of is accepted, so no refusal comes from the base;
the valid jobs at the bounds are accepted, so the CRD's bounds are the model's, neither looser
nor tighter.

Server-side dry runs: the CRD's schema and CEL rules judge, nothing is stored.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from meshtrain.api import loading
from tests import fuzz_corpus
from tests.data.fuzz import make_corpus

pytestmark = pytest.mark.integration

DEADLINE_SECONDS = 2.0
"""The issue's deadline for a refusal."""
MARGIN = 2.5
"""Slack on the deadline for a shared 2-core machine: a whole kubectl run (process start,
discovery, the request) is timed, not the API server alone."""


def _apply(cluster, *args: str, stdin: str | None = None):
    """``kubectl apply`` as a server-side dry run in ``default``: nothing is stored."""
    return cluster.kubectl("apply", "--dry-run=server", "-n", "default", *args, stdin=stdin)


def _crd_field(path: str) -> re.Pattern[str]:
    """validate's field path as the API server prints it, as a whole field in its error.

    Both print the CRD's camelCase path (``spec.pod.env[0].name``); validate quotes a key
    longer than it quotes whole (``spec.'kkkk...' (5002 characters)``), so such a key's
    quoted start must begin the server's field.  The field ends where the server's does
    (``:``, a quote, a space or the end), so ``spec`` is not found in ``spec.image``.
    """
    head, quote, key = path.partition("'")
    end = "" if quote else r"(?=[:\"\s]|$)"
    return re.compile(r"(?:^|[\s\"*.])" + re.escape(head + key) + end)


@pytest.fixture(scope="module")
def refusals(cluster) -> dict[str, tuple[float, str, str]]:
    """(seconds, stderr, stdout) of the refusing ``kubectl apply`` of every corpus file."""
    base = _apply(cluster, "-f", "-", stdin=json.dumps(make_corpus.BASE))
    assert base.returncode == 0, base.stderr  # the base job is accepted (and warms kubectl)
    found = {}
    for name in fuzz_corpus.INDEX:
        started = time.monotonic()
        result = _apply(cluster, "-f", str(fuzz_corpus.CASES / name))
        seconds = time.monotonic() - started
        assert result.returncode != 0, (name, result.stdout)
        found[name] = (seconds, result.stderr, result.stdout)
    return found


def test_kubectl_apply_refuses_the_whole_corpus(refusals):
    assert len(refusals) >= 100


@pytest.mark.parametrize("name", list(fuzz_corpus.INDEX))
def test_kubectl_refuses_it_within_2_s_naming_validates_field(refusals, name):
    with pytest.raises(loading.SpecError) as refused:
        loading.load_manifest(fuzz_corpus.CASES / name)
    case = fuzz_corpus.INDEX[name]
    assert case["names"] in str(refused.value)  # validate's verdict, as the unit tier holds it
    seconds, stderr, _ = refusals[name]
    assert seconds < DEADLINE_SECONDS * MARGIN, seconds
    assert "Traceback" not in stderr and "panic" not in stderr, stderr
    if "kubectl" in case:  # the index says why kubectl cannot name the field, and what it says
        assert case["kubectl"]["why"]
        assert case["kubectl"]["says"] in stderr, stderr
    else:
        assert _crd_field(case["names"]).search(stderr), (case["names"], stderr)


@pytest.mark.parametrize("name", list(fuzz_corpus.VALID_AT_BOUNDS))
def test_the_api_server_accepts_a_job_at_the_bounds(cluster, name):
    manifest = fuzz_corpus.VALID_AT_BOUNDS[name]
    loading.parse_manifest(manifest)  # meshtrain validate's verdict
    result = _apply(cluster, "-f", "-", stdin=json.dumps(manifest))
    assert result.returncode == 0, result.stderr
