"""Fixtures every tier may use: a real S3-compatible server (:mod:`tests.s3server`).

Also how ``make test`` spreads the suite over pytest-xdist's workers (``-n 2 --dist loadfile``):
each test file is run whole by one worker, so a module-scoped fixture (a trainer run several
tests read, a Kueue cluster) still runs once; files that share a costly session fixture
(:data:`SHARED_RUNS`) go to one worker together, so that run is not repeated on the other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import xdist.scheduler

from tests import s3server

SHARED_RUNS = {
    "tests/telemetry/test_prometheus.py": "scraped_run",
    "tests/telemetry/test_timeline_run.py": "scraped_run",
}
"""Test files that share a costly session fixture (``scraped_run``: a training run Prometheus
scrapes, ~40 s), each with the fixture's name: one xdist worker runs them all, so it runs once."""


class SharedRunScheduling(xdist.scheduler.LoadFileScheduling):
    """``--dist loadfile`` with the files of :data:`SHARED_RUNS` as one unit.

    pytest-xdist's ``xdist_group`` marks do not reach its scheduler under pytest 9 (xdist rewrites
    ``item._nodeid``, which pytest 9 no longer reads), hence this scheduler of our own.
    """

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return SHARED_RUNS.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """:class:`SharedRunScheduling` for ``--dist loadfile`` (``make test``); other modes as xdist has them."""
    return SharedRunScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.S3Server]:
    """versitygw on a free loopback port with a temporary root, stopped at the end of the session.

    A missing binary fails the test with the command that builds it. The server's environment
    (endpoint, keys, region) is set in this process for the session, so s3fs clients and the
    trainer processes a test starts reach it.
    """
    try:
        server = s3server.start(tmp_path_factory.mktemp("s3"))
    except s3server.ServerMissingError as err:
        pytest.fail(str(err))
    saved = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
