"""The supervised worker's generation loop: rebuild the process groups in the same process after a failure.

A worker started by :mod:`meshtrain.trainer.supervise` (``$MESHTRAIN_SUPERVISED`` set) joins the
store's current round, initialises its process group on ``PrefixStore(f"g{g}/")`` and runs the
body (mesh, engine, restore, train).  A :class:`Watcher` thread polls the store's generation; when
it moves on, the watcher aborts the process groups (:mod:`.abort`) so that the main thread's
blocked collective raises.  A worker whose collective failed first (a peer died) starts the next
round itself (:func:`.rendezvous.start_round`: one bump per failure).  Either way the main thread
destroys the groups, drops the engine, frees memory, and joins the next round — no new Python, no
new ``import torch``.  Global rank 0 writes one recovery record after the first step of a new
round (:mod:`meshtrain.trainer.telemetry.recoveries`); its goodput tracker, one for the process,
gets the record at restore time, before that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from meshtrain.api import exitcodes
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.recovery import abort, device_fault, rendezvous
from meshtrain.trainer.telemetry import goodput, goodput_live, recoveries
from meshtrain.trainer.telemetry import progress as progress_mod
from meshtrain.trainer.telemetry.recorder import TelemetryRecorder

SUPERVISED_ENV = "MESHTRAIN_SUPERVISED"
"""Set by the supervisor to its recovery settings (JSON): the worker runs :func:`run`."""
WATCH_S = 0.2
"""How often the watcher reads the store's generation."""
STORE_TIMEOUT_S = 60.0
WATCH_TIMEOUT_S = 5.0
"""The watcher's store calls give up after this long (its own connection)."""
STORE_LOST_FAILURES = 3
STORE_LOST_S = 10.0
"""The store counts as lost after this many failed reads in a row spanning this long."""
FIRST_JOIN_TIMEOUT_S = 600.0
"""How long round 0 waits for every rank: the pods of a new gang start apart (image pulls, node
start-up), as torchrun's rendezvous ``join_timeout`` (600 s) allows; later rounds wait
``rejoinTimeoutSeconds``."""


COMMUNICATION_MARKS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
"""Texts of a communication failure in a ``RuntimeError`` (gloo raises no ``DistError``)."""


class Interrupted(Exception):
    """The current generation ended under this worker (a peer failed): rejoin the next one."""

    cause = "peer lost"
    """The failure's cause in the recovery record when this worker starts the next round."""


class PeerStopped(Interrupted):
    """Every rank agreed to stop after a step, but this rank's pod got no signal: another pod is
    going alone (deleted, drained, its node shutting down), and this rank waits in place for its
    replacement rather than ending the gang (docs/recovery.md, "A pod stopped alone")."""

    cause = "peer pod stopped"


PEER_STOP_GRACE_S = 3.0
"""How long a rank waits for its own stop signal after the gang agreed to stop before it takes
the stop for another pod's alone: the pods of a gang deleted together are signalled a moment
apart, and waiting costs nothing on the path of a replacement pod that has yet to start."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The recovery settings a supervisor hands its workers (``runPolicy.recovery``)."""

    in_place_limit: int
    """In-place recoveries per gang attempt before the gang is rebuilt."""
    rejoin_timeout_s: float
    """How long a round waits for every rank."""
    in_place: bool = True
    """``runPolicy.recovery.inPlace``: off, a rank stopped with its gang leaves (143) even when
    only another pod was signalled."""

    def dumps(self) -> str:
        return json.dumps(
            {
                "inPlaceLimit": self.in_place_limit,
                "rejoin": self.rejoin_timeout_s,
                "inPlace": self.in_place,
            }
        )

    @staticmethod
    def from_env() -> Settings | None:
        raw = os.environ.get(SUPERVISED_ENV)
        if not raw:
            return None
        value = json.loads(raw)
        return Settings(
            int(value["inPlaceLimit"]), float(value["rejoin"]), bool(value.get("inPlace", True))
        )


