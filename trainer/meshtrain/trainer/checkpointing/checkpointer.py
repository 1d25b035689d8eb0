"""When to save, and resuming at start: the checkpoint policy the worker calls.

Rank 0 makes every file-system decision (which checkpoint, the temporary name, publish, prune) and
broadcasts it, so all ranks act on one answer; hashing is split over the ranks, and an error on any
rank is raised on all.  With ``checkpoint.asyncSave`` a save is written and published from a
background thread over a gloo group of its own, one save in flight at a time (docs/checkpoints.md).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from meshtrain.api import exitcodes, job_dir
from meshtrain.trainer.checkpointing import owner, sharded, state, store
from meshtrain.trainer.optim import batch_change

FAULT_ENV = "MESHTRAIN_FAULT_INJECT_SAVE"
FAULT_EXIT_CODE = 17
LOAD_FAULT_ENV = "MESHTRAIN_FAULT_INJECT_LOAD"
"""Tests: ``raise`` makes the last rank raise an OSError while loading a checkpoint, ``reader``
while making its DCP reader (before DCP's first collective)."""
FAULT_MODES = ("die", "pause", "raise", "writer")


def parse_fault(value: str | None) -> tuple[int, str] | None:
    """``"4"`` -> (4, 'die'); ``"4:pause"``, ``"4:raise"``, ``"4:writer"`` -> (4, mode); empty -> None.

    ``writer``: the last rank raises while making its DCP writer of the save of that step.
    """
    if not value:
        return None
    step, _, mode = value.partition(":")
    mode = mode or "die"
    if not step.isdigit() or mode not in FAULT_MODES:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected STEP or STEP:MODE with MODE one of "
            f"{', '.join(FAULT_MODES)}, e.g. 4:pause"
        )
    return int(step), mode


def _injected(what: str) -> None:
    """Tests: an OSError on the last rank only (the others must learn of it, not wait for it)."""
    if dist.get_rank() == dist.get_world_size() - 1:
        raise OSError(f"injected fault on rank {dist.get_rank()} while {what}")


def _say(message: str) -> None:
    sys.stderr.write(f"[checkpoint] {message}\n")
    sys.stderr.flush()


JOB_UID_KEY = store.JOB_UID_KEY


def _failure(err: BaseException) -> str:
    """An exception as the message every rank raises: a CheckpointError's own text, else its type and text."""
    return str(err) if isinstance(err, store.CheckpointError) else f"{type(err).__name__}: {err}"


