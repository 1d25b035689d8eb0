"""In-memory checkpoints (``checkpoint.inMemory``): every K steps each rank's training state in its
pod's ``/dev/shm`` and on a buddy rank on another node, for restores in seconds after a failure.

A snapshot holds what a storage checkpoint holds of a rank (:func:`.state.state_dict`: weights,
optimizer moments and step, the trainer record with data position, loss guard and learning-rate
plan, gradient compression's state, RNG), as this rank's own shards (:mod:`.snapshot_file`): the
layout does not change across an in-place restart.  The step waits only for the copy to host
memory; writing the file and the peer exchange run on a background thread over a gloo group of
their own, and the previous snapshot is kept until every rank has the new one (docs/checkpoints.md,
"In-memory checkpoints").
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.api import job_dir, limits
from meshtrain.api import spec as api_spec
from meshtrain.planner import snapshots as planned
from meshtrain.trainer.checkpointing import (
    checkpointer,
    peer_copy,
    sharded,
    snapshot_file,
    state,
    store,
)
from meshtrain.trainer.optim import batch_change

NODE_ENV = "MESHTRAIN_NODE_NAME"
"""The node a pod runs on (the operator sets it from ``spec.nodeName``)."""
MAX_NODE_NAME = limits.MAX_NODE_NAME_LENGTH
"""Characters of a node name compared (a Kubernetes name is at most this long)."""
ROOT_ENV = "MESHTRAIN_MEMORY_CHECKPOINT_DIR"
"""Overrides the snapshot directory (tests, local runs); else :func:`default_root`."""
SHM_BASE = Path("/dev/shm/meshtrain")
TRANSFER_SLACK = 64 << 20
"""Bytes a peer's snapshot may have beyond the planner's estimate (header, RNG, rounding)."""


def _say(message: str) -> None:
    sys.stderr.write(f"[memory-checkpoint] {message}\n")
    sys.stderr.flush()


def default_root(env: Mapping[str, str]) -> Path:
    """``$MESHTRAIN_MEMORY_CHECKPOINT_DIR``, else ``/dev/shm/meshtrain/<namespace>/<name>/<uid>``
    (``local``, ``job`` and ``none`` for what the environment does not name)."""
    if env.get(ROOT_ENV):
        return Path(env[ROOT_ENV])
    identity = job_dir.identity_from_env(env)
    namespace = identity.namespace if identity is not None else "local"
    name = identity.name if identity is not None else "job"
    uid = env.get(job_dir.UID_ENV, "") or "none"
    if not job_dir.SEGMENT.match(uid):
        raise ValueError(f"{job_dir.UID_ENV}={uid[:64]!r}: not a Kubernetes UID")
    return SHM_BASE / (namespace or "local") / (name or "job") / uid


def node_name(env: Mapping[str, str], rank: int) -> str:
    """The node this rank runs on: ``$MESHTRAIN_NODE_NAME``; outside Kubernetes each pod counts as
    a node of its own (loopback pods share one machine): ``pod-<GROUP_RANK>``, else
    ``pod-<RANK // LOCAL_WORLD_SIZE>``."""
    if env.get(NODE_ENV):
        return env[NODE_ENV][:MAX_NODE_NAME]
    pod = env.get("GROUP_RANK", "")
    if not pod.isdigit():
        per_pod = env.get("LOCAL_WORLD_SIZE", "")
        pod = str(rank // int(per_pod)) if per_pod.isdigit() and int(per_pod) > 0 else "0"
    return f"pod-{int(pod)}"


def buddies(nodes: Sequence[str]) -> list[int] | None:
    """Who keeps each rank's peer copy, given each rank's node: None when every rank is on one node.

    The ranks are listed node by node (nodes in the order of their first rank, ranks in order) and
    each rank's buddy is the one ``m`` places further round that list, ``m`` the most ranks any node
    has: the nearest rank on another node whenever no node has more than half the ranks (with
    one pod per node: the same local rank of the next pod).  A permutation, so every rank keeps
    exactly one other's copy; past half on one node some pairs share it (:func:`same_node`).
    """
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    if len(first) < 2:
        return None
    order = sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r))
    shift = max(collections.Counter(nodes).values())
    chosen = [0] * len(nodes)
    for place, rank in enumerate(order):
        chosen[rank] = order[(place + shift) % len(order)]
    return chosen


