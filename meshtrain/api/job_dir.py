"""A job's own checkpoint directory on a shared root, and the owner record that guards it.

One layout for a local path, a claim and a bucket: ``<checkpoint.path>/<namespace>/<name>/`` holds
the job's ``step-*``, its in-progress ``.tmp-*``, its ``logs`` and :data:`OWNER_FILE`.  Pure: paths
are strings joined with ``/`` (a directory and an object-store prefix alike); reading and writing
the record is the caller's (docs/checkpoints.md, "Jobs sharing a volume").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

NAMESPACE_ENV = "MESHTRAIN_NAMESPACE"
NAME_ENV = "MESHTRAIN_JOB_NAME"
UID_ENV = "MESHTRAIN_JOB_UID"
"""The job's ``metadata.uid`` (the operator sets it; ``meshtrain run`` makes one per run)."""
ATTEMPT_ENV = "MESHTRAIN_ATTEMPT"
LOCAL_NAMESPACE = "local"
"""Namespace of a ``meshtrain run`` whose manifest names none."""
OWNER_FILE = "OWNER.json"
LOG_SUBDIR = "logs"
"""The job's step log and rank traces, beside its checkpoints (``MESHTRAIN_LOG_DIR`` in pods)."""
HEARTBEAT_SECONDS = 10.0
"""How often the writer refreshes its heartbeat, whatever the save interval (a thread, not a step)."""
STALE_SECONDS = 60.0
"""A heartbeat older than this (six missed beats) is a writer that is gone; node clocks must agree
far better than this (NTP)."""
RECORD_LIMIT = 4096
"""Most bytes of an owner record read; a larger one is refused, not parsed."""
SEGMENT = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
"""A namespace or job name as Kubernetes allows them (DNS-1123 subdomain): never ``..`` nor ``/``."""


class OwnerError(ValueError):
    """A job identity or owner record that cannot be used; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    """Which job a trainer runs for."""

    namespace: str
    """metadata.namespace (``local`` for a ``meshtrain run`` manifest without one)."""
    name: str
    """metadata.name."""
    uid: str
    """metadata.uid: a re-created job of the same name has another."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """The owner record of a job directory: who writes there now, and when it last said so."""

    namespace: str
    """The job's namespace."""
    name: str
    """The job's name."""
    uid: str
    """The job's UID."""
    writer: str
    """This attempt's writer: unique per gang attempt (``<uid>/<attempt>/<random>``)."""
    host: str
    """Host name of the writing process (a pod's name in a cluster)."""
    pid: int
    """Process id of the writer on ``host``: a local run finds a dead one at once."""
    heartbeat: float
    """Unix time of the writer's last heartbeat."""
    released: bool = False
    """The writer exited cleanly and gave the directory up."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a starting writer may do with a job directory."""

    action: Literal["claim", "refuse"]
    """``claim``: write the record and resume from the directory; ``refuse``: exit, the directory is held."""
    message: str
    """What to tell the user (a refusal's reason, or whose checkpoints are resumed)."""
    previous_uid: str | None = None
    """UID of the earlier job of the same name whose checkpoints are resumed (None: same job or none)."""


def identity_from_env(env: Mapping[str, str]) -> JobIdentity | None:
    """The job the environment names; None when it names none (a bare trainer keeps its directory as given)."""
    namespace, name = env.get(NAMESPACE_ENV, ""), env.get(NAME_ENV, "")
    if not namespace and not name:
        return None
    for variable, value in ((NAMESPACE_ENV, namespace), (NAME_ENV, name)):
        _check_segment(variable, value)
    return JobIdentity(namespace=namespace, name=name, uid=env.get(UID_ENV, ""))


def _check_segment(field: str, value: str) -> None:
    if not SEGMENT.match(value):
        raise OwnerError(
            f"{field}={value[:64]!r}: not a Kubernetes name (lower-case letters, digits, '-' and '.', "
            f"at most 253); it names the job's checkpoint directory"
        )


def job_dir(root: str, namespace: str, name: str) -> str:
    """The job's own directory: ``<root>/<namespace>/<name>`` (``root`` is ``checkpoint.path``)."""
    _check_segment("namespace", namespace)
    _check_segment("name", name)
    return f"{root.rstrip('/')}/{namespace}/{name}"


