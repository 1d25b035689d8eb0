"""Object-storage URLs (``s3://bucket/key``), which several sections' paths accept.

Apart from :mod:`.object_storage` so that any section may tell a URL from a path (sections import
no other section).
"""

from __future__ import annotations

SCHEME = "s3://"
"""Prefix of an object-storage URL in the spec."""
PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\x00-\x1f\x7f]*)?$"
"""``s3://bucket[/key]``: an S3 bucket name (3-63 lower-case letters, digits, '.' and '-'), then a
key without control characters."""


def is_url(path: str | None) -> bool:
    """Whether a spec path is an object-storage URL (``s3://...``)."""
    return bool(path) and str(path).startswith(SCHEME)


PREFIX_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/\x00-\x1f\x7f]+)*/?$"
"""``s3://bucket[/prefix]`` of a directory-like prefix: as :data:`PATTERN`, without empty segments."""