def same_node(nodes: Sequence[str], chosen: Sequence[int]) -> list[int]:
    """The ranks whose buddy shares their node (their peer copy does not survive that node)."""
    return [rank for rank, other in enumerate(chosen) if nodes[other] == nodes[rank]]


def choose(
    held: Sequence[Iterable[Sequence[int]]], world: int
) -> tuple[int, list[tuple[int, int]]] | None:
    """The newest step whose every rank's snapshot some rank holds, and the transfers (holder, rank)
    that give each rank lacking its own a copy (the lowest holder sends); None: no such step.

    ``held[h]``: the (rank, step) snapshots rank ``h`` holds.
    """
    holders: dict[int, dict[int, list[int]]] = {}
    for holder, items in enumerate(held):
        for rank, step in items:
            if 0 <= rank < world:
                holders.setdefault(step, {}).setdefault(rank, []).append(holder)
    for step in sorted(holders, reverse=True):
        if len(holders[step]) == world:
            ranks = sorted(holders[step].items())
            return step, [(min(hs), rank) for rank, hs in ranks if rank not in hs]
    return None


@dataclasses.dataclass(frozen=True)
class Timing:
    """What one snapshot cost."""

    step: int
    """The step snapshotted."""
    copy_seconds: float
    """Copy of the state to host memory: the step waits for it."""
    write_seconds: float
    """Writing the file under the root (background)."""
    peer_seconds: float
    """Sending it to the buddy and receiving the ward's (background)."""
    bytes: int
    """Size of this rank's file."""


class HalfLoaded(Exception):
    """A snapshot failed to load on some rank after others had begun copying theirs in: the
    engine's state is mixed and must be overwritten whole (storage) or rebuilt (no storage)."""