def log_dir(root: str, namespace: str, name: str) -> str:
    """The job's log directory: ``<root>/<namespace>/<name>/logs``."""
    return f"{job_dir(root, namespace, name)}/{LOG_SUBDIR}"


def render(owner: Owner) -> str:
    """The record as the JSON text stored in :data:`OWNER_FILE`."""
    return json.dumps(dataclasses.asdict(owner), indent=2, sort_keys=True) + "\n"


_TYPES: dict[str, type | tuple[type, ...]] = {
    "namespace": str,
    "name": str,
    "uid": str,
    "writer": str,
    "host": str,
    "pid": int,
    "heartbeat": (int, float),
    "released": bool,
}


def parse(text: str, where: str) -> Owner:
    """The record in ``text`` (read from ``where``); raises :class:`OwnerError` naming it."""
    fix = f"remove {where} if no job writes to this directory any more"
    if len(text.encode()) > RECORD_LIMIT:
        raise OwnerError(f"{where}: larger than {RECORD_LIMIT} bytes, not an owner record; {fix}")
    try:
        raw: Any = json.loads(text)
    except ValueError as err:
        raise OwnerError(f"{where}: not JSON ({err}); {fix}") from None
    if (
        not isinstance(raw, dict)
        or set(raw) - set(_TYPES)
        or not set(_TYPES) - {"released"} <= set(raw)
    ):
        raise OwnerError(f"{where}: not an owner record (fields {sorted(_TYPES)}); {fix}")
    for key, kind in _TYPES.items():
        value = raw.get(key, False)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise OwnerError(f"{where}: field {key!r} has the wrong type; {fix}")
        if isinstance(value, str) and len(value) > 512:
            raise OwnerError(f"{where}: field {key!r} is too long; {fix}")
    if not math.isfinite(raw["heartbeat"]):
        raise OwnerError(f"{where}: heartbeat is not a time; {fix}")
    return Owner(**raw)


def live(owner: Owner, now: float, *, holder_gone: bool = False) -> bool:
    """Whether ``owner`` still writes: not released, not known dead, heartbeat within :data:`STALE_SECONDS`.

    A heartbeat far in the future is a broken clock, not a writer that lives forever.
    """
    if owner.released or holder_gone:
        return False
    return abs(now - owner.heartbeat) < STALE_SECONDS


def decide(current: Owner | None, me: Owner, now: float, *, holder_gone: bool = False) -> Verdict:
    """Whether ``me`` may write in the directory whose record is ``current`` (None: no record).

    The same job (same UID, a later attempt) takes over at once: the operator runs one gang at a
    time.  Another UID of the same namespace/name is the job deleted and applied again: it resumes
    once the old writer is gone (released, dead or stale) and is refused while it lives.  A record
    of another namespace/name is never taken over: the directory was moved or tampered with.
    """
    if current is None:
        return Verdict(
            "claim", f"{me.namespace}/{me.name} (uid {me.uid or '?'}) owns this directory"
        )
    if (current.namespace, current.name) != (me.namespace, me.name):
        return Verdict(
            "refuse",
            f"the owner record names job {current.namespace}/{current.name}, not "
            f"{me.namespace}/{me.name}; a job's checkpoints are never trained into by another",
        )
    if current.uid == me.uid:
        return Verdict("claim", f"attempt {me.writer} takes over from {current.writer}")
    age = now - current.heartbeat
    if live(current, now, holder_gone=holder_gone):
        return Verdict(
            "refuse",
            f"another live writer holds it: job {current.namespace}/{current.name} uid {current.uid} "
            f"(writer {current.writer} on {current.host}, heartbeat {age:.0f}s ago); two jobs of one "
            f"name must not write one directory. If that job is being deleted, apply this one again "
            f"once its pods are gone (its record goes stale {STALE_SECONDS:.0f}s after its last heartbeat)",
        )
    return Verdict(
        "claim",
        f"{me.namespace}/{me.name} was re-created (uid {current.uid} -> {me.uid}): resuming the "
        f"checkpoints that uid {current.uid} wrote (its last heartbeat {age:.0f}s ago)",
        previous_uid=current.uid,
    )
