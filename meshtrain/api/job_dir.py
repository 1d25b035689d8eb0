"""A job's own checkpoint directory on a shared root, and the owner record that guards it.

One layout for a local path, a claim and a bucket: ``<checkpoint.path>/<namespace>/<name>/`` holds
the job's ``step-*``, its in-progress ``.tmp-*``, its ``logs`` and the owner records under
:data:`OWNER_DIR`: one file per claim, ``owner/<generation>.json``, each created only if absent
(``O_EXCL``, ``If-None-Match: *``), the highest generation owning the directory.  A claim is thus a
compare-and-swap on a file system and in a bucket alike, and a writer refreshes only its own record.
Pure: paths are strings joined with ``/``; reading and writing the records is the caller's
(docs/checkpoints.md, "Jobs sharing a volume").
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
"""The single owner record of the first release of job directories (ignored; no release wrote it)."""
OWNER_DIR = "owner"
"""Subdirectory (prefix) of the owner records, ``<generation>.json``."""
GENERATION = re.compile(r"^(\d{8})\.json$")
"""Name of one owner record: its generation, zero-padded."""
MAX_GENERATION = 10**8 - 1
LOG_SUBDIR = "logs"
"""The job's step log and rank traces, beside its checkpoints (``MESHTRAIN_LOG_DIR`` in pods)."""
TENSORBOARD_SUBDIR = "tensorboard"
"""The default folder of ``spec.tracking.tensorboard``'s event files, beside the checkpoints."""
TRACKING_SUBDIR = "tracking"
"""The experiment trackers' run ids and W&B's offline runs, beside the checkpoints."""
HEARTBEAT_SECONDS = 10.0
"""How often the writer refreshes its heartbeat, whatever the save interval (a thread, not a step)."""
HEARTBEAT_ENV = "MESHTRAIN_OWNER_HEARTBEAT_SECONDS"
"""Overrides :data:`HEARTBEAT_SECONDS` (tests; every writer and claimant of a directory must agree)."""
WATCH_BEATS = 2.5
"""A foreign record that does not change for this many beats, watched on the claimant's own monotonic
clock, is a writer that is gone: no two machines' wall clocks are compared."""
PATIENCE_BEATS = 6.0
"""How long (beats) a claimant waits for a live foreign writer to stop or release before refusing:
a job applied again while the old one's pods still terminate resumes instead of failing."""
STALE_SECONDS = PATIENCE_BEATS * HEARTBEAT_SECONDS
"""Age (by the directory's own mtimes) after which another writer's leftover ``.tmp-`` is garbage."""
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
    """Unix time of the writer's last heartbeat (informational: liveness is judged by change)."""
    released: bool = False
    """The writer exited cleanly and gave the directory up."""
    boot_id: str = ""
    """The writer's kernel boot id: a pid means something only under the same boot."""
    pid_ns: int = 0
    """Inode of the writer's pid namespace: a pid means something only in the same one."""
    start_time: int = 0
    """Start time of the writer's process (clock ticks after boot): a reused pid has another."""


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
    "boot_id": str,
    "pid_ns": int,
    "start_time": int,
}
_OPTIONAL = {"released", "boot_id", "pid_ns", "start_time"}


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
        or not set(_TYPES) - _OPTIONAL <= set(raw)
    ):
        raise OwnerError(f"{where}: not an owner record (fields {sorted(_TYPES)}); {fix}")
    for key, kind in _TYPES.items():
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise OwnerError(f"{where}: field {key!r} has the wrong type; {fix}")
        if isinstance(value, str) and len(value) > 512:
            raise OwnerError(f"{where}: field {key!r} is too long; {fix}")
    if not math.isfinite(raw["heartbeat"]):
        raise OwnerError(f"{where}: heartbeat is not a time; {fix}")
    return Owner(**raw)


def heartbeat_seconds(env: Mapping[str, str]) -> float:
    """The heartbeat interval: :data:`HEARTBEAT_ENV` (0.05 .. 600 s) or :data:`HEARTBEAT_SECONDS`."""
    raw = env.get(HEARTBEAT_ENV, "")
    if not raw:
        return HEARTBEAT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.05 <= value <= 600:
        raise OwnerError(f"{HEARTBEAT_ENV}={raw[:32]!r}: expected seconds between 0.05 and 600")
    return value


def record_name(generation: int) -> str:
    """The owner record of ``generation``, relative to the job directory."""
    return f"{OWNER_DIR}/{generation:08d}.json"


def writer_tag(writer: str) -> str:
    """The random last part of a writer id (``<uid>/<attempt>/<tag>``): it names the writer's temporary files."""
    tag = writer.rsplit("/", 1)[-1]
    return tag if re.fullmatch(r"[0-9a-f]{1,32}", tag) else "x"


def _attempt(owner: Owner) -> int | None:
    parts = owner.writer.split("/")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def must_watch(current: Owner, me: Owner) -> bool:
    """Whether ``me`` must watch ``current`` for change before judging it: another unreleased UID of this job."""
    same_job = (current.namespace, current.name) == (me.namespace, me.name)
    return same_job and current.uid != me.uid and not current.released


def decide(current: Owner | None, me: Owner, *, live: bool) -> Verdict:
    """Whether ``me`` may write in the directory whose newest record is ``current`` (None: no record).

    ``live``: the record's writer was seen to beat (:data:`WATCH_BEATS`) until the claimant's patience
    ran out (:data:`PATIENCE_BEATS`); False when it is released, known dead or went quiet.

    The same job (same UID) takes over at once from an earlier attempt (the operator runs one gang
    at a time) and is refused by a later one.  Another UID of the same namespace/name is the job
    deleted and applied again: it resumes once the old writer is gone and is refused while it lives.
    A record of another namespace/name is never taken over: the directory was moved or tampered with.
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
        theirs, mine = _attempt(current), _attempt(me)
        if theirs is not None and mine is not None and theirs > mine:
            return Verdict(
                "refuse",
                f"a later attempt ({current.writer}) of this job owns the directory; this attempt "
                f"({me.writer}) is outdated and stops",
            )
        return Verdict("claim", f"attempt {me.writer} takes over from {current.writer}")
    if live:
        return Verdict(
            "refuse",
            f"another live writer holds it: job {current.namespace}/{current.name} uid {current.uid} "
            f"(writer {current.writer} on {current.host}, its heartbeat kept changing); two jobs of "
            f"one name must not write one directory. If that job is being deleted, apply this one "
            f"again once its pods are gone (a record that stops changing for {WATCH_BEATS:g} "
            f"heartbeats is taken over)",
        )
    return Verdict(
        "claim",
        f"{me.namespace}/{me.name} was re-created (uid {current.uid} -> {me.uid}): resuming the "
        f"checkpoints that uid {current.uid} wrote (writer {current.writer} released or gone)",
        previous_uid=current.uid,
    )
