"""``checkpoint.inMemory`` on a real API server: its defaults, and its bounds enforced at apply time."""

from __future__ import annotations

import pytest
import yaml

from tests.builders import JobBuilder

pytestmark = pytest.mark.integration


def _apply(cluster, namespace: str, builder: JobBuilder):
    body = builder.manifest()
    return cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-o", "yaml", "-f", "-",
        stdin=yaml.safe_dump(body),
    )  # fmt: skip


def test_in_memory_checkpoints_default_off_with_a_peer(cluster, namespace):
    result = _apply(cluster, namespace, JobBuilder("mem", None))
    assert result.returncode == 0, result.stderr
    stored = yaml.safe_load(result.stdout)["spec"]["checkpoint"]["inMemory"]
    assert stored == {"intervalSteps": 0, "peer": True}


def test_in_memory_interval_is_kept_and_bounded(cluster, namespace):
    kept = _apply(
        cluster, namespace, JobBuilder("mem", None).checkpoint(inMemory={"intervalSteps": 5})
    )
    assert kept.returncode == 0, kept.stderr
    assert yaml.safe_load(kept.stdout)["spec"]["checkpoint"]["inMemory"]["intervalSteps"] == 5
    for value in (-1, 10**9):
        refused = _apply(
            cluster,
            namespace,
            JobBuilder("mem", None).checkpoint(inMemory={"intervalSteps": value}),
        )
        assert refused.returncode != 0
        assert "spec.checkpoint.inMemory.intervalSteps" in refused.stderr, refused.stderr
