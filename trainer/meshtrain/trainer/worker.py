"""One training rank: ``python -m meshtrain.trainer`` under torchrun (or :mod:`.launch`), or a
worker of :mod:`.supervise` that rebuilds its process groups in place (:mod:`.recovery.generations`).

Reads the spec, joins the process group, builds the mesh and the engine, resumes from the newest
checkpoint and trains, saving checkpoints and rank 0's ``steps.jsonl``; its exit codes are listed
in docs/trainer.md, "Running".  A refused spec, dataset or checkpoint (2, 3, 4) is also written to
the termination log, because torchrun exits 1 for any failed worker
(:func:`.telemetry.progress.write_failure`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.api import exitcodes, loading, rules
from meshtrain.api import layout as layout_mod
from meshtrain.api import spec as api_spec
from meshtrain.planner.timing import pipeline_window
from meshtrain.trainer import engine, storage
from meshtrain.trainer.checkpointing import checkpointer, memory, recovery, store
from meshtrain.trainer.data import dataset
from meshtrain.trainer.guards import faults, loss_guard, stopping, stragglers
from meshtrain.trainer.interop import config_json, from_hf
from meshtrain.trainer.parallel import float8, state_bytes
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.recovery import generations, stall
from meshtrain.trainer.telemetry import goodput, progress, readiness
from meshtrain.trainer.telemetry.recorder import TelemetryRecorder, make_recorder
from meshtrain.trainer.telemetry.tracking import log as tracked

CHECKPOINT_DIR_ENV = "MESHTRAIN_CHECKPOINT_DIR"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.trainer", description="Run one meshtrain training rank."
    )
    parser.add_argument(
        "--spec",
        default=os.environ.get("MESHTRAIN_SPEC_FILE"),
        help="TrainingJob YAML (default: $MESHTRAIN_SPEC_FILE)",
    )
    parser.add_argument(
        "--log-dir",
        default=os.environ.get("MESHTRAIN_LOG_DIR"),
        help="where rank 0 writes steps.jsonl (default: $MESHTRAIN_LOG_DIR; none: no log)",
    )
    parser.add_argument("--steps", type=int, default=None, help="override training.steps")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field, e.g. --set parallelism.microBatches=4 (repeatable)",
    )
    return parser


def load_spec(
    path: str | None, overrides: list[str], steps: int | None
) -> api_spec.TrainingJobSpec:
    """The spec with overrides applied (raises SpecError)."""
    if not path:
        raise loading.SpecError(
            [
                rules.Problem(
                    path="--spec", message="no spec file: pass --spec or set MESHTRAIN_SPEC_FILE"
                )
            ]
        )
    job = loading.load_spec_file(path)
    extra = list(overrides) + ([f"training.steps={steps}"] if steps is not None else [])
    return loading.apply_overrides(job, extra) if extra else job


def use_cuda() -> bool:
    """GPU unless $MESHTRAIN_DEVICE=cpu or there is none for this local rank."""
    wanted = os.environ.get("MESHTRAIN_DEVICE", "auto")
    if wanted == "cpu":
        return False
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.is_available() and torch.cuda.device_count() > local


def step_record(
    result: engine.StepResult, summary: dict[str, float], job: api_spec.TrainingJobSpec
) -> dict[str, Any]:
    """The steps.jsonl record of one step."""
    par = job.parallelism
    record = {
        "step": result.step,
        "loss": result.loss,
        "tokens": result.tokens,
        "step_seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "time": time.time(),
        "layout": par.layout_string,
        "global_batch": job.global_batch,
        "bubble_ratio_theoretical": pipeline_window.bubble_ratio(
            par.pipeline, par.micro_batches, par.virtual_stages
        ),
    }
    record.update(summary)  # the telemetry recorder's step record (docs/telemetry.md)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        job = load_spec(args.spec, args.overrides, args.steps)
        storage.configure(job.object_storage)
        job = from_hf.check_spec(job)  # config.json's values where the spec is silent
        dataset.check_dataset(
            job.training, vocab=job.model.shape().vocab, from_hf=job.model.init.from_hf
        )
    except (loading.SpecError, config_json.HFError) as err:
        return _refuse(exitcodes.SPEC, err)
    except dataset.DatasetError as err:
        return _refuse(exitcodes.DATA, err)
    readiness.mark(int(os.environ.get("RANK", "0")))  # meshtrain run: "3 of 8 ranks ready"
    stop = (
        stopping.StopRequest().install()
    )  # before the slow start: a signal during it still stops cleanly
    cuda = use_cuda()
    device = mesh_mod.device_for(int(os.environ.get("LOCAL_RANK", "0")), use_cuda=cuda)
    try:  # the spec cannot know the device: refused here, before any process group
        float8.check_device(job.training.float8, device)
    except float8.Float8Unavailable as err:
        return _refuse(exitcodes.SPEC, err)
    if generations.supervised():  # under meshtrain.trainer.supervise: one session per generation
        return generations.run(
            lambda session: _session(job, args, stop, device, session),
            use_cuda=cuda,
            log_dir=args.log_dir,
            metrics_port=job.metrics.port,
            stopped=lambda: stop.requested,
        )
    mesh_mod.init_process_group(use_cuda=cuda)
    return _session(job, args, stop, device, None)


def _session(
    job: api_spec.TrainingJobSpec,
    args: argparse.Namespace,
    stop: stopping.StopRequest,
    device: torch.device,
    session: generations.Session | None,
) -> int:
    """Build mesh and engine on the joined process group, restore, train; the exit code.

    Supervised (``session``), the session closes the recorder at the generation's end (the next
    one serves on its port), and a failure of the generation raises instead of exiting.
    """
    rank = int(os.environ.get("RANK", "0"))
    # the gang's process groups are up (a gang record's rejoinedAt)
    rejoined_at = session.rejoined_at if session is not None else time.time()
    mesh = mesh_mod.build_mesh(job.parallelism.layout, device)
    seed_global_rng(job.training.seed, rank)  # a restore below replaces it with the saved state
    kept = session.tracker if session is not None else None  # one goodput account per process
    recorder = make_recorder(
        job, mesh.layout, rank, args.log_dir, device=device, steps_log=False, tracker=kept
    )
    if session is not None:
        session.attach(recorder)
    try:
        trainer = engine.Engine(job, mesh, recorder=recorder)
    except dataset.DatasetError as err:
        return _refuse(exitcodes.DATA, err)
    if session is not None:
        session.progressed("built")
    grad_reducer = trainer.model.reducer
    recorder.watch(
        state_bytes.meter(trainer.model, trainer.optimizer, grad_reducer),
        grad_reducer.payload_bytes if grad_reducer is not None else None,
    )
    saver = checkpointer.Checkpointer(trainer, root=os.environ.get(CHECKPOINT_DIR_ENV))
    snapshots = memory.MemorySnapshots(trainer, job, root=memory.default_root(os.environ))
    try:  # continue after the newest in-memory snapshot or complete checkpoint, if there is one
        restored, source = recovery.restore(trainer, saver, snapshots)
    except (store.CheckpointError, memory.HalfLoaded) as err:
        snapshots.close()
        saver.close()
        if isinstance(err, memory.HalfLoaded):  # a fresh engine next (its files are dropped)
            return _rebuild_after(err, session)
        return _checkpoint_failed(err, session)
    if session is not None:
        session.restored(restored, source)
    if restored is not None and source == "storage":
        recorder.checkpoint_saved(restored)
    # status.progress.resumedFromUid: which job (UID) wrote the checkpoint this gang resumed from
    if saver.resumed_uid is not None and recorder.progress is not None:
        recorder.progress.update(resumed_from_uid=saver.resumed_uid)
    if saver.resumed is not None:  # restored at another global batch: the rates follow its plan
        recorder.learning_rates(saver.resumed.plan)
    if rank == 0 and (session is None or session.generation == 0):
        # a gang rebuilt after a failure: its recovery record (docs/telemetry.md, "Goodput");
        # an in-place recovery (a later generation) is recorded by the session instead
        goodput.note_gang_restart(args.log_dir, restored, rejoined_at=rejoined_at)
        print(
            state_bytes.measure(trainer.model, trainer.optimizer, grad_reducer).summary(),
            file=sys.stderr,
        )
    log = (  # steps.jsonl and the experiment trackers of spec.tracking
        tracked.step_log(
            job, args.log_dir, tracked.home(saver.root, args.log_dir), (restored or 0) + 1
        )
        if rank == 0
        else None
    )
    try:
        return _train(job, rank, trainer, recorder, saver, snapshots, log, stop, session)
    except store.CheckpointError as err:  # raised on every rank alike (checkpointer._everywhere)
        return _checkpoint_failed(err, session)
    finally:
        snapshots.close()
        saver.close()
        if log is not None and session is not None:
            log.close()


def _signalled(stop: stopping.StopRequest) -> bool:
    """Whether this rank's own stop signal came, waiting :data:`generations.PEER_STOP_GRACE_S`
    for it: the pods of a gang deleted together get their signals a moment apart."""
    deadline = time.monotonic() + generations.PEER_STOP_GRACE_S
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    return stop.requested


def seed_global_rng(seed: int, rank: int) -> None:
    """Seed torch's global generators (CPU and every CUDA device) from ``training.seed`` and the
    global rank, before the engine is built.

    torch seeds them at random in every process, so without this two runs of one spec (or an
    in-place recovery, whose ranks rebuild their engines) would save different ``rng.<rank>``
    states; with it, every rank starts the same stream in every run, a restore carries it on.
    """
    digest = hashlib.sha256(f"{seed}/rng/{rank}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _checkpoint_failed(err: store.CheckpointError, session: generations.Session | None) -> int:
    """Exit 4, unless the generation ended under the checkpoint (a peer failed): then rejoin."""
    if session is not None and session.interrupted():
        raise generations.Interrupted(str(err)) from err
    return _refuse(exitcodes.CHECKPOINT, err)


def _rebuild_after(err: memory.HalfLoaded, session: generations.Session | None) -> int:
    """A snapshot failed half-way and storage had nothing: supervised, the next generation builds a
    fresh engine; else the gang is started again (never exit 4 for a bad snapshot)."""
    if session is not None:
        raise generations.Interrupted(str(err)) from err
    print(f"{err}; restarting the gang", file=sys.stderr)
    progress.write_failure(exitcodes.GANG_RESTART, str(err))
    return exitcodes.GANG_RESTART


def _train(
    job: api_spec.TrainingJobSpec,
    rank: int,
    trainer: engine.Engine,
    recorder: TelemetryRecorder,
    saver: checkpointer.Checkpointer,
    snapshots: memory.MemorySnapshots,
    log: tracked.Writer | None,
    stop: stopping.StopRequest,
    session: generations.Session | None = None,
) -> int:
    """Train from the step after the restored one to ``training.steps``; the exit code."""
    evaluation = job.training.eval
    detector = straggler_detector(job, trainer.mesh.layout)
    faults.slow_down(
        trainer.model.chunks,
        rank,
        current_step=lambda: trainer.step + 1,
        previous_compute=lambda: recorder.last.compute_seconds if recorder.last else None,
        forwards_per_step=job.parallelism.micro_batches * len(trainer.model.chunks),
    )
    cpu_mark = time.process_time()
    for step in range(trainer.step + 1, job.training.steps + 1):
        faults.maybe_fail(rank, step, generation=session.generation if session else 0)
        try:
            result = trainer.train_step(
                stop_requested=stop.requested, share=_previous_compute(detector, recorder)
            )
        except loss_guard.LossGuardTripped as err:
            snapshots.wait()  # its background exchange uses the process group
            return _guard_stop(step, err, saver, log)
        verdict = None
        if detector is not None:  # the shared times are of the step before this one
            detector.observe(step - 1, result.shared)
            verdict = detector.verdict(step)
            recorder.straggler_verdict(verdict)
        due = evaluation.interval and (
            step % evaluation.interval == 0 or step == job.training.steps
        )
        eval_loss = trainer.evaluate() if due else None
        epoch = trainer.sampler.epoch_at(step - 1) if trainer.sampler.order else None
        recorder.health(
            step,
            eval_loss=eval_loss,
            skipped=result.skipped,
            noise_scale=result.noise_scale,
            epoch=epoch,
        )
        if log is not None:
            record = step_record(result, recorder.steps[-1], job)
            if saver.resumed is not None and step == saver.resumed.plan.start + 1:
                record["batch_change"] = saver.resumed.record | {"message": saver.resumed.message}
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
            if epoch is not None:
                record["epoch"] = epoch
            if result.skipped:
                record["skipped"] = result.skipped
            if verdict is not None:
                record["slowdowns"] = verdict.slowdowns
                record["stragglers"] = [f.rank for f in verdict.flagged]
            # rank 0's CPU seconds (all its threads) since the previous record: calibration's loop cost
            record["cpu_seconds"], cpu_mark = time.process_time() - cpu_mark, time.process_time()
            log.write(record)
        if session is not None and session.watcher.fired.is_set():
            # NCCL's abort raises nothing on the host: a step whose collectives it may have cut
            # short is never saved (the next round replays it)
            raise generations.Interrupted(f"the process groups were aborted during step {step}")
        saver.after_step(step)
        snapshots.after_step(step)
        for published in saver.published():  # COMPLETE and renamed: /progress may report it
            recorder.checkpoint_saved(published)
        if session is not None:  # after the checkpoint: the recovery record's first step is whole
            session.step_done(step)
        if result.stop and step < job.training.steps:
            snapshots.wait()
            return _stop_after(step, saver, recorder, log, stop, session)
    if session is not None:  # the final saves and barrier take as long as they take
        session.progressed(stall.FINISHING)
    snapshots.wait()
    saver.wait()  # the last save, if it is still being written
    for published in saver.published():
        recorder.checkpoint_saved(published)
    if log is not None:
        log.close()
    dist.barrier()
    if session is not None:
        session.finished()
    if recorder.progress is not None:  # global rank 0: the final progress for the operator
        progress.write_termination_log(recorder.progress.document())
    dist.destroy_process_group()
    return 0


def straggler_detector(
    job: api_spec.TrainingJobSpec, layout: layout_mod.ParallelLayout
) -> stragglers.Detector | None:
    """The detector of ``runPolicy.stragglerPolicy``; None when it is ignored or no rank has a peer."""
    policy = job.run_policy.straggler_policy
    if policy.action == "ignore" or layout.data < 2:
        return None
    return stragglers.Detector(layout, policy.threshold, policy.window)


def _previous_compute(
    detector: stragglers.Detector | None, recorder: TelemetryRecorder
) -> float | None:
    """This rank's compute seconds of its last finished step, for the detector (0: none yet)."""
    if detector is None:
        return None
    return recorder.last.compute_seconds if recorder.last is not None else 0.0


