"""The string shapes Kubernetes itself requires, as pydantic types whose ``pattern`` and
``maxLength`` render into the CRD: a spec that would make the API server refuse every pod
is refused at ``kubectl apply`` instead, with the field's name.

The patterns are apimachinery's (``IsDNS1123Subdomain``, ``IsQualifiedName``,
``IsValidLabelValue``) written as regular expressions the API server (RE2), pydantic
(Rust ``regex``) and CEL all read alike.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

DNS_1123_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
"""One DNS label: lower-case letters, digits and '-', at most 63 characters."""

DNS_1123_SUBDOMAIN = rf"^{DNS_1123_LABEL}(\.{DNS_1123_LABEL})*$"
"""An object name (PersistentVolumeClaim, Secret): dot-separated DNS labels, at most 253 characters."""

QUALIFIED_NAME = (
    rf"^({DNS_1123_LABEL}(\.{DNS_1123_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)
"""A label or annotation key, or an extended resource name: an optional DNS prefix and '/',
then a name of at most 63 letters, digits, '-', '_' and '.' that starts and ends alphanumeric."""

QUALIFIED_NAME_MAX_LENGTH = 253 + 1 + 63
"""A DNS prefix, the slash and the name."""

LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
"""A label value: empty, or at most 63 letters, digits, '-', '_' and '.' starting and ending alphanumeric."""

IMAGE_REFERENCE = r"^([A-Za-z0-9][A-Za-z0-9._/:@-]*)?$"
"""A container image reference (``registry:5000/team/trainer:v1``, ``...@sha256:...``): no spaces,
shell characters or control characters; empty means the cluster's default trainer image."""

ClaimName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN)]
LabelKey = Annotated[
    str, Field(min_length=1, max_length=QUALIFIED_NAME_MAX_LENGTH, pattern=QUALIFIED_NAME)
]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]


def is_qualified_name(key: str) -> bool:
    """What ``IsQualifiedName`` accepts (a label key, annotation key or resource name)."""
    prefix, _, name = key.rpartition("/")
    return (
        len(prefix) <= 253
        and len(name) <= 63
        and re.fullmatch(QUALIFIED_NAME.strip("^$"), key) is not None
    )


def is_node_name(name: object) -> bool:
    """Whether ``name`` can be a Node's (``IsDNS1123Subdomain``: at most 253 characters).  A
    longer or malformed one is no node's: callers drop it, never cut it."""
    return (
        isinstance(name, str)
        and len(name) <= 253
        and re.fullmatch(DNS_1123_SUBDOMAIN.strip("^$"), name) is not None
    )


def cel_all_keys_qualified(field: str) -> str:
    """CEL: every key of the map at ``field`` (over the whole spec) is a qualified name."""
    return f"{field}.all(k, k.matches(r'{QUALIFIED_NAME}'))"


PATTERN_HINTS = {
    DNS_1123_SUBDOMAIN: "use a Kubernetes object name: lower-case letters, digits, '-' and '.', "
    "starting and ending with a letter or digit, e.g. train-data",
    QUALIFIED_NAME: "use a Kubernetes qualified name: an optional DNS prefix and '/', then letters, "
    "digits, '-', '_' or '.', e.g. example.com/rack",
    LABEL_VALUE: "use a label value: at most 63 letters, digits, '-', '_' or '.', starting and "
    "ending with a letter or digit",
    IMAGE_REFERENCE: "use an image reference such as registry.example.com/team/trainer:v1 "
    "(no spaces or shell characters)",
}
"""The fix for a string that does not match a pattern above, in words."""
