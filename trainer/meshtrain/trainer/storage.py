"""Object storage for the trainer: ``s3://`` URLs through fsspec's s3fs, bounded.

The client is built from the environment alone (``AWS_ENDPOINT_URL``, ``AWS_REGION``, the keys,
``AWS_CA_BUNDLE`` and :data:`~meshtrain.api.spec.object_storage.ADDRESSING_ENV`): the operator
sets it from ``spec.objectStorage`` and its Secret, ``meshtrain run`` from the spec and the
user's environment. :class:`ObjectPath` gives an object the few ``pathlib.Path`` methods the
token-file code calls (``name``, ``with_name``, ``is_file``, ``read_text``, ``stat``), so that code
reads a bucket unchanged; :func:`read_ranges` reads byte ranges of many objects concurrently, and
:func:`local_directory` keeps a size-bounded local copy of a small directory (a Hugging Face model).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec.asyn

from meshtrain.api.spec import object_storage, urls

SMALL_OBJECT_BYTES = 64 * 1024 * 1024
"""Largest object read whole (metadata, config.json, tokenizer.json): anything larger is refused."""
DIRECTORY_LIMIT_ENV = "MESHTRAIN_S3_DIRECTORY_MAX_BYTES"
"""Overrides :data:`DIRECTORY_LIMIT_BYTES`."""
DIRECTORY_LIMIT_BYTES = 256 * 1024**3
"""Largest directory :func:`local_directory` copies (an 8B model in bf16 is 16 GB; 70B is 140 GB)."""
DIRECTORY_SUFFIXES = (".json", ".safetensors", ".model", ".txt")
"""Objects of a directory :func:`local_directory` copies: configs, tokenizers, weights (not
``*.bin``/``*.pth`` duplicates of the weights, nor sub-directories such as ``original/``)."""
MAX_LISTED = 100_000
"""Objects one listing may return; a larger prefix is refused."""
DEFAULT_ATTEMPTS = 3
"""Tries of one request (botocore's retries of throttling and connection errors); ``AWS_MAX_ATTEMPTS`` overrides."""
CONNECT_TIMEOUT_S = 10
"""Seconds to connect to the store before a try fails (botocore's default, 60, outlasts a collective's patience)."""
READ_TIMEOUT_S = 20
"""Seconds a started response may stall before a try fails: a stalled store fails a request within
about ``DEFAULT_ATTEMPTS * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S)`` = 90 s, below the 300 s process-group
timeout, and the error names the URL instead of showing up as an NCCL timeout."""
READ_DEADLINE_S = 120
"""Seconds one round of :func:`read_ranges` may take in all (a store that answers, slowly, forever)."""
PROBE_PREFIX = ".meshtrain-probe-"
"""Name prefix of the short-lived object that tests a bucket's conditional writes (:func:`write_bytes`)."""
READ_CONCURRENCY = 32
"""Ranged GETs in flight at once in :func:`read_ranges`."""


class ObjectStorageError(OSError):
    """An object cannot be read or written; the message names the URL and the fix."""


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is an ``s3://`` URL."""
    return path is not None and urls.is_url(str(path))


def options() -> dict[str, Any]:
    """s3fs's options from the environment (also what fsspec users such as torch DCP are given)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    style = os.environ.get(object_storage.ADDRESSING_ENV) or ("path" if endpoint else "auto")
    attempts = int(os.environ.get("AWS_MAX_ATTEMPTS") or DEFAULT_ATTEMPTS)
    return {
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": region} if region else {},
        "config_kwargs": {
            "s3": {"addressing_style": style},
            "retries": {"max_attempts": attempts, "mode": "standard"},
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
        },
        # Other processes (ranks, the next writer) change the bucket: never answer from an old listing.
        "use_listings_cache": False,
        # Every upload carries its SHA-256, which the store checks and keeps (:func:`head`).
        "s3_additional_kwargs": {"ChecksumAlgorithm": "SHA256"},
    }


@functools.cache
def filesystem() -> Any:
    """This process's s3fs client, from the environment (built once)."""
    import s3fs  # noqa: PLC0415 - aiobotocore's import costs every rank ~1 s of CPU; most read no bucket

    return s3fs.S3FileSystem(**options(), skip_instance_cache=True)


def _key(url: str) -> str:
    """``bucket/key`` of ``s3://bucket/key`` (what s3fs takes)."""
    return url[len(urls.SCHEME) :]


def _url(key: str) -> str:
    return urls.SCHEME + key


@dataclasses.dataclass(frozen=True)
class Stat:
    """The one field of ``os.stat_result`` the token-file code reads."""

    st_size: int
    """Object size in bytes."""


@dataclasses.dataclass(frozen=True, order=True)
class ObjectPath:
    """An object (or prefix) of a bucket, with the ``pathlib.Path`` methods token files use."""

    url: str
    """``s3://bucket/key``."""

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """Last segment of the key."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def with_name(self, name: str) -> ObjectPath:
        """The sibling object ``name``."""
        return ObjectPath(self.url.rstrip("/").rsplit("/", 1)[0] + "/" + name)

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.url.rstrip("/") + "/" + name)

    def expanduser(self) -> ObjectPath:
        """Itself (for code written for paths)."""
        return self

    def is_file(self) -> bool:
        """Whether the object exists."""
        return bool(_call(self.url, lambda fs: fs.isfile(_key(self.url))))

    def stat(self) -> Stat:
        """Its size."""
        return Stat(st_size=size(self.url))

    def read_bytes(self) -> bytes:
        """The whole object; refused above :data:`SMALL_OBJECT_BYTES`."""
        return read_small(self.url)

    def read_text(self) -> str:
        """The whole object as UTF-8 text; refused above :data:`SMALL_OBJECT_BYTES`."""
        return read_small(self.url).decode()


def _call(url: str, action: Any) -> Any:
    """``action(filesystem())``, with the store's errors said with the URL and the fix."""
    try:
        return action(filesystem())
    except (FileNotFoundError, FileExistsError, ObjectStorageError):
        raise
    except PermissionError as err:
        raise ObjectStorageError(
            f"{url}: access denied ({err}): check spec.objectStorage.credentialsSecret "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the bucket's policy"
        ) from None
    except Exception as err:  # noqa: BLE001 - botocore's own errors (connection, no credentials) are no OSError
        raise ObjectStorageError(
            f"{url}: the object store failed ({type(err).__name__}: {err}): check "
            "spec.objectStorage (endpoint, region, credentialsSecret) and that the store is reachable"
        ) from None


def size(url: str) -> int:
    """Size of one object in bytes (FileNotFoundError when there is none)."""
    info = _call(url, lambda fs: fs.info(_key(url)))
    if info.get("type") != "file":
        raise FileNotFoundError(f"{url}: not an object")
    return int(info["size"])


def head(url: str) -> dict[str, Any]:
    """One object's {size, etag, sha256, sha256_type}: the SHA-256 the store kept from the upload
    (base64; ``FULL_OBJECT``: of the whole object, ``COMPOSITE``: of its parts' checksums), or None."""
    bucket, _, key = _key(url).partition("/")
    out = _call(
        url, lambda fs: fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    )
    return {
        "size": int(out["ContentLength"]),
        "etag": str(out.get("ETag", "")),
        "sha256": out.get("ChecksumSHA256"),
        "sha256_type": out.get("ChecksumType") or "FULL_OBJECT",
    }


def read_small(url: str, limit: int = SMALL_OBJECT_BYTES) -> bytes:
    """A whole object of at most ``limit`` bytes."""
    length = size(url)
    if length > limit:
        raise ObjectStorageError(
            f"{url}: {length} bytes, more than the {limit} this small file may have"
        )
    return bytes(_call(url, lambda fs: fs.cat_file(_key(url))))


def read_ranges(requests: list[tuple[str, int, int]]) -> list[bytes]:
    """The bytes ``[start, end)`` of each (url, start, end), fetched concurrently; each must be whole."""
    if not requests:
        return []
    found = _call(_where(requests), lambda fs: _cat_ranges(fs, requests))
    failed = [
        (where, data)
        for (where, _, _), data in zip(requests, found)
        if isinstance(data, BaseException)
    ]
    if failed:
        where, error = failed[0]
        if isinstance(error, FileNotFoundError):
            raise FileNotFoundError(f"{where}: no such object ({error})") from None
        _call(where, lambda _: _raise(error))  # said with the failing request's URL
    for (where, start, end), data in zip(requests, found):
        if len(data) != end - start:
            raise ObjectStorageError(
                f"{where}: read {len(data)} bytes at {start}, expected {end - start} "
                "(the object changed or was truncated while training)"
            )
    return [bytes(data) for data in found]


def _cat_ranges(fs: Any, requests: list[tuple[str, int, int]]) -> list[Any]:
    """s3fs's concurrent ranged GETs (each result its bytes or its error), within :data:`READ_DEADLINE_S`."""
    try:
        return list(
            fsspec.asyn.sync(
                fs.loop,
                fs._cat_ranges,
                [_key(url) for url, _, _ in requests],
                [start for _, start, _ in requests],
                [end for _, _, end in requests],
                batch_size=READ_CONCURRENCY,
                on_error="return",
                timeout=READ_DEADLINE_S,
            )
        )
    except fsspec.asyn.FSTimeoutError:
        raise ObjectStorageError(
            f"{_where(requests)}: {len(requests)} ranged reads got no full answer within "
            f"{READ_DEADLINE_S} s: check that the store (spec.objectStorage.endpoint) is reachable "
            "and not overloaded"
        ) from None


def _where(requests: list[tuple[str, int, int]]) -> str:
    """The URL(s) a batch of reads touches, for an error that is not one request's."""
    names = sorted({url for url, _, _ in requests})
    return names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} other objects)"


