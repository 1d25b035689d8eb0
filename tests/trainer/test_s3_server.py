"""The test S3 server itself (tests/s3server.py), a real versitygw that serves ranged reads; and
the trainer's error for a store it cannot reach."""

from __future__ import annotations

import errno
from pathlib import Path

import botocore.exceptions
import pytest
import s3fs

from meshtrain.trainer import storage
from tests import s3server


def test_versitygw_serves_objects_and_byte_ranges(s3_server):
    url = s3_server.make_bucket("fixture-check")
    fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint)
    fs.pipe(f"{url}/a/b.bin", bytes(range(256)) * 4)
    assert fs.cat_file(f"{url}/a/b.bin", start=10, end=14) == bytes([10, 11, 12, 13])
    assert fs.info(f"{url}/a/b.bin")["size"] == 1024
    assert (s3_server.root / "fixture-check" / "a" / "b.bin").stat().st_size == 1024
    assert "s3_GetObject" in s3_server.operations()


def test_a_missing_binary_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    try:
        s3server.binary()
    except s3server.ServerMissingError as err:
        assert "scripts/bootstrap.sh" in str(err)
    else:
        raise AssertionError("no error for a missing binary")


def test_an_unreachable_store_is_said_with_the_url_and_the_fix(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    storage.filesystem.cache_clear()
    try:
        storage.size("s3://nowhere/key")
    except storage.ObjectStorageError as err:
        assert "s3://nowhere/key" in str(err) and "spec.objectStorage" in str(err)
    else:
        raise AssertionError("no error from an unreachable store")
    finally:
        storage.filesystem.cache_clear()


def test_the_fixture_and_the_bootstrap_pin_the_same_versitygw():
    script = (Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh").read_text()
    pin = f'VERSITYGW_VERSION="${{MESHTRAIN_VERSITYGW_VERSION:-{s3server.DEFAULT_VERSION}}}"'
    assert pin in script


def test_a_store_that_ignores_conditional_writes_is_refused(s3_server, monkeypatch):
    url = s3_server.make_bucket("no-conditions") + "/job/owner.json"
    fs = storage.filesystem()
    pipe = fs.pipe_file
    monkeypatch.setattr(storage, "_PROBED", set())
    monkeypatch.setattr(
        fs, "pipe_file", lambda path, data, mode="overwrite": pipe(path, data, mode="overwrite")
    )
    with pytest.raises(storage.ObjectStorageError, match="ignores conditional writes"):
        storage.write_bytes(url, b"{}", exclusive=True)
    assert storage.listing(url.rsplit("/", 1)[0]) == {}, "the probe is deleted"
    monkeypatch.setattr(fs, "pipe_file", pipe)
    monkeypatch.setattr(storage, "_PROBED", set())
    assert storage.write_bytes(url, b"{}", exclusive=True)
    assert not storage.write_bytes(url, b"{}", exclusive=True)


def test_any_412_on_an_exclusive_put_means_the_object_exists():
    refusal = botocore.exceptions.ClientError(
        {"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {"HTTPStatusCode": 412}},
        "PutObject",
    )
    err = OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold")
    err.__cause__ = refusal

    class Store:
        def pipe_file(self, path: str, data: bytes, mode: str) -> None:
            raise err

    assert storage._put(Store(), "s3://b/k", b"", True) is False
    with pytest.raises(OSError):
        storage._put(Store(), "s3://b/k", b"", False)


def test_a_failed_ranged_read_names_the_failing_object(s3_server):
    url = s3_server.make_bucket("ranges")
    storage.write_bytes(f"{url}/present", b"x" * 100)
    with pytest.raises(FileNotFoundError, match="absent"):
        storage.read_ranges([(f"{url}/present", 0, 10), (f"{url}/absent", 0, 10)])


def test_ranged_reads_past_their_deadline_are_said_with_the_url(s3_server, monkeypatch):
    url = s3_server.make_bucket("deadline") + "/slow"
    storage.write_bytes(url, b"x" * 100)
    monkeypatch.setattr(storage, "READ_DEADLINE_S", 1e-6)
    with pytest.raises(
        storage.ObjectStorageError, match=rf"{url}: 1 ranged reads got no full answer"
    ):
        storage.read_ranges([(url, 0, 10)])