def _refuse(code: int, err: Exception) -> int:
    """Exit with a permanent ``code``: the message on stderr and, for the operator, in the termination log."""
    print(err, file=sys.stderr)
    progress.write_failure(code, str(err))
    return code


def _guard_stop(
    step: int,
    err: loss_guard.LossGuardTripped,
    saver: checkpointer.Checkpointer,
    log: tracked.Writer | None,
) -> int:
    """The loss guard gave up at ``step``: save nothing and leave, naming the last good checkpoint.

    Checkpoints taken while updates were skipped are not good ones; pruning
    kept the last good one however many of them came after it.
    """
    saver.wait()  # a save in flight holds an accepted state: let it finish
    if log is not None:
        log.close()
    kept = f"step {saver.last_good}" if saver.last_good is not None else "none written yet"
    if saver.last_saved is not None and saver.last_saved != saver.last_good:
        kept += (
            f" (the newer ones, up to step {saver.last_saved}, were taken while updates were "
            "skipped; remove them to resume from it)"
        )
    message = f"stopped at step {step}: {err}; last good checkpoint: {kept}"
    print(message, file=sys.stderr)  # every rank: whichever pod fails first carries the reason
    progress.write_failure(exitcodes.LOSS_GUARD, message)
    dist.destroy_process_group()
    return exitcodes.LOSS_GUARD