def _raise(err: BaseException) -> None:
    raise err


def glob(pattern: str) -> list[str]:
    """The objects a ``*``/``?``/``[]`` pattern matches, as sorted URLs (at most :data:`MAX_LISTED`)."""
    found = _call(pattern, lambda fs: fs.glob(_key(pattern), detail=True, maxdepth=None))
    files = sorted(_url(key) for key, info in found.items() if info.get("type") == "file")
    if len(files) > MAX_LISTED:
        raise ObjectStorageError(f"{pattern}: matches more than {MAX_LISTED} objects")
    return files


def listing(prefix: str) -> dict[str, dict[str, Any]]:
    """Every object below ``prefix`` (a directory-like URL): relative key -> {size, etag, modified}.

    ``modified``: LastModified in seconds since the epoch (now, where the store gives none).
    """
    root = _key(prefix).rstrip("/")
    found = _call(prefix, lambda fs: fs.find(root, detail=True, maxdepth=None))
    if len(found) > MAX_LISTED:
        raise ObjectStorageError(f"{prefix}: holds more than {MAX_LISTED} objects")
    return {
        key[len(root) + 1 :]: {
            "size": int(info["size"]),
            "etag": str(info.get("ETag", "")),
            "modified": _seconds(info.get("LastModified")),
        }
        for key, info in found.items()
        if info.get("type") == "file" and key.startswith(root + "/")
    }