class Watcher(threading.Thread):
    """Aborts this process's groups once the store's generation leaves ``generation`` (or the store is gone)."""

    def __init__(
        self,
        store: c10d.TCPStore,
        generation: int,
        sockets: abort.GlooSockets,
        *,
        backend: str,
        incarnation: rendezvous.Incarnation,
        full_read_s: float = rendezvous.FULL_READ_S,
    ) -> None:
        super().__init__(name=f"generation-watcher-{generation}", daemon=True)
        self.store = store.clone()  # its own connection: the main thread may hold the other
        self.store.set_timeout(datetime.timedelta(seconds=WATCH_TIMEOUT_S))
        self.generation = generation
        self.sockets = sockets
        self.backend = backend
        self.incarnation = incarnation
        self.full_read_s = full_read_s
        self.fired = threading.Event()
        """Set once the groups were aborted."""
        self.store_lost = False
        self.superseded = False
        self.errors = StoreErrors()
        self._stopping = threading.Event()

    def run(self) -> None:
        gate = rendezvous.ChangeGate(self.store, self.full_read_s)
        while not self._stopping.wait(WATCH_S):
            try:
                if not gate.moved():
                    self.errors.ok()
                    continue
                moved = (
                    rendezvous.generation(self.store) != self.generation
                    or rendezvous.halted(self.store) is not None
                )
                self.superseded = rendezvous.superseded(self.store, self.incarnation)
                self.errors.ok()
            except Exception:  # noqa: BLE001 - any store error: the store's host may be gone
                gate.forget()
                moved = self.store_lost = self.errors.failed()
            if moved or self.superseded:
                self.fired.set()
                abort.abort_groups(self.sockets, self.backend)
                return

    def stop(self) -> None:
        self._stopping.set()


class StoreErrors:
    """Failed store reads in a row: one error is a hiccup, :data:`STORE_LOST_FAILURES` spanning
    :data:`STORE_LOST_S` mean the store is gone."""

    def __init__(self, failures: int = STORE_LOST_FAILURES, span_s: float = STORE_LOST_S) -> None:
        self.failures, self.span_s = failures, span_s
        self.count, self.first = 0, 0.0

    def ok(self) -> None:
        self.count = 0

    def failed(self) -> bool:
        """Note a failed read; whether the store now counts as lost."""
        now = time.monotonic()
        if self.count == 0:
            self.first = now
        self.count += 1
        return self.count >= self.failures and now - self.first >= self.span_s


