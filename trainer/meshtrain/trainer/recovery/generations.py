"""The supervised worker's generation loop: rebuild the process groups in the same process after a failure.

A worker started by :mod:`meshtrain.trainer.supervise` (``$MESHTRAIN_SUPERVISED`` set) joins the
store's current round, initialises its process group on ``PrefixStore(f"g{g}/")`` and runs the
body (mesh, engine, restore, train).  A :class:`Watcher` thread polls the store's generation; when
it moves on, the watcher aborts the process groups (:mod:`.abort`) so that the main thread's
blocked collective raises.  A worker whose collective failed first (a peer died) starts the next
round itself (:func:`.rendezvous.start_round`: one bump per failure).  Either way the main thread
destroys the groups, drops the engine, frees memory, and joins the next round — no new Python, no
new ``import torch``.  Global rank 0 writes one recovery record after the first step of a new
round (:mod:`meshtrain.trainer.telemetry.recoveries`).
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
from meshtrain.trainer.recovery import abort, rendezvous
from meshtrain.trainer.telemetry import progress as progress_mod
from meshtrain.trainer.telemetry import recoveries
from meshtrain.trainer.telemetry.recorder import TelemetryRecorder

SUPERVISED_ENV = "MESHTRAIN_SUPERVISED"
"""Set by the supervisor to its recovery settings (JSON): the worker runs :func:`run`."""
WATCH_S = 0.2
"""How often the watcher reads the store's generation."""
STORE_TIMEOUT_S = 60.0
FIRST_JOIN_TIMEOUT_S = 600.0
"""How long round 0 waits for every rank: the pods of a new gang start apart (image pulls, node
start-up), as torchrun's rendezvous ``join_timeout`` (600 s) allows; later rounds wait
``rejoinTimeoutSeconds``."""


COMMUNICATION_MARKS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
"""Texts of a communication failure in a ``RuntimeError`` (gloo raises no ``DistError``)."""


class Interrupted(Exception):
    """The current generation ended under this worker (a peer failed): rejoin the next one."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The recovery settings a supervisor hands its workers (``runPolicy.recovery``)."""

    in_place_limit: int
    """In-place recoveries per gang attempt before the gang is rebuilt."""
    rejoin_timeout_s: float
    """How long a round waits for every rank."""

    def dumps(self) -> str:
        return json.dumps({"inPlaceLimit": self.in_place_limit, "rejoin": self.rejoin_timeout_s})

    @staticmethod
    def from_env() -> Settings | None:
        raw = os.environ.get(SUPERVISED_ENV)
        if not raw:
            return None
        value = json.loads(raw)
        return Settings(int(value["inPlaceLimit"]), float(value["rejoin"]))


class Watcher(threading.Thread):
    """Aborts this process's groups once the store's generation leaves ``generation`` (or the store is gone)."""

    def __init__(self, store: c10d.TCPStore, generation: int, sockets: abort.GlooSockets) -> None:
        super().__init__(name=f"generation-watcher-{generation}", daemon=True)
        self.store = store.clone()  # its own connection: the main thread may hold the other
        self.generation = generation
        self.sockets = sockets
        self.fired = threading.Event()
        """Set once the groups were aborted."""
        self.store_lost = False
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                moved = (
                    rendezvous.generation(self.store) != self.generation
                    or rendezvous.halted(self.store) is not None
                )
            except Exception:  # noqa: BLE001 - any store error: pod 0 is gone
                moved, self.store_lost = True, True
            if moved:
                self.fired.set()
                abort.abort_groups(self.sockets)
                return

    def stop(self) -> None:
        self._stop.set()


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
    source: str = "storage"
    recorded: bool = False
    progress: progress_mod.Progress | None = None
    recorder: TelemetryRecorder | None = None

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

    def restored(self, step: int | None, source: str) -> None:
        """The state was loaded (``step`` None: from scratch)."""
        self.restored_at, self.resumed_step, self.source = time.time(), step or 0, source

    def step_done(self, step: int) -> None:
        """A step completed: rank 0 notes it in the store, and after a recovery writes its record."""
        if self.rank != 0:
            return
        self.store.set(rendezvous.STEP, str(step))
        if self.generation == 0 or self.recorded:
            return
        self.recorded = True
        merged = rendezvous.summary(self.store, self.generation)
        record = recoveries.Recovery(
            generation=self.generation,
            tier=merged["tier"],
            cause=merged["cause"],
            ranks=merged["ranks"],
            failed_at=merged["failed_at"],
            detected_at=merged["detected_at"],
            rejoined_at=self.rejoined_at,
            restored_at=self.restored_at or self.rejoined_at,
            resumed_step=self.resumed_step,
            source="memory" if self.source == "memory" else "storage",
            lost_steps=max(0, self.previous_step - self.resumed_step),
            first_step_at=time.time(),
        )
        if self.log_dir:
            with contextlib.suppress(OSError):
                recoveries.append(self.log_dir, record)
        self.history.append(record.to_json())
        if self.progress is not None:
            self.progress.recovered(record.to_json())


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED_ENV))