class MemorySnapshots:
    """One rank's in-memory snapshots and its part in the restore protocol."""

    def __init__(self, engine: Any, job: api_spec.TrainingJobSpec, *, root: Path) -> None:
        """Collective when snapshots are on (makes the gloo group of their transfers)."""
        self.engine, self.root = engine, root
        in_memory = job.checkpoint.in_memory
        self.interval = in_memory.interval_steps
        """Steps between snapshots (0: off; nothing here runs a collective then)."""
        self.total = job.training.steps
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node = node_name(os.environ, self.rank)
        """The node this rank runs on (:func:`node_name`)."""
        self.group = _gloo_group() if self.interval else None
        """The snapshots' own gloo group (None when off): a watcher that aborts the process
        groups of a failed generation must abort this one too, or a peer exchange in flight
        waits on the lost rank."""
        self.buddy: int | None = None
        """Who keeps this rank's peer copy (None: no peer copy)."""
        self.ward: int | None = None
        """Whose peer copy this rank keeps."""
        if self.group is not None and in_memory.peer:
            self._pair()
        self.limit = int(2 * planned.snapshot_bytes(job)) + TRANSFER_SLACK
        """The largest snapshot file a rank sends or accepts, from the spec (never from a file)."""
        par = job.parallelism
        self.facts = {
            "version": 1,
            "rank": self.rank,
            "world": self.world,
            "node": self.node,
            "layout": {
                "data": par.data,
                "pipeline": par.pipeline,
                "tensor": par.tensor,
                "virtual_stages": par.virtual_stages,
                "zero_stage": par.zero_stage,
            },
            "model": job.model.shape().model_dump(),
        }
        self.last: int | None = None
        """The newest step every rank has a complete snapshot of."""
        self.resumed: batch_change.Resumed | None = None
        """Set by :meth:`restore` when the snapshot was taken during a learning-rate ramp or
        after a batch change (as :attr:`.Checkpointer.resumed`)."""
        self.timings: collections.deque[Timing] = collections.deque(maxlen=64)
        """The recent snapshots' costs (the benchmark and the log read them)."""
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._in_flight: concurrent.futures.Future[Timing | None] | None = None
        self._chosen: tuple[tuple[int, list[tuple[int, int]]] | None] | None = None

    def _pair(self) -> None:
        """Choose buddy and ward from every rank's node (collective; again in every generation:
        a replaced pod may run on another node)."""
        nodes: list[Any] = [None] * self.world
        dist.all_gather_object(nodes, self.node, group=self.group)
        names = [str(n)[:MAX_NODE_NAME] for n in nodes]
        chosen = buddies(names)
        if chosen is None:
            if self.rank == 0:
                _say(
                    f"every rank runs on node {names[0]!r}: no peer copies (they would not "
                    "survive its loss); each pod keeps its own snapshots only"
                )
            return
        shared = same_node(names, chosen)
        if shared and self.rank == 0:
            _say(
                f"more than half of the ranks run on one node: the peer copies of ranks "
                f"{shared[:16]} share their node and do not survive its loss"
            )
        self.buddy, self.ward = chosen[self.rank], chosen.index(self.rank)

    @property
    def enabled(self) -> bool:
        """Whether ``checkpoint.inMemory.intervalSteps`` is set."""
        return self.group is not None

    # --- snapshot --------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Every ``intervalSteps`` before the last step (the last one goes to storage)."""
        return self.enabled and step % self.interval == 0 and step < self.total

    def after_step(self, step: int) -> None:
        """Snapshot ``step`` when due (collective): copy to host now, write and exchange behind."""
        if not self.due(step):
            return
        self.wait()
        start = time.perf_counter()
        entries = sharded.host_copy(state.state_dict(self.engine))
        copied = time.perf_counter() - start
        self._in_flight = self._worker.submit(self._publish, step, entries, copied)

    def wait(self) -> None:
        """Let the snapshot in flight finish; a failure is logged (storage checkpoints remain)."""
        if self._in_flight is None:
            return
        try:
            timing = self._in_flight.result()
        except Exception as err:  # noqa: BLE001 - a lost peer: the next restore falls back to storage
            _say(f"rank {self.rank}: in-memory snapshot failed: {type(err).__name__}: {err}")
        else:
            if timing is not None:
                self.timings.append(timing)
        finally:
            self._in_flight = None

    def _publish(self, step: int, entries: dict[str, Any], copied: float) -> Timing | None:
        """Background: write the file, exchange peer copies, agree, prune the previous snapshot."""
        start = time.perf_counter()
        path: Path | None = None
        record = entries.pop(state.TRAINER_KEY)
        try:
            path = snapshot_file.write(self.root, self._header(step, entries, record), entries)
        except OSError as err:  # /dev/shm full: this step's snapshot is incomplete everywhere
            _say(f"rank {self.rank}: writing the snapshot of step {step} failed: {err}")
        entries.clear()  # the host copy is no longer needed
        written = time.perf_counter() - start
        ok = path is not None
        if self.buddy is not None and self.ward is not None:
            ok = self._exchange(step, path) and ok
        peered = time.perf_counter() - start - written
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        self._prune(step, keep=bool(flag.item()))
        if not flag.item():
            return None
        self.last = step
        size = path.stat().st_size if path is not None else 0
        return Timing(step, copied, written, peered, size)

    def _header(self, step: int, entries: dict[str, Any], record: str) -> dict[str, Any]:
        return snapshot_file.header(self.facts | {"step": step}, entries, record)

    def _exchange(self, step: int, path: Path | None) -> bool:
        """Send this rank's file to its buddy while receiving its ward's; whether both went through."""
        assert self.group is not None and self.buddy is not None and self.ward is not None
        sent, received = peer_copy.exchange(
            self.group,
            path,
            to=self.buddy,
            source=self.ward,
            final=self.root / snapshot_file.name(self.ward, step),
            limit=self.limit,
        )
        return sent and received

    def _prune(self, step: int, *, keep: bool) -> None:
        """Every rank has ``step`` (``keep``): drop older snapshots; else drop ``step``'s own files."""
        held, stale = snapshot_file.listing(self.root)
        for rank, old in held:
            if (old < step) if keep else (old == step):
                snapshot_file.discard(self.root / snapshot_file.name(rank, old))
        del stale  # another rank of this pod may be writing its next snapshot: see available()

    # --- restore ---------------------------------------------------------------

    def available(self) -> int | None:
        """The newest step every rank's snapshot exists of somewhere (collective; nothing loaded)."""
        if not self.enabled:
            return None
        self.wait()
        held, stale = snapshot_file.listing(self.root)
        for path in stale:  # a writer that died mid-write; every rank's writes are done by now
            snapshot_file.discard(path)
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, sorted(held), group=self.group)
        chosen = choose(everyone, self.world)
        self._chosen = (chosen,)
        return None if chosen is None else chosen[0]

    def restore(self) -> int | None:
        """Load the newest step every rank's snapshot exists of (collective): missing ones are
        sent by their holders first.  None: no such step, or a snapshot does not fit this engine
        (another layout or model), is damaged (size, CRC-32) or unreadable: nothing was loaded and
        the caller restores from storage.  :class:`HalfLoaded` on every rank when the copy into
        the live state failed somewhere (that step's files are dropped)."""
        if not self.enabled:
            return None
        if self._chosen is None:
            self.available()
        assert self._chosen is not None
        (chosen,), self._chosen = self._chosen, None
        if chosen is None:
            return None
        step, transfers = chosen
        start = time.perf_counter()
        got = self._fetch(step, transfers)
        state.init_optimizer_state(self.engine.optimizer)
        entries = state.state_dict(self.engine)
        record_key, rng_key = state.TRAINER_KEY, f"rng.{self.rank}"
        del entries[record_key]
        path = self.root / snapshot_file.name(self.rank, step)
        mine = self._header(step, entries, "")

        found: dict[str, Any] = {}
        payload: list[bytearray] = []

        def read() -> str | None:
            if not got:
                return f"rank {self.rank}: its snapshot of step {step} did not arrive"
            try:
                head, data = snapshot_file.read(path, mine)
            except (OSError, store.CheckpointError) as err:
                return str(err)
            found.update(head)
            payload.append(data)
            return None

        refusals = [r for r in _gathered(read(), self.group) if r is not None]
        if refusals:  # nothing loaded yet: storage, or a fresh start, is exact
            if self.rank == 0:
                _say(f"not restoring step {step} from memory: {refusals[0]}; using storage")
            return None
        try:  # every rank's file is checked and read: only copies into the live state remain
            snapshot_file.apply(payload.pop(), entries)
            torch.set_rng_state(entries[rng_key])
            self.resumed = checkpointer.apply_record(self.engine, _record(found), str(path))
            failed = None
        except Exception as err:  # noqa: BLE001 - agreed on below, then the caller falls back
            failed = f"rank {self.rank}: {type(err).__name__}: {err}"
        failures = [f for f in _gathered(failed, self.group) if f is not None]
        if failures:  # the live state is half-loaded: never train on it, never load it again
            self._prune(step, keep=False)
            raise HalfLoaded(f"loading the in-memory snapshot of step {step}: {failures[0]}")
        self.last = step
        if self.rank == 0:
            moved = f", {len(transfers)} shard(s) from peers" if transfers else ""
            _say(f"restored step {step} from memory{moved} in {time.perf_counter() - start:.2f}s")
        return step

    def _fetch(self, step: int, transfers: list[tuple[int, int]]) -> bool:
        """Carry out the transfers (holder, rank) in order; whether this rank's own snapshot is here."""
        assert self.group is not None
        got = all(rank != self.rank for _, rank in transfers)
        for holder, rank in transfers:  # every rank walks the same list: pairs never cross
            path = self.root / snapshot_file.name(rank, step)
            if holder == self.rank:
                peer_copy.send(self.group, path, to=rank, limit=self.limit)
            elif rank == self.rank:
                got = peer_copy.receive(self.group, path, source=holder, limit=self.limit)
        return got

    def close(self) -> None:
        """Let the snapshot in flight finish and stop the background thread (files stay)."""
        self.wait()
        self._worker.shutdown(wait=True)


def _record(header: Mapping[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(header["record"])
    return record


def _gathered(mine: str | None, group: dist.ProcessGroup | None) -> list[str | None]:
    """Every rank's message (None: fine), in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _gloo_group() -> dist.ProcessGroup:
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group