def _seconds(stamp: Any) -> float:
    return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else time.time()


def write_bytes(url: str, data: bytes, *, exclusive: bool = False) -> bool:
    """Store ``data`` as object ``url`` (one PUT); ``exclusive``: only if there is none (False: there is).

    The exclusive PUT is conditional (``If-None-Match: *``, which AWS S3 and versitygw honour); a
    store that ignores the condition is refused once per bucket (:func:`check_conditional_writes`).
    """
    if exclusive:
        check_conditional_writes(url)
    return bool(_call(url, lambda fs: _put(fs, url, data, exclusive)))


def _put(fs: Any, url: str, data: bytes, exclusive: bool) -> bool:
    try:
        fs.pipe_file(_key(url), data, mode="create" if exclusive else "overwrite")
    except FileExistsError:
        return False
    except OSError as err:
        if exclusive and _precondition_failed(err):
            return False  # any 412 on an If-None-Match PUT: the object exists
        raise
    return True


def _precondition_failed(err: OSError) -> bool:
    """Whether ``err`` is an HTTP 412 (s3fs maps one without a ``Condition`` field to EINVAL)."""
    response = getattr(err.__cause__, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return status == 412 or code in ("PreconditionFailed", "412")


def check_conditional_writes(url: str) -> None:
    """Refuse a bucket that ignores ``If-None-Match`` (checked once per bucket, next to ``url``)."""
    bucket = _key(url).split("/", 1)[0]
    if bucket not in _PROBED:
        _probe(bucket, url.rstrip("/").rsplit("/", 1)[0])
        _PROBED.add(bucket)


_PROBED: set[str] = set()
"""Buckets whose conditional writes this process has checked."""


def _probe(bucket: str, directory: str) -> None:
    """Two exclusive PUTs of one new key: the second must be refused."""
    probe = f"{directory}/{PROBE_PREFIX}{uuid.uuid4().hex[:16]}"
    try:
        first = _call(probe, lambda fs: _put(fs, probe, b"probe", True))
        second = _call(probe, lambda fs: _put(fs, probe, b"probe", True))
    finally:
        remove([probe])
    if not first:
        raise ObjectStorageError(
            f"{probe}: the store refused an exclusive PUT of a new key (If-None-Match: *); check "
            "that it supports conditional writes and that the credentials may write there"
        )
    if second:
        raise ObjectStorageError(
            f"s3://{bucket}: the store ignores conditional writes (If-None-Match: *), which "
            "meshtrain needs so that one writer owns a job's checkpoints and publishes a step: use "
            "a store that honours them (AWS S3, versitygw, MinIO, Ceph RGW 18+ and others)"
        )


def remove(urls_: list[str]) -> None:
    """Delete objects (missing ones are not an error)."""
    if urls_:
        keys = [_key(url) for url in urls_]
        _call(urls_[0], lambda fs: fs.rm(keys))


# --- a local copy of a small directory ---------------------------------------------------------


def directory_limit() -> int:
    """:data:`DIRECTORY_LIMIT_BYTES`, or :data:`DIRECTORY_LIMIT_ENV` when set."""
    return int(os.environ.get(DIRECTORY_LIMIT_ENV) or DIRECTORY_LIMIT_BYTES)


def cache_dir() -> Path:
    """Where local copies live: $MESHTRAIN_CACHE_DIR/object-storage (else ~/.cache/meshtrain/...)."""
    env = os.environ.get("MESHTRAIN_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "meshtrain") / "object-storage"


def local_path(path: str | os.PathLike[str], field: str) -> Path:
    """``path`` itself when local; for an ``s3://`` directory its local copy (:func:`local_directory`)."""
    return local_directory(str(path), field) if is_url(path) else Path(path)


@functools.cache
def local_directory(url: str, field: str) -> Path:
    """A local copy of the objects directly under ``url`` whose names end in :data:`DIRECTORY_SUFFIXES`.

    Made once per machine and contents: the copy's name hashes the listing (names, sizes, ETags),
    so a changed directory is copied again (and the older copy of the URL deleted); ranks of one
    machine wait on the cache-wide lock for the first.
    Refused above :func:`directory_limit` bytes or the free space of the cache's disk.
    """
    objects = {
        name: {"size": facts["size"], "etag": facts["etag"]}
        for name, facts in listing(url).items()
        if "/" not in name and name.endswith(DIRECTORY_SUFFIXES)
    }
    if not objects:
        raise ObjectStorageError(
            f"{field}: {url} holds no config, tokenizer or *.safetensors object"
        )
    total = sum(facts["size"] for facts in objects.values())
    limit = directory_limit()
    if total > limit:
        raise ObjectStorageError(
            f"{field}: {url} holds {total} bytes of model files, more than the {limit} a local copy "
            f"may take: raise {DIRECTORY_LIMIT_ENV} or use a smaller model"
        )
    digest = hashlib.sha256(json.dumps([url, objects], sort_keys=True).encode()).hexdigest()[:24]
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / digest
    with (root / ".lock").open("w") as lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # cache-wide: one copy at a time, the free space checked under it
        if not target.is_dir():
            _clean_cache(root, url, digest)
            _copy_directory(url, objects, target, total)
            (root / f"{digest}{SOURCE_SUFFIX}").write_text(url)
    return target


SOURCE_SUFFIX = ".source"
"""A copy's companion file naming the URL it copies (so an older copy of the URL can be found)."""


def _clean_cache(root: Path, url: str, keep: str) -> None:
    """Under the cache-wide lock: every ``.tmp-`` entry is a dead copy, other copies of ``url`` are stale."""
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(SOURCE_SUFFIX) and entry.name != f"{keep}{SOURCE_SUFFIX}":
            with entry.open() as handle:
                source = handle.read(4096)
            if source == url:
                shutil.rmtree(root / entry.name.removesuffix(SOURCE_SUFFIX), ignore_errors=True)
                entry.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask (from /proc, without changing it; 0o022 where unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _copy_directory(url: str, objects: dict[str, dict[str, Any]], target: Path, total: int) -> None:
    free = shutil.disk_usage(target.parent).free
    if total > free:
        raise ObjectStorageError(
            f"{url}: {total} bytes do not fit the {free} free at {target.parent}: free space or set "
            "MESHTRAIN_CACHE_DIR to a larger volume"
        )
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        base = url.rstrip("/")
        _call(
            url,
            lambda fs: fs.get(
                [_key(f"{base}/{n}") for n in objects], [str(tmp / n) for n in objects]
            ),
        )
        for name, facts in objects.items():
            if (tmp / name).stat().st_size != facts["size"]:
                raise ObjectStorageError(f"{base}/{name}: changed while it was copied; try again")
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0o700 would hide the copy from other users
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def configure(settings: object_storage.ObjectStorage | None) -> None:
    """Point this process and the ranks it starts at ``spec.objectStorage`` (endpoint, region, style).

    The credentials stay what the environment has (the pod's Secret variables, or the user's);
    so does ``AWS_CA_BUNDLE``, which the operator sets where it mounts the bundle.
    """
    if settings is None:
        return
    env = object_storage.client_environment(settings)
    env.pop("AWS_CA_BUNDLE", None)
    os.environ.update(env)
    filesystem.cache_clear()