@dataclasses.dataclass
class Session:
    """One generation of a supervised worker, as the worker body sees it."""

    generation: int
    """The round this process group belongs to."""
    store: c10d.TCPStore
    """The job's store."""
    rank: int
    """This worker's global rank."""
    watcher: Watcher
    """The generation watcher."""
    log_dir: str | None
    """Where rank 0 writes recoveries.jsonl (None: nowhere)."""
    history: list[dict[str, Any]]
    """The recovery records of this process's earlier generations (rank 0)."""
    previous_step: int
    """The newest step rank 0 completed before this generation."""
    rejoined_at: float = dataclasses.field(default_factory=time.time)
    """When this generation's process group was built."""
    restored_at: float | None = None
    resumed_step: int = 0
    source: str = "none"
    recorded: bool = False
    progress: progress_mod.Progress | None = None
    recorder: TelemetryRecorder | None = None
    tracker: goodput_live.Tracker | None = None
    """Rank 0's goodput account, the same in every generation of this process (None elsewhere)."""
    record: recoveries.Recovery | None = None
    """Rank 0: this generation's recovery record, once restored (firstStepAt still unset)."""
    settings: Settings = Settings(0, 0.0, in_place=False)
    """The supervisor's recovery settings (:meth:`Settings.from_env`)."""

    def waits_for_peers(self) -> bool:
        """Whether a rank whose pod got no stop signal waits in place for another pod's
        replacement: in-place recovery on and a recovery left in the budget (else it leaves
        with the gang, 143, rather than start a round that would halt it with 75)."""
        limit = self.settings.in_place_limit
        return self.settings.in_place and rendezvous.recoveries_left(self.store, limit) > 0

    def interrupted(self) -> bool:
        """Whether this generation is over (the watcher fired or the store moved on)."""
        if self.watcher.fired.is_set():
            return True
        try:
            return rendezvous.generation(self.store) != self.generation
        except Exception:  # noqa: BLE001 - the store is gone: so is the generation
            return True

    def attach(self, recorder: TelemetryRecorder) -> None:
        """This generation's recorder: its progress document carries the earlier records too, and
        the session closes it at the end (:meth:`close`)."""
        self.recorder = recorder
        self.progress = recorder.progress
        if self.progress is not None:
            for record in self.history:
                self.progress.recovered(record)

    def close(self) -> None:
        """Close the recorder (files, the metrics server's port)."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def finished(self) -> None:
        """Past the final barrier: rank 0 tells the supervisors (the store may go away now)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):  # finished either way
                rendezvous.finish(self.store)

    def progressed(self, what: str) -> None:
        """Rank 0 made progress (``what``: ``built``, ``restored``, a step, ``finishing``): the
        store's host restarts its stall clock (:mod:`.stall`)."""
        if self.rank == 0:
            rendezvous.mark_progress(self.store, self.generation, what)

    def restored(self, step: int | None, source: str) -> None:
        """The state was loaded (``step`` None: from scratch)."""
        self.restored_at, self.resumed_step, self.source = time.time(), step or 0, source
        self.progressed("restored")
        if self.rank != 0 or self.generation == 0:
            return
        self.record = self._record()
        parsed = goodput.parse_recovery(self.record.to_json())
        if self.tracker is not None and parsed is not None:  # before the step the record waits for
            self.tracker.recovered(parsed)

    def _record(self) -> recoveries.Recovery:
        """This generation's recovery record as known now (no first step yet)."""
        merged = rendezvous.summary(self.store, self.generation)
        return recoveries.Recovery(
            generation=self.generation,
            tier=merged["tier"],
            cause=merged["cause"],
            ranks=merged["ranks"],
            nodes=merged["nodes"],
            failed_at=merged["failed_at"],
            detected_at=merged["detected_at"],
            rejoined_at=self.rejoined_at,
            restored_at=self.restored_at or self.rejoined_at,
            resumed_step=self.resumed_step,
            source=recoveries.source(self.source),
            lost_steps=max(0, self.previous_step - self.resumed_step),
        )

    def step_done(self, step: int) -> None:
        """A step completed: rank 0 notes it in the store, and after a recovery writes its record."""
        if self.rank != 0:
            return
        self.store.set(rendezvous.STEP, str(step))
        self.progressed(str(step))
        if self.generation == 0 or self.recorded:
            return
        self.recorded = True
        record = dataclasses.replace(self.record or self._record(), first_step_at=time.time())
        if self.log_dir:
            with contextlib.suppress(OSError):
                recoveries.append(self.log_dir, record)
        self.history.append(record.to_json())
        counts = rendezvous.counted(self.store, self.generation, record.tier)
        if self.progress is not None:
            self.progress.recovered(record.to_json(), counts)


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED_ENV))


def _say(message: str) -> None:
    print(
        f"meshtrain worker rank {os.environ.get('RANK')} pid {os.getpid()}: {message}",
        file=sys.stderr,
        flush=True,
    )


def run(
    body: Callable[[Session], int],
    *,
    use_cuda: bool,
    log_dir: str | None,
    metrics_port: int,
    stopped: Callable[[], bool] = lambda: False,
) -> int:
    """Run ``body`` once per generation until it returns an exit code (see the module); 75 when
    the store is gone (its host was lost: the gang is rebuilt), :data:`rendezvous.SUPERSEDED` when a
    newer incarnation of this pod runs, ``STOPPED`` when a stop came during a rejoin."""
    try:
        return _generations(
            body, use_cuda=use_cuda, log_dir=log_dir, metrics_port=metrics_port, stopped=stopped
        )
    except dist.DistNetworkError as err:
        _say(f"the rendezvous store is gone ({err}); leaving for a gang rebuild")
        return exitcodes.GANG_RESTART


def incarnation() -> rendezvous.Incarnation:
    """This worker's incarnation, as its supervisor handed it over."""
    pod = int(os.environ.get("GROUP_RANK", "0"))
    return rendezvous.Incarnation.loads(pod, os.environ.get(rendezvous.INCARNATION_ENV, "0:"))


JOIN_EXITS = {"superseded": rendezvous.SUPERSEDED, "stopped": exitcodes.STOPPED}
"""Exit codes of join outcomes that end the worker without halting the gang."""


