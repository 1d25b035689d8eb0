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
from pathlib import Path
from typing import Any

import s3fs

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
DEFAULT_ATTEMPTS = 5
"""Tries of one request (botocore's retries of throttling and connection errors); ``AWS_MAX_ATTEMPTS`` overrides."""
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
        "config_kwargs": {"s3": {"addressing_style": style}, "retries": {"max_attempts": attempts}},
        # Other processes (ranks, the next writer) change the bucket: never answer from an old listing.
        "use_listings_cache": False,
    }


@functools.cache
def filesystem() -> Any:
    """This process's s3fs client, from the environment (built once)."""
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
    paths = [_key(url) for url, _, _ in requests]
    starts = [start for _, start, _ in requests]
    ends = [end for _, _, end in requests]
    url = requests[0][0]
    found = _call(
        url,
        lambda fs: fs.cat_ranges(
            paths, starts, ends, batch_size=READ_CONCURRENCY, on_error="raise"
        ),
    )
    for (where, start, end), data in zip(requests, found):
        if len(data) != end - start:
            raise ObjectStorageError(
                f"{where}: read {len(data)} bytes at {start}, expected {end - start} "
                "(the object changed or was truncated while training)"
            )
    return [bytes(data) for data in found]


def glob(pattern: str) -> list[str]:
    """The objects a ``*``/``?``/``[]`` pattern matches, as sorted URLs (at most :data:`MAX_LISTED`)."""
    found = _call(pattern, lambda fs: fs.glob(_key(pattern), detail=True, maxdepth=None))
    files = sorted(_url(key) for key, info in found.items() if info.get("type") == "file")
    if len(files) > MAX_LISTED:
        raise ObjectStorageError(f"{pattern}: matches more than {MAX_LISTED} objects")
    return files


def listing(prefix: str) -> dict[str, dict[str, Any]]:
    """Every object below ``prefix`` (a directory-like URL): relative key -> {size, etag}."""
    root = _key(prefix).rstrip("/")
    found = _call(prefix, lambda fs: fs.find(root, detail=True, maxdepth=None))
    if len(found) > MAX_LISTED:
        raise ObjectStorageError(f"{prefix}: holds more than {MAX_LISTED} objects")
    return {
        key[len(root) + 1 :]: {"size": int(info["size"]), "etag": str(info.get("ETag", ""))}
        for key, info in found.items()
        if info.get("type") == "file" and key.startswith(root + "/")
    }


def write_bytes(url: str, data: bytes, *, exclusive: bool = False) -> bool:
    """Store ``data`` as object ``url`` (one PUT); ``exclusive``: only if there is none (False: there is).

    The exclusive PUT is conditional (``If-None-Match: *``, which AWS S3 and versitygw honour).
    """
    try:
        _call(
            url,
            lambda fs: fs.pipe_file(_key(url), data, mode="create" if exclusive else "overwrite"),
        )
    except FileExistsError:
        return False
    return True


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
    so a changed directory is copied again; ranks of one machine wait on a lock for the first.
    Refused above :func:`directory_limit` bytes or the free space of the cache's disk.
    """
    objects = {
        name: facts
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
    with (root / f"{digest}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            _copy_directory(url, objects, target, total)
    return target


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
        tmp.chmod(0o755)
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