def _say(message: str) -> None:
    print(
        f"meshtrain worker rank {os.environ.get('RANK')} pid {os.getpid()}: {message}",
        file=sys.stderr,
        flush=True,
    )


def run(body: Callable[[Session], int], *, use_cuda: bool, log_dir: str | None) -> int:
    """Run ``body`` once per generation until it returns an exit code (see the module); 75 when
    the store is gone (pod 0 was lost: the gang is rebuilt)."""
    try:
        return _generations(body, use_cuda=use_cuda, log_dir=log_dir)
    except dist.DistNetworkError as err:
        _say(f"the rendezvous store is gone ({err}); leaving for a gang rebuild")
        return exitcodes.GANG_RESTART


def _generations(body: Callable[[Session], int], *, use_cuda: bool, log_dir: str | None) -> int:
    settings = Settings.from_env()
    assert settings is not None, f"{SUPERVISED_ENV} is not set"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    store = rendezvous.connect(
        os.environ["MASTER_ADDR"], port, master=False, timeout_s=STORE_TIMEOUT_S
    )
    metrics = int(os.environ.get("MESHTRAIN_METRICS_PORT", "0")) + int(
        os.environ.get("LOCAL_RANK", "0")
    )
    sockets = abort.GlooSockets(port, kept_ports={metrics})
    history: list[dict[str, Any]] = []
    while True:
        generation = rendezvous.generation(store)
        patience = settings.rejoin_timeout_s
        if generation == 0:
            patience = max(patience, FIRST_JOIN_TIMEOUT_S)
        outcome = rendezvous.join(store, generation, rank, world, patience)
        if outcome == "moved":
            continue
        if outcome != "ready":
            code = rendezvous.halted(store)
            if code is None:  # nobody came in time: the gang is rebuilt
                code = rendezvous.halt(store, exitcodes.GANG_RESTART)
            _say(f"generation {generation}: {outcome}; leaving with {code}")
            return code
        _say(f"joined generation {generation}")
        previous = int(store.get(rendezvous.STEP)) if store.check([rendezvous.STEP]) else 0
        sockets.mark()
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=c10d.PrefixStore(f"g{generation}/", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(
                seconds=float(os.environ.get("MESHTRAIN_PG_TIMEOUT_S", mesh_mod.DEFAULT_TIMEOUT_S))
            ),
        )
        watcher = Watcher(store, generation, sockets)
        watcher.start()
        session = Session(generation, store, rank, watcher, log_dir, history, previous)
        try:
            return body(session)
        except (RuntimeError, Interrupted) as err:
            if watcher.store_lost:
                _say("the rendezvous store is gone; leaving for a gang rebuild")
                return exitcodes.GANG_RESTART
            if not watcher.fired.is_set() and not session.interrupted():
                if not isinstance(err, Interrupted) and not communication_error(err):
                    raise  # this rank's own failure: its supervisor replaces the process
                # the first to see it: a peer is gone and nobody started a new round yet
                failure = rendezvous.Failure("process", "peer lost", (), time.time())
                rendezvous.start_round(store, generation, failure, settings.in_place_limit)
            _say(f"generation {generation} ended ({type(err).__name__}: {str(err)[:160]})")
        finally:
            watcher.stop()
            session.close()
            _teardown()


def communication_error(err: BaseException) -> bool:
    """Whether ``err`` came from a collective (a peer gone), not from this rank's own code.

    torch raises NCCL's errors as ``DistError`` subclasses but gloo's as plain ``RuntimeError``
    naming gloo's transport, so both are recognised.
    """
    text = str(err)
    return isinstance(err, dist.DistError) or any(mark in text for mark in COMMUNICATION_MARKS)


def _teardown() -> None:
    """Destroy the groups and free what the dropped engine held."""
    with contextlib.suppress(Exception):  # aborted groups may refuse politely
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