def _generations(
    body: Callable[[Session], int],
    *,
    use_cuda: bool,
    log_dir: str | None,
    metrics_port: int,
    stopped: Callable[[], bool],
) -> int:
    settings = Settings.from_env()
    assert settings is not None, f"{SUPERVISED_ENV} is not set"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    store = rendezvous.connect(
        os.environ["MASTER_ADDR"], port, master=False, timeout_s=STORE_TIMEOUT_S
    )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    sockets = abort.GlooSockets(port, kept_ports={metrics_port + local})
    abort.install(sockets)
    backend = "nccl" if use_cuda else "gloo"
    fence = incarnation()
    member = f"{fence.identity}/{os.getpid()}"
    history: list[dict[str, Any]] = []
    tracker = (
        goodput_live.Tracker(log_dir) if rank == 0 and log_dir else None
    )  # read once a process
    while True:
        generation = rendezvous.generation(store)
        patience = settings.rejoin_timeout_s
        if generation == 0:
            patience = max(patience, FIRST_JOIN_TIMEOUT_S)
        outcome = rendezvous.join(
            store, generation, rank, world, patience,
            member=member, incarnation=fence, stopped=stopped,
        )  # fmt: skip
        if outcome == "moved":
            continue
        if outcome in JOIN_EXITS:
            if outcome == "stopped":
                failure = rendezvous.Failure("process", "stopped in the join", (rank,), time.time())
                rendezvous.leave(store, generation, rank, member, failure, settings.in_place_limit)
            _say(f"generation {generation}: {outcome}; leaving with {JOIN_EXITS[outcome]}")
            return JOIN_EXITS[outcome]
        if outcome != "ready":
            code = rendezvous.halted(store)
            if code is None:  # nobody came in time: the gang is rebuilt
                failed = rendezvous.device_error_ranks(store, generation)
                code = rendezvous.halt(store, exitcodes.GANG_RESTART, failed)
            _say(f"generation {generation}: {outcome}; leaving with {code}")
            return code
        _say(f"joined generation {generation}")
        previous = int(store.get(rendezvous.STEP)) if store.check([rendezvous.STEP]) else 0
        with abort.GROUPS:
            dist.init_process_group(
                backend=backend,
                store=c10d.PrefixStore(f"g{generation}/", store),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(
                    seconds=float(
                        os.environ.get("MESHTRAIN_PG_TIMEOUT_S", mesh_mod.DEFAULT_TIMEOUT_S)
                    )
                ),
            )
        watcher = Watcher(store, generation, sockets, backend=backend, incarnation=fence)
        watcher.start()
        session = Session(
            generation, store, rank, watcher, log_dir, history, previous, tracker=tracker,
            settings=settings,
        )  # fmt: skip
        try:
            return body(session)
        except (RuntimeError, Interrupted) as err:
            if watcher.superseded:
                _say("a newer incarnation of this pod runs; leaving")
                return rendezvous.SUPERSEDED
            if watcher.store_lost:
                _say("the rendezvous store is gone; leaving for a gang rebuild")
                return exitcodes.GANG_RESTART
            if device_fault.is_device_error(err):
                raise  # the GPU failed under this rank (NCCL says so too): this process never rejoins
            if not watcher.fired.is_set() and not session.interrupted():
                if not isinstance(err, Interrupted) and not communication_error(err):
                    raise  # this rank's own failure: its supervisor replaces the process
                # the first to see it: a peer is gone and nobody started a new round yet
                cause = err.cause if isinstance(err, Interrupted) else Interrupted.cause
                failure = rendezvous.Failure("process", cause, (), time.time())
                rendezvous.start_round(
                    store, generation, failure, settings.in_place_limit, token=member
                )
            _say(f"generation {generation} ended ({type(err).__name__}: {str(err)[:160]})")
        finally:
            watcher.stop()
            session.close()
            _teardown(sockets)


def communication_error(err: BaseException) -> bool:
    """Whether ``err`` came from a collective (a peer gone), not from this rank's own code.

    torch raises NCCL's errors as ``DistError`` subclasses but gloo's as plain ``RuntimeError``
    naming gloo's transport, so both are recognised.
    """
    text = str(err)
    return isinstance(err, dist.DistError) or any(mark in text for mark in COMMUNICATION_MARKS)


def _teardown(sockets: abort.GlooSockets) -> None:
    """Destroy the groups and free what the dropped engine held."""
    with abort.GROUPS, contextlib.suppress(Exception):  # aborted groups may refuse politely
        dist.destroy_process_group()
    sockets.forget()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
