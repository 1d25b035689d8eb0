"""Fixtures every tier may use: a real S3-compatible server (:mod:`tests.s3server`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import s3server


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