def _stop_after(
    step: int,
    saver: checkpointer.Checkpointer,
    recorder: TelemetryRecorder,
    log: tracked.Writer | None,
    stop: stopping.StopRequest,
    session: generations.Session | None = None,
) -> int:
    """Every rank agreed to stop after ``step``: make sure a checkpoint of it exists, then leave.

    Supervised with in-place recovery on (and budget left), a rank whose own pod got no signal (within
    :data:`generations.PEER_STOP_GRACE_S`) does not leave: another pod alone is going (deleted,
    drained), so it rebuilds in place and waits at the next round for that pod's replacement
    (:class:`generations.PeerStopped`); when its own pod is stopped too (the whole gang deleted),
    the signal ends the wait and it exits 143 all the same.
    """
    saver.wait()  # a save in flight (perhaps of this very step) is published first
    for published in saver.published():
        recorder.checkpoint_saved(published)
    if saver.last_saved != step:
        saver.save()
        recorder.checkpoint_saved(step)
    if log is not None:
        log.close()
    if session is not None and session.waits_for_peers() and not _signalled(stop):
        raise generations.PeerStopped(
            f"another pod's rank was stopped (SIGTERM) after step {step}, checkpoint of it saved"
        )
    if dist.get_rank() == 0:
        reason = stop.signal_name or "a signal on another rank"
        print(
            f"stopped after step {step} ({reason}); checkpoint of step {step} saved, a new run resumes from it",
            file=sys.stderr,
        )
    dist.destroy_process_group()
    return exitcodes.STOPPED