def _agree(payload: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``payload`` on every rank; an exception instance there is raised everywhere."""
    box = [payload if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], BaseException):
        raise store.CheckpointError(_failure(box[0]))
    return box[0]


def _everywhere(fn: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Run ``fn`` on every rank; every rank's result, or any rank's exception raised on all of them.

    The lowest failing rank's error is raised, as a CheckpointError, on every rank: an exception on
    one rank must not leave the others waiting in the next collective until its timeout.
    """
    mine: tuple[str | None, Any]
    try:
        mine = (None, fn())
    except Exception as err:  # noqa: BLE001 - any failure, reported to every rank, not only CheckpointError
        mine = (_failure(err), None)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, (error, _) in enumerate(everyone):
        if error is not None:
            raise store.CheckpointError(
                error if rank == dist.get_rank(group) else f"rank {rank}: {error}"
            )
    return [result for _, result in everyone]


def _on_rank0(fn: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Run ``fn`` on rank 0 and share its result (or its exception, as a CheckpointError) with every rank."""
    result: Any = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - any failure on rank 0 reaches every rank
            result = store.CheckpointError(_failure(err))
    return _agree(result, group)


class _Staged(AsyncStager):
    """DCP stager for a state dict that is already a host copy (:func:`.sharded.host_copy`)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the copy was made before ``async_save``."""

    def close(self) -> None:
        """Holds nothing."""


class Checkpointer:
    """Saves and restores one engine's state under ``spec.checkpoint.path``."""

    def __init__(self, engine: Any, *, root: str | Path | None = None) -> None:
        """``root`` overrides ``spec.checkpoint.path`` (``meshtrain run`` puts checkpoints beside its logs)."""
        self.engine = engine
        spec = engine.spec
        self.shared_root = store.location(root or spec.checkpoint.path)
        """``checkpoint.path`` as given: the job's own directory is under it (:mod:`meshtrain.api.job_dir`)."""
        self.root = self.shared_root
        """This job's checkpoints: its own directory once :meth:`restore` took it."""
        self.holding: owner.Holding | None = None
        """Rank 0's hold on the directory (:func:`.owner.take`)."""
        self.interval = spec.checkpoint.interval_steps
        self.keep = spec.checkpoint.keep
        self.total = spec.training.steps
        self.last_saved: int | None = None
        """Step of the newest checkpoint this run published or loaded."""
        self.last_good: int | None = None
        """Step of the newest checkpoint on disk taken after an applied update (:func:`.store.last_good`)."""
        self.fault = parse_fault(os.environ.get(FAULT_ENV))
        self.asynchronous = spec.checkpoint.async_save
        """Due saves run beside training (``checkpoint.asyncSave``)."""
        self._group: dist.ProcessGroup | None = (
            None  # the background saves' own (gloo), made at the first
        )
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._in_flight: concurrent.futures.Future[int] | None = None
        self._poll: dist.ProcessGroup | None = None
        """Where the ranks agree that a background save finished (its own group: the save's runs in a thread)."""
        self._published: list[int] = []
        self.resumed_uid: str | None = None
        """UID of the job that wrote the checkpoint :meth:`restore` loaded (None: unknown or none)."""
        self.resumed: batch_change.Resumed | None = None
        """Set by :meth:`restore` when the checkpoint was trained at another batch (or mid-ramp)."""
        self._located: tuple[tuple[str, store.Marker, int | None] | None] | None = None
        """What :meth:`locate` found (a 1-tuple: None inside means no checkpoint), until :meth:`restore`."""

    # --- resume ----------------------------------------------------------------

    def _model_shape(self) -> dict[str, int]:
        return self.engine.spec.model.shape().model_dump()

    def _layout(self) -> dict[str, int]:
        par = self.engine.spec.parallelism
        return {
            "data": par.data,
            "pipeline": par.pipeline,
            "tensor": par.tensor,
            "zero_stage": par.zero_stage,
        }

    def locate(self) -> int | None:
        """Take the job's directory and find its newest complete checkpoint (collective, nothing
        loaded); its step, None when there is none.  :meth:`restore` loads what this found."""

        def find() -> tuple[str, tuple[str, store.Marker, int | None] | None]:
            self.holding = owner.take(self.shared_root, os.environ)
            for note in self.holding.notes:
                _say(note)
            root = self.holding.directory
            found = store.latest(
                root, hashes=False
            )  # names, marker, sizes; the hashes are split below
            if found is None:
                return str(root), None
            good = store.last_good(store.scan(root))
            return str(root), (str(found[0].path), found[1], None if good is None else good.step)

        root, found = _on_rank0(find)
        self.root = store.location(root)
        self._located = (found,)
        if found is None:
            return None
        self.last_good = found[2]  # the loss guard's message names it whichever source loads
        return found[1].step

    def restore(self) -> int | None:
        """Load the newest complete checkpoint, if any (collective); returns its step.

        Damage, a foreign directory or another model shape raise
        :class:`~.store.CheckpointError` on every rank: never a silent fresh start.
        """
        state.init_optimizer_state(self.engine.optimizer)
        if self._located is None:
            self.locate()
        assert self._located is not None
        (found,), self._located = self._located, None
        if found is None:
            return None
        path, marker, self.last_good = store.location(found[0]), found[1], found[2]
        model, step = marker.model, marker.step
        self._refuse_finished_predecessor(path, marker)
        rank, world = dist.get_rank(), dist.get_world_size()
        _everywhere(lambda: store.verify(path, marker, hashes=True, part=rank, parts=world))
        mine = self._model_shape()
        shape_type = type(self.engine.spec.model.shape())
        model = shape_type.model_validate(
            model
        ).model_dump()  # older markers: defaults for new fields
        if model != mine:
            raise store.CheckpointError(
                f"{path / store.MARKER}: model shape mismatch: the checkpoint has {_shape_text(model)}, "
                f"this job (spec.model) has {_shape_text(mine)}; refusing to load"
            )
        start = time.perf_counter()
        record = self._load(path)
        self.resumed = apply_record(self.engine, record, str(path))
        self.last_saved = step
        self.resumed_uid = str(marker.extra.get(JOB_UID_KEY) or "") or None
        if dist.get_rank() == 0:
            by = f", written by job uid {self.resumed_uid}" if self.resumed_uid else ""
            _say(f"resumed from {path} (step {step}{by}) in {time.perf_counter() - start:.2f}s")
            if self.resumed is not None:
                _say(self.resumed.message)
        return step

    def restored_elsewhere(self, resumed: batch_change.Resumed | None) -> None:
        """The state came from another source (in-memory snapshots): forget what :meth:`locate`
        found (the directory stays held); ``resumed``: that source's batch change, if any."""
        self._located, self.resumed = None, resumed

    def _refuse_finished_predecessor(self, path: store.Location, marker: store.Marker) -> None:
        """A re-created job (another UID) must not report success for training it did not do.

        Raised on every rank alike (each has the marker).
        """
        writer = str(marker.extra.get(JOB_UID_KEY) or "")
        mine = os.environ.get(job_dir.UID_ENV, "")
        if writer and mine and writer != mine and marker.step >= self.total:
            raise store.CheckpointError(
                f"{path}: written by job uid {writer}, the job of this name before it was re-created, "
                f"at step {marker.step}; this job (uid {mine}) trains to training.steps={self.total}, "
                f"so it would train nothing. Raise training.steps to continue that training, rename "
                f"this job to start afresh, or move {self.root} away"
            )

    def _load(self, path: store.Location) -> dict[str, Any]:
        """Every rank's share of ``path`` into the engine (collective); any rank's failure fails all."""
        prepared: list[tuple[dict[str, Any], bool]] = []
        readers: list[StorageReader] = []
        fault = os.environ.get(LOAD_FAULT_ENV)

        def prepare() -> None:
            if fault == "raise":
                _injected(f"loading {path}")
            prepared.append(state.prepare_load(path, self.engine))
            if fault == "reader":
                _injected(f"making the reader of {path}")
            readers.append(state.reader(path))

        # local steps first: a rank refusing here must not leave the others waiting inside DCP
        _everywhere(prepare)
        loaded = _everywhere(lambda: state.load_prepared(path, prepared[0], readers[0]))
        record: dict[str, Any] = loaded[dist.get_rank()]
        return record

    def close(self) -> None:
        """A clean exit: give the directory up so the next writer need not wait for the heartbeat to go stale."""
        if self.holding is not None and self.holding.heartbeat is not None:
            self.holding.heartbeat.release()

    # --- save ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step: every ``intervalSteps``, and the last one."""
        return step == self.total or (self.interval > 0 and step % self.interval == 0)

    def after_step(self, step: int) -> None:
        """Save if ``step`` is due (collective): in the background with ``asyncSave``, else now.

        What was published, now or by an earlier background save, is in :meth:`published`.
        Rank 0 exits with code 4 at once when its heartbeat found the directory taken over.
        """
        self._stop_if_lost()
        if not self.due(step) or self.last_saved == step:
            return
        if self.asynchronous:
            self._start_async(step)
        else:
            self.save()

    def _stop_if_lost(self) -> None:
        """Exit 4 now when another writer took the directory over (the other ranks fail at the next collective)."""
        heartbeat = self.holding.heartbeat if self.holding is not None else None
        if heartbeat is not None and heartbeat.lost is not None:
            _say(heartbeat.lost)
            os._exit(exitcodes.CHECKPOINT)

    def _tag(self) -> str:
        """This writer's tag in its temporary names (rank 0's; ``x`` without an owner record)."""
        heartbeat = self.holding.heartbeat if self.holding is not None else None
        return heartbeat.tag if heartbeat is not None else "x"

    def _new_tmp(self, step: int) -> store.Location:
        """Rank 0's fresh in-progress name for the save of ``step``, on every rank."""
        return store.location(
            _on_rank0(lambda: str(store.new_tmp_dir(self.root, step, self._tag())))
        )

    def _writer(self, tmp: store.Location, step: int) -> StorageWriter:
        """Every rank's DCP writer of ``tmp``, made in a step of its own (a failure reaches every rank
        here, before any rank enters DCP's collectives)."""
        made: list[StorageWriter] = []

        def make() -> None:
            if self.fault == (step, "writer"):
                _injected(f"making the writer of {tmp}")
            made.append(state.writer(tmp))

        _everywhere(make)
        return made[0]

    def published(self) -> list[int]:
        """Steps published since the last call (collective: a background save's error is raised on every rank).

        The ranks agree that every rank's background save is done before any of them waits on it, so
        a failed save stops them all at the same step.
        """
        if self._in_flight is not None and self._all_done():
            self.wait()
        done, self._published = self._published, []
        return done

    def _all_done(self) -> bool:
        """Whether the background save is done on every rank (a tiny all-reduce over the poll group)."""
        assert self._in_flight is not None
        done = torch.tensor([1 if self._in_flight.done() else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll)
        return bool(done.item())

    def wait(self) -> None:
        """Let the save in flight, if any, finish (collective when one is in flight on every rank)."""
        if self._in_flight is not None:
            try:
                self._published.append(self._in_flight.result())
            finally:
                self._in_flight = None

    def save(self) -> store.Location:
        """Write, publish and prune a checkpoint of the engine's current step now (collective)."""
        self.wait()
        step = self.engine.step
        start = time.perf_counter()
        tmp = self._new_tmp(step)
        entries = state.state_dict(self.engine)
        skips = self._guard_skips()
        writer = self._writer(tmp, step)
        _everywhere(lambda: state.save_into(writer, entries))
        written = time.perf_counter() - start
        final = self._publish(step, tmp, len(entries), written, start, None, skips)
        self._published.append(step)
        return final

    def _start_async(self, step: int) -> None:
        """Copy this rank's state to host memory, then write and publish it from the background thread."""
        self.wait()  # one save in flight at a time
        if self._group is None:
            self._group, self._poll = _gloo_group(), _gloo_group()
        start = time.perf_counter()
        tmp = self._new_tmp(step)
        entries: dict[str, Any] = {}
        started: list[concurrent.futures.Future[Any]] = []
        writer = self._writer(tmp, step)

        def begin() -> None:
            entries.update(sharded.host_copy(state.state_dict(self.engine)))
            upload = async_save(
                entries,
                storage_writer=writer,
                process_group=self._group,
                async_stager=_Staged(),
            )
            assert isinstance(upload, concurrent.futures.Future)  # a stager that stages at once
            started.append(upload)

        skips = self._guard_skips()
        _everywhere(begin)
        upload = started[0]
        if dist.get_rank() == 0:
            _say(
                f"step {step}: state copied in {time.perf_counter() - start:.2f}s, writing in the background"
            )

        def finish() -> int:
            try:
                _everywhere(lambda: _written(upload), self._group)
                written = time.perf_counter() - start
                self._publish(step, tmp, len(entries), written, start, self._group, skips)
            except store.CheckpointError:
                raise
            except Exception as err:  # a failed collective (a rank gone) too: exit 4
                raise store.CheckpointError(
                    f"background save of step {step}: {_failure(err)}"
                ) from err
            return step

        self._in_flight = self._worker.submit(finish)

    def _publish(
        self,
        step: int,
        tmp: store.Location,
        entries: int,
        written: float,
        start: float,
        group: dist.ProcessGroup | None,
        skips: int,
    ) -> store.Location:
        """Every rank's data is in ``tmp``: hash it (split over ranks), then rank 0 publishes and prunes.

        ``skips``: updates the loss guard had skipped in a row at ``step`` (0:
        a good checkpoint, which pruning keeps until a newer good one exists).
        """

        # One listing, rank 0's: ranks whose listings differ (an NFS attribute cache, an eventually
        # consistent store) would otherwise split the files differently and leave some unhashed.
        names: list[str] = _on_rank0(lambda: store.listed_names(tmp), group)

        def share() -> dict[str, Any]:  # every rank hashes its share of the files
            self._maybe_fault(step)
            return store.describe_files(
                tmp, part=dist.get_rank(), parts=dist.get_world_size(), names=names
            )

        shares: list[dict[str, Any]] = _everywhere(share, group)

        def publish() -> tuple[str, int | None]:
            files = {name: facts for share in shares for name, facts in share.items()}
            marker = store.Marker(
                step=step,
                layout=self._layout(),
                model=self._model_shape(),
                files=files,
                extra={
                    "entries": entries,
                    "write_seconds": round(written, 3),
                    "world_size": dist.get_world_size(),
                    "token_ids": self.engine.token_ids.to_json(),
                    "max_position_embeddings": self.engine.hf_max_positions,
                    "from_hf": self.engine.spec.model.init.from_hf,
                    store.GUARD_SKIPS: skips,
                    JOB_UID_KEY: self.holding.uid if self.holding is not None else "",
                },
            )
            heartbeat = self.holding.heartbeat if self.holding is not None else None
            fence = heartbeat.check if heartbeat is not None else None
            if heartbeat is not None:
                heartbeat.beat()  # still the owner (raises if another writer took over)
            final = store.publish(tmp, marker, fence)
            store.prune(
                self.root,
                self.keep,
                tag=self._tag(),
                fence=fence,
                uid=self.holding.uid if self.holding is not None else "",
                stale_seconds=job_dir.PATIENCE_BEATS * job_dir.heartbeat_seconds(os.environ),
            )
            good = store.last_good(store.scan(self.root))
            return str(final), None if good is None else good.step

        published, self.last_good = _on_rank0(publish, group)
        final = store.location(published)
        self.last_saved = step
        if dist.get_rank() == 0:
            _say(f"saved step {step} to {final} in {time.perf_counter() - start:.2f}s")
        return final

    def _guard_skips(self) -> int:
        guard = self.engine.guard
        return guard.consecutive if guard is not None else 0

    def _maybe_fault(self, step: int) -> None:
        """Tests: stop the save of ``step`` after every rank's data is written, before publishing.

        ``die`` exits at once with :data:`FAULT_EXIT_CODE`; ``pause`` sleeps so a test can
        SIGKILL the run there; ``raise`` raises an OSError on the last rank only.
        """
        if self.fault is None or self.fault[0] != step or self.fault[1] == "writer":
            return
        if self.fault[1] == "raise":
            _injected(f"saving step {step}")
            return
        if dist.get_rank() == 0:
            _say(
                f"{FAULT_ENV}: {self.fault[1]} in the save of step {step} (data written, not published)"
            )
        if self.fault[1] == "die":
            os._exit(FAULT_EXIT_CODE)
        while True:
            time.sleep(3600)


def apply_record(engine: Any, record: dict[str, Any], where: str) -> batch_change.Resumed | None:
    """Set the engine's step, data position, loss guard, optimizer step and learning-rate plan from
    a checkpoint's trainer record (:func:`.state.trainer_record`); the batch change, if any."""
    engine.step = record["step"]
    try:
        engine.sampler.load_state_dict(record["data"])
    except ValueError as err:  # another seed or other data: an error naming the fields
        raise store.CheckpointError(f"{where}: {err}") from None
    if engine.guard is not None and record.get("loss_guard"):
        engine.guard.load_state_dict(record["loss_guard"])
    state.set_optimizer_step(engine.optimizer, record["optimizer_step"])
    spec = engine.spec
    resumed = batch_change.on_resume(
        spec.training, spec.parallelism, record.get("batch"), record["step"]
    )
    if resumed is not None:
        engine.lr_plan = resumed.plan
    return resumed


def _written(upload: concurrent.futures.Future[Any]) -> None:
    """Wait for this rank's background write (its result, DCP's metadata, need not travel)."""
    upload.result()


def _gloo_group() -> dist.ProcessGroup:
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group


def _shape_text(shape: dict[str, int]) -> str:
    keys = ("family", "layers", "hidden", "heads", "kv_heads", "vocab", "seq_len", "ffn_hidden")
    return ", ".join(f"{k}={shape.get(k)}" for k in keys)
