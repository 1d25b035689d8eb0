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

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save

from meshtrain.trainer.checkpointing import sharded, state, store
from meshtrain.trainer.optim import batch_change

FAULT_ENV = "MESHTRAIN_FAULT_INJECT_SAVE"
FAULT_EXIT_CODE = 17


def parse_fault(value: str | None) -> tuple[int, str] | None:
    """``"4"`` -> (4, 'die'); ``"4:pause"`` -> (4, 'pause'); empty -> None."""
    if not value:
        return None
    step, _, mode = value.partition(":")
    mode = mode or "die"
    if not step.isdigit() or mode not in ("die", "pause"):
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected STEP or STEP:die or STEP:pause, e.g. 4:pause"
        )
    return int(step), mode


def _say(message: str) -> None:
    sys.stderr.write(f"[checkpoint] {message}\n")
    sys.stderr.flush()


def _agree(payload: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``payload`` on every rank; an exception instance there is raised everywhere."""
    box = [payload if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], store.CheckpointError):
        raise store.CheckpointError(str(box[0]))
    return box[0]


def _everywhere(fn: Any) -> None:
    """Run ``fn`` on every rank; a CheckpointError on any rank is raised on all of them (the lowest rank's)."""
    try:
        fn()
        mine = None
    except store.CheckpointError as err:
        mine = str(err)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, mine)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise store.CheckpointError(first)


def _on_rank0(fn: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Run ``fn`` on rank 0 and share its result (or its CheckpointError) with every rank."""
    result: Any = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except store.CheckpointError as err:
            result = err
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
        self.root = Path(root or spec.checkpoint.path)
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
        self._published: list[int] = []
        self.resumed: batch_change.Resumed | None = None
        """Set by :meth:`restore` when the checkpoint was trained at another batch (or mid-ramp)."""

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

    def restore(self) -> int | None:
        """Load the newest complete checkpoint, if any (collective); returns its step.

        Damage, a foreign directory or another model shape raise
        :class:`~.store.CheckpointError` on every rank: never a silent fresh start.
        """
        state.init_optimizer_state(self.engine.optimizer)

        def find() -> tuple[str, store.Marker, int | None] | None:
            found = store.latest(
                self.root, hashes=False
            )  # names, marker, sizes; the hashes are split below
            if found is None:
                return None
            good = store.last_good(store.scan(self.root))
            return str(found[0].path), found[1], None if good is None else good.step

        found = _on_rank0(find)
        if found is None:
            return None
        path, marker, self.last_good = Path(found[0]), found[1], found[2]
        model, step = marker.model, marker.step
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
        record = state.load_from(path, self.engine)
        self.engine.step = record["step"]
        self.engine.sampler.load_state_dict(record["data"])
        if self.engine.guard is not None and record.get("loss_guard"):
            self.engine.guard.load_state_dict(record["loss_guard"])
        state.set_optimizer_step(self.engine.optimizer, record["optimizer_step"])
        spec = self.engine.spec
        self.resumed = batch_change.on_resume(
            spec.training, spec.parallelism, record.get("batch"), record["step"]
        )
        if self.resumed is not None:
            self.engine.lr_plan = self.resumed.plan
        self.last_saved = step
        if dist.get_rank() == 0:
            _say(f"resumed from {path} (step {step}) in {time.perf_counter() - start:.2f}s")
            if self.resumed is not None:
                _say(self.resumed.message)
        return step

    # --- save ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step: every ``intervalSteps``, and the last one."""
        return step == self.total or (self.interval > 0 and step % self.interval == 0)

    def after_step(self, step: int) -> None:
        """Save if ``step`` is due (collective): in the background with ``asyncSave``, else now.

        What was published, now or by an earlier background save, is in :meth:`published`.
        """
        if not self.due(step) or self.last_saved == step:
            return
        if self.asynchronous:
            self._start_async(step)
        else:
            self.save()

    def published(self) -> list[int]:
        """Steps published since the last call (raises a background save's error on this rank)."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()
        done, self._published = self._published, []
        return done

    def wait(self) -> None:
        """Let the save in flight, if any, finish (collective when one is in flight on every rank)."""
        if self._in_flight is not None:
            try:
                self._published.append(self._in_flight.result())
            finally:
                self._in_flight = None

    def save(self) -> Path:
        """Write, publish and prune a checkpoint of the engine's current step now (collective)."""
        self.wait()
        step = self.engine.step
        start = time.perf_counter()
        tmp = Path(_on_rank0(lambda: str(store.new_tmp_dir(self.root, step))))
        entries = state.state_dict(self.engine)
        skips = self._guard_skips()
        state.save_into(tmp, entries)
        dist.barrier()
        written = time.perf_counter() - start
        final = self._publish(step, tmp, len(entries), written, start, None, skips)
        self._published.append(step)
        return final

    def _start_async(self, step: int) -> None:
        """Copy this rank's state to host memory, then write and publish it from the background thread."""
        self.wait()  # one save in flight at a time
        if self._group is None:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self._group = group
        start = time.perf_counter()
        tmp = Path(_on_rank0(lambda: str(store.new_tmp_dir(self.root, step))))
        entries = sharded.host_copy(state.state_dict(self.engine))
        skips = self._guard_skips()
        tmp.mkdir(parents=True, exist_ok=True)
        upload = async_save(
            entries,
            storage_writer=FileSystemWriter(str(tmp)),
            process_group=self._group,
            async_stager=_Staged(),
        )
        assert isinstance(upload, concurrent.futures.Future)  # a stager that stages at once
        if dist.get_rank() == 0:
            _say(
                f"step {step}: state copied in {time.perf_counter() - start:.2f}s, writing in the background"
            )

        def finish() -> int:
            upload.result()
            dist.barrier(group=self._group)
            written = time.perf_counter() - start
            self._publish(step, tmp, len(entries), written, start, self._group, skips)
            return step

        self._in_flight = self._worker.submit(finish)

    def _publish(
        self,
        step: int,
        tmp: Path,
        entries: int,
        written: float,
        start: float,
        group: dist.ProcessGroup | None,
        skips: int,
    ) -> Path:
        """Every rank's data is in ``tmp``: hash it (split over ranks), then rank 0 publishes and prunes.

        ``skips``: updates the loss guard had skipped in a row at ``step`` (0:
        a good checkpoint, which pruning keeps until a newer good one exists).
        """
        self._maybe_fault(step)
        shares: list[dict[str, Any]] = [
            {}
        ] * dist.get_world_size()  # every rank hashes its share of the files
        dist.all_gather_object(
            shares,
            store.describe_files(tmp, part=dist.get_rank(), parts=dist.get_world_size()),
            group=group,
        )

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
                },
            )
            final = store.publish(tmp, marker)
            store.prune(self.root, self.keep)
            good = store.last_good(store.scan(self.root))
            return str(final), None if good is None else good.step

        published, self.last_good = _on_rank0(publish, group)
        final = Path(published)
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
        SIGKILL the run there.
        """
        if self.fault is None or self.fault[0] != step:
            return
        if dist.get_rank() == 0:
            _say(
                f"{FAULT_ENV}: {self.fault[1]} in the save of step {step} (data written, not published)"
            )
        if self.fault[1] == "die":
            os._exit(FAULT_EXIT_CODE)
        while True:
            time.sleep(3600)


def _shape_text(shape: dict[str, int]) -> str:
    keys = ("family", "layers", "hidden", "heads", "kv_heads", "vocab", "seq_len", "ffn_hidden")
    return ", ".join(f"{k}={shape.get(k)}" for k in keys)
