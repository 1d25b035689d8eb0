"""``python -m meshtrain.trainer.supervise``: the per-pod supervisor of the built-in trainer.

It replaces torchrun in the trainer container (same ``PET_*`` / ``MASTER_*`` environment).  Pod
0's supervisor hosts the job's TCPStore on ``MASTER_PORT``, or, with ``runPolicy.recovery.
rendezvousStore: dedicated``, the store pod does (:mod:`.recovery.store_host`, ``MASTER_ADDR`` names
it) and pod 0 is a pod like the others; each supervisor starts one worker per
local rank (torchrun's environment) and ``runPolicy.recovery.warmSpares`` warm spares
(:mod:`.recovery.spares`), heartbeats, and watches its children.  A worker that fails with a
retryable code is replaced by a spare and the gang rebuilds its process groups in place
(:mod:`.recovery.rendezvous`, :mod:`.recovery.generations`); healthy workers keep their processes.
Exit codes (docs/recovery.md): 0 when every worker finished (also when the store goes away
after rank 0 finished); a permanent worker code and ``STOPPED`` pass through, and SIGTERM
always ends in ``STOPPED`` or a permanent code (a pod stopped from outside); ``GANG_RESTART``
(75) when in-place recovery is off, exhausted or impossible (rejoin timeout, store gone);
``SUPERSEDED`` (76) when a newer incarnation of this pod took over (a pod declared lost whose
containers still ran: it is fenced off and leaves without touching the gang); ``DEVICE_SUSPECT``
(79) when one of its GPUs failed twice within an hour, or is gone (:mod:`.recovery.device_fault`:
the pod leaves to be replaced on another node).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from types import FrameType
from typing import Any

from meshtrain.api import exitcodes, loading
from meshtrain.api.spec import kube_names, run_policy
from meshtrain.api.spec import pod as pod_spec
from meshtrain.planner import host_model
from meshtrain.trainer import launch
from meshtrain.trainer.recovery import (
    device_fault,
    generations,
    gpu_probe,
    liveness,
    rendezvous,
    spares,
    stall,
    store_host,
)
from meshtrain.trainer.telemetry import context, progress

POLL_S = 0.1
NCCL_ASYNC_ERROR_HANDLING = "0"
"""Forced on the workers: torch's ``_abort_process_group`` is documented for 0 (the watchdog
must leave the communicators to the watcher's abort, :mod:`.recovery.abort`)."""
LINGER_S = store_host.LINGER_S
"""How long pod 0 keeps the store it hosts up at the end for the other supervisors to read it."""
MAX_REAPED = 64
"""Orphans collected per poll."""
LEAVE_GRACE_S = 2.0
"""SIGTERM to SIGKILL for the ranks of a pod leaving a bad GPU: blocked in collectives behind the
failed rank, they cannot save anything (the gang resumes from the peers' copies or storage)."""
STORE_CONNECT_S = 60.0
"""How long a supervisor tries to reach pod 0's store at its start."""
STORE_POD_CONNECT_S = generations.FIRST_JOIN_TIMEOUT_S
"""... and the store pod's (``dedicated``): a pod scheduled on its own, which may start after
the trainer pods; as long as the first round waits for them."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the supervisor does on a failure (``runPolicy.recovery``, flags override)."""

    in_place: bool
    """Recover in place; False: any retryable failure stops the pod with 75."""
    in_place_limit: int
    """In-place recoveries per gang attempt."""
    warm_spares: int
    """Spare processes kept per pod."""
    rejoin_timeout_s: float
    """How long a round waits for every rank."""
    stall_timeout_s: float = 0.0
    """How long the store's host lets rank 0 make no progress before it takes the gang for hung
    (:mod:`.recovery.stall`; 0: never)."""
    store_pod: bool = False
    """The store runs in a pod of its own (``rendezvousStore: dedicated``): no supervisor hosts it
    or watches the others' heartbeats, and pod 0 is replaced like any other pod."""


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.trainer.supervise",
        description="Run this pod's trainer ranks, recovering failed ones in place.",
    )
    parser.add_argument("--nnodes", type=int, default=int(env("PET_NNODES", "1")))
    parser.add_argument("--nproc-per-node", type=int, default=int(env("PET_NPROC_PER_NODE", "1")))
    parser.add_argument("--node-rank", type=int, default=int(env("PET_NODE_RANK", "0")))
    parser.add_argument("--master-addr", default=env("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=int(env("MASTER_PORT", "29500")))
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=float(env("PET_SHUTDOWN_TIMEOUT", "30")),
        help="seconds the workers get after SIGTERM to save and leave",
    )
    parser.add_argument("--warm-spares", type=int, default=None, help="override the spec's")
    parser.add_argument("--in-place-limit", type=int, default=None, help="override the spec's")
    parser.add_argument("--rejoin-timeout", type=float, default=None, help="override the spec's")
    parser.add_argument(
        "--stall-timeout", type=float, default=None, help="override the spec's (0: never)"
    )
    parser.add_argument("--no-in-place", action="store_true", help="any failure: exit 75")
    parser.add_argument(
        "--store",
        choices=("pod0", "dedicated"),
        default=None,
        help="override the spec's rendezvousStore: pod 0 hosts the store, or a store pod does",
    )
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- trainer arguments")
    return parser


def spec_recovery(trainer_args: list[str]) -> run_policy.Recovery:
    """``runPolicy.recovery`` of the spec the workers will read, or its defaults.

    A spec that does not load is the workers' to refuse (exit 2, passed through).
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--spec", default=os.environ.get("MESHTRAIN_SPEC_FILE"))
    known, _ = parser.parse_known_args(trainer_args)
    try:
        job = loading.load_spec_file(known.spec) if known.spec else None
    except (loading.SpecError, OSError):
        job = None
    return job.run_policy.recovery if job is not None else run_policy.Recovery()


def settings(args: argparse.Namespace) -> Settings:
    spec = spec_recovery(args.trainer_args)
    mode = _store_mode(args.store)
    return Settings(
        in_place=spec.in_place and not args.no_in_place,
        in_place_limit=int(_pick(args.in_place_limit, spec.in_place_limit)),
        warm_spares=max(
            0, min(int(_pick(args.warm_spares, spec.warm_spares)), args.nproc_per_node)
        ),
        rejoin_timeout_s=float(_pick(args.rejoin_timeout, spec.rejoin_timeout_seconds)),
        stall_timeout_s=float(_pick(args.stall_timeout, spec.stall_timeout_seconds)),
        store_pod=mode == "dedicated" if mode else spec.dedicated_store,
    )


STORE_ENV = "MESHTRAIN_RECOVERY_RENDEZVOUS_STORE"
"""Set by the operator with ``MASTER_ADDR`` (``pod0`` or ``dedicated``): the pod follows the store
its gang was made with, even after an edit of the spec's ``rendezvousStore``."""


def _store_mode(flag: str | None) -> str | None:
    """``--store``, else the operator's :data:`STORE_ENV`, else None (the spec decides)."""
    mode = flag or os.environ.get(STORE_ENV)
    return mode if mode in ("pod0", "dedicated") else None


def _pick(flag: Any, value: Any) -> Any:
    return value if flag is None else flag


def classify(code: int) -> str:
    """``done`` (0), ``superseded`` (the worker was fenced off), ``final`` (a permanent code,
    STOPPED, or GANG_RESTART from a worker that gave up: pass it through) or ``failed``."""
    if code == 0:
        return "done"
    if code == rendezvous.SUPERSEDED:
        return "superseded"
    if code in exitcodes.PERMANENT or code in (exitcodes.STOPPED, exitcodes.GANG_RESTART):
        return "final"
    return "failed"


def cause(code: int) -> str:
    """A failure's cause as the records name it: ``SIGKILL``, ``exit 1``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _say(pod: int, message: str) -> None:
    print(f"meshtrain supervise pod {pod}: {message}", file=sys.stderr, flush=True)


class Supervisor:
    """One pod's supervisor (see the module)."""

    def __init__(self, args: argparse.Namespace, config: Settings, store: Any) -> None:
        self.args = args
        self.config = config
        self.store = store
        self.pod = args.node_rank
        self.local = args.nproc_per_node
        self.world = args.nnodes * args.nproc_per_node
        self.trainer_args = [a for a in args.trainer_args if a != "--"]
        self.pool = spares.Pool(self.child_env(), config.warm_spares)
        self.workers: dict[int, spares.Child] = {}
        self.finished: set[int] = set()
        self.stopping = False
        self.identity = os.environ.get(rendezvous.POD_UID_ENV) or uuid.uuid4().hex
        self.incarnation = rendezvous.Incarnation(self.pod, 0, self.identity)
        self.beats = Heartbeats(self)
        self.rank0_finished = False
        self.devices = device_fault.DeviceFailures(
            on_node=device_fault.node_error_since(os.environ, time.monotonic(), time.time())
        )
        # This pod's node (downward API; empty outside Kubernetes), named in the failures of its
        # own ranks: a record keeps it after the pod is replaced elsewhere.
        node = os.environ.get(context.NODE_ENV, "")
        self.node = node if kube_names.is_node_name(node) else ""

    def failure(self, tier: str, cause: str, ranks: tuple[int, ...]) -> rendezvous.Failure:
        """A failure of this pod's own ``ranks`` in this incarnation, observed now, on this node."""
        return rendezvous.Failure(tier, cause, ranks, time.time(), node=self.node)

    # -- children ------------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[generations.SUPERVISED_ENV] = generations.Settings(
            self.config.in_place_limit, self.config.rejoin_timeout_s, self.config.in_place
        ).dumps()
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING
        if env.get("MESHTRAIN_DEVICE") == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, host_model.host_cores() // self.local)))
        return env

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """torchrun's variables for ``local_rank`` of this pod."""
        return {
            "RANK": str(self.pod * self.local + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.local),
            "GROUP_RANK": str(self.pod),
            "MASTER_ADDR": self.args.master_addr,
            "MASTER_PORT": str(self.args.master_port),
            rendezvous.INCARNATION_ENV: self.incarnation.dumps(),
        }

    def start(self, local_rank: int, child: spares.Child) -> None:
        spares.assign(child, local_rank, self.rank_env(local_rank), self.trainer_args)
        self.workers[local_rank] = child

    def replace(self, local_rank: int) -> None:
        """Give ``local_rank`` to a spare (a cold process if none is left) and start another spare."""
        child, warm = self.pool.take()
        self.start(local_rank, child)
        self.pool.refill()
        _say(
            self.pod,
            f"rank {self.pod * self.local + local_rank} taken by {'spare' if warm else 'new process'}"
            f" pid {child.pid} (started {time.time() - child.started_at:.1f}s ago)",
        )

    def stop_workers(self, grace: float) -> list[int]:
        """SIGTERM every live worker, SIGKILL what is left after ``grace``; their exit codes."""
        self.pool.close()
        procs = [w.proc for w in self.workers.values()]
        launch.stop_processes(procs, grace)
        return [proc.returncode for proc in procs]

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        """Start the workers and the spares, then watch them until the pod's exit code is known."""
        rendezvous.init_generation(self.store)
        taken = rendezvous.take_incarnation(
            self.store, self.pod, self.identity, uid=os.environ.get(rendezvous.POD_UID_ENV, "")
        )
        if taken is None:
            progress.write_failure(rendezvous.SUPERSEDED, "this pod was replaced by another")
            return self.superseded()
        self.incarnation = taken
        if self.incarnation.number > 1:
            ranks = tuple(range(self.pod * self.local, (self.pod + 1) * self.local))
            # no node: the ranks failed in an earlier incarnation, which may have run elsewhere
            failure = rendezvous.Failure("container", "container restarted", ranks, time.time())
            _say(self.pod, "restarted: joining the next round")
            rendezvous.ranks_failed(self.store, ranks, failure, self.config.in_place_limit)
        for local_rank in range(self.local):
            self.start(local_rank, self.pool.spawn())
        self.pool.refill()
        for local_rank, child in sorted(self.workers.items()):
            _say(self.pod, f"rank {self.pod * self.local + local_rank} pid {child.pid}")
        _say(self.pod, f"spares {[s.pid for s in self.pool.spares]}")
        self.beats.start()
        errors = generations.StoreErrors()
        changes = rendezvous.ChangeGate(self.store)
        while True:
            if self.stopping:
                return self.stop()
            try:
                code = self.read_store() if changes.moved() else None
                errors.ok()
            except (RuntimeError, OSError):
                if errors.failed():  # several failed reads over seconds: the store is gone
                    raise
                changes.forget()
                time.sleep(POLL_S)
                continue
            if code is None:
                code = self.check_workers()
            if code is not None:
                return code
            self.reap_orphans()
            time.sleep(POLL_S)

    def read_store(self) -> int | None:
        """What the store says: superseded, rank 0 finished, the gang halted (the exit code)."""
        if rendezvous.superseded(self.store, self.incarnation):
            return self.superseded()
        self.rank0_finished = self.rank0_finished or bool(self.store.check([rendezvous.FINISHED]))
        code = rendezvous.halted(self.store)
        if code is not None:
            _say(self.pod, f"the gang was halted with {code}")
            codes = self.stop_workers(self.args.shutdown_timeout)
            if code == exitcodes.GANG_RESTART:  # a worker of this pod may have failed so meanwhile
                why = "in-place recovery exhausted or impossible (limit, rejoin timeout)"
                self.report_rebuild(why, self.failed(codes))
        return code

    def check_workers(self) -> int | None:
        """React to the workers that exited; the pod's exit code once it is known."""
        probed: list[list[str] | str | None] = []  # NVML is asked once per pass at most
        for local_rank, child in sorted(self.workers.items()):
            code = child.proc.poll()
            if code is None or local_rank in self.finished:
                continue
            verdict = classify(code)
            if verdict == "done":
                self.finished.add(local_rank)
                continue
            rank = self.pod * self.local + local_rank
            if verdict == "superseded":
                return self.superseded()
            if verdict == "final":
                _say(self.pod, f"rank {rank} exited {code}: passing it through")
                if code != exitcodes.STOPPED:  # a stop is agreed by the ranks themselves
                    rendezvous.halt(self.store, code)
                codes = self.stop_workers(self.args.shutdown_timeout)
                if code == exitcodes.GANG_RESTART:  # the worker read the halt before this pod did
                    self.report_rebuild(f"rank {rank} left for a gang rebuild", self.failed(codes))
                return code
            _say(self.pod, f"rank {rank} pid {child.pid} failed ({cause(code)})")
            if code == exitcodes.DEVICE_LOST:  # gone for good: no count, in place or not
                return self.leave_bad_device(rank, local_rank, lost=True)
            if not probed:
                probed.append(self.probe_gpus(code))
            found = probed[0]
            if isinstance(found, list) and found:  # its error did not say; the driver does
                return self.leave_bad_device(rank, local_rank, lost=True, gpu="; ".join(found))
            hung = found == gpu_probe.HUNG  # a driver that does not answer: a device error
            if (code == exitcodes.DEVICE_ERROR or hung) and self.devices.failed(
                local_rank, time.monotonic()
            ):
                return self.leave_bad_device(rank, local_rank, lost=False, hung=hung)
            if not self.config.in_place:
                return self.give_up(
                    f"rank {rank} failed ({cause(code)}); in-place recovery is off",
                    device_error_ranks=(rank,) if code == exitcodes.DEVICE_ERROR or hung else (),
                )
            failure = self.failure("process", cause(code), (rank,))
            rendezvous.ranks_failed(self.store, (rank,), failure, self.config.in_place_limit)
            if rendezvous.halted(self.store) is None:
                self.replace(local_rank)
            elif code == exitcodes.DEVICE_ERROR:  # a peer's halt came first: named beside it
                rendezvous.name_device_ranks(self.store, (rank,))
        if len(self.finished) == self.local:
            self.pool.close()
            return 0
        return None

    def reap_orphans(self) -> None:
        """As a container's PID 1, collect exited orphans (a killed worker's own children), never
        one of this supervisor's children, whose code ``Popen.poll`` reads."""
        for spare in self.pool.spares:
            spare.proc.poll()  # a spare that died is collected here, not left in the way
        ours = {w.pid for w in self.workers.values()} | {s.pid for s in self.pool.spares}
        for _ in range(MAX_REAPED):
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid in ours:
                return
            os.waitpid(found.si_pid, 0)

    def probe_gpus(self, code: int) -> list[str] | str | None:
        """What NVML says of this pod's GPUs after a worker exited with ``code`` without a device
        error's words (:mod:`.recovery.gpu_probe`; None: not asked, for a job run on the CPU or
        after an error that named the device, or no verdict)."""
        if code == exitcodes.DEVICE_ERROR or os.environ.get("MESHTRAIN_DEVICE") == "cpu":
            return None
        return gpu_probe.probe()

    def leave_bad_device(
        self, rank: int, local_rank: int, lost: bool, gpu: str | None = None, hung: bool = False
    ) -> int:
        """Stop this pod's ranks and leave with :data:`exitcodes.DEVICE_SUSPECT`, for the operator
        to place the pod elsewhere (``gpu``: the GPUs NVML calls lost, when rank ``rank``'s own
        error did not say; ``hung``: the second strike was NVML not answering).  The ranks are
        stopped first (none joins a round the pod leaves), then the gang told: its ranks are
        failed, and the round waits for the pod's replacement; a pod hosting the store, or one
        whose gang does not recover in place, halts the gang instead and does not linger (the
        operator rebuilds the gang without the node)."""
        window = f"{device_fault.SUSPECT_WINDOW_S:.0f} s"
        what = "is gone" if lost else f"failed twice within {window}"
        if not lost and self.devices.struck_by_node:
            what = (
                f"failed within {window} of a device error of this job on this node before this "
                f"pod started ({exitcodes.DEVICE_ERROR_AT_ENV})"
            )
        if hung:
            what += f" (the last time NVML did not answer within {gpu_probe.TIMEOUT_S:.0f} s)"
        whose = (
            f"rank {rank}'s GPU ({device_fault.which_gpu(local_rank, os.environ)})"
            if gpu is None
            else f"rank {rank} failed and NVML says a GPU of this pod ({gpu})"
        )
        why = f"{whose} {what}: taking it for bad; this pod leaves to be placed on another node"
        if any(os.environ.get(name) for name in pod_spec.FAULT_ENV_NAMES):
            why += " (a drill: the job sets MESHTRAIN_FAULT_*; the node may be healthy)"
        _say(self.pod, f"{why}: exit {exitcodes.DEVICE_SUSPECT}")
        self.stop_workers(min(LEAVE_GRACE_S, self.args.shutdown_timeout))
        if self.beats.watch is not None or not self.config.in_place:  # no round to wait in
            rendezvous.halt(self.store, exitcodes.GANG_RESTART)
        else:
            ranks = tuple(range(self.pod * self.local, (self.pod + 1) * self.local))
            reason = "GPU lost" if lost else "GPU failed twice"
            failure = self.failure("pod", reason, ranks)
            rendezvous.ranks_failed(self.store, ranks, failure, self.config.in_place_limit)
        progress.write_failure(exitcodes.DEVICE_SUSPECT, why)
        return exitcodes.DEVICE_SUSPECT

    def give_up(self, why: str, device_error_ranks: tuple[int, ...] = ()) -> int:
        """Halt the gang for a rebuild (75), leaving the reason in the termination log, with the
        ranks whose GPU failed just before (the operator keeps their node's error past the
        rebuild: ``status.deviceErrors``)."""
        _say(self.pod, f"{why}: exit {exitcodes.GANG_RESTART} (gang rebuild)")
        rendezvous.halt(self.store, exitcodes.GANG_RESTART, device_error_ranks)
        self.report_rebuild(why, device_error_ranks)
        self.stop_workers(self.args.shutdown_timeout)
        return exitcodes.GANG_RESTART

    def failed(self, codes: list[int]) -> tuple[int, ...]:
        """The ranks of this pod whose workers ended with a device error or a GPU gone, from the
        codes :meth:`stop_workers` returned (in the order of ``self.workers``)."""
        ranks = [self.pod * self.local + local for local in self.workers]
        device = (exitcodes.DEVICE_ERROR, exitcodes.DEVICE_LOST)
        return tuple(r for r, c in zip(ranks, codes, strict=True) if c in device)

    def report_rebuild(self, why: str, own: tuple[int, ...] = ()) -> None:
        """Leave 75 and ``why`` in the termination log, with the ranks whose device error caused
        the rebuild: ``own`` and those the halt in force names (the operator keeps their nodes'
        errors, ``status.deviceErrors``, from whichever pod's exit it reads first)."""
        try:
            rendezvous.name_device_ranks(self.store, own)
            named = rendezvous.named_device_ranks(self.store)
        except (RuntimeError, OSError):  # the store left with pod 0: this pod's own say
            named = ()
        ranks = tuple(sorted({*own, *named}))
        progress.write_failure(exitcodes.GANG_RESTART, why, ranks)

    def superseded(self) -> int:
        """A newer incarnation of this pod runs: stop the workers, leave the gang alone."""
        _say(self.pod, f"superseded by a newer incarnation: exit {rendezvous.SUPERSEDED}")
        self.stop_workers(self.args.shutdown_timeout)
        return rendezvous.SUPERSEDED

    def stop(self) -> int:
        """SIGTERM: the workers stop after a checkpoint of the same step.

        0 when every worker had finished, a permanent code one of them exited with, else
        ``STOPPED``, also when a worker died before it could save (SIGTERM during its start, or
        SIGKILL after the grace): the pod was stopped from outside (deleted, evicted, refused by
        a restarted kubelet), which is never the trainer giving up in place (``GANG_RESTART``),
        and the kubelet names why in the pod's status.
        """
        _say(self.pod, "SIGTERM: asking the workers to save and stop")
        codes = self.stop_workers(self.args.shutdown_timeout)
        permanent = [c for c in codes if c in exitcodes.PERMANENT]
        if permanent:
            return permanent[0]
        if all(c == 0 for c in codes):
            return 0
        unsaved = [cause(c) for c in codes if c not in (0, exitcodes.STOPPED)]
        if unsaved:
            _say(self.pod, f"workers ended without saving: {', '.join(unsaved)}")
        return exitcodes.STOPPED

    def linger(self, code: int) -> None:
        """Say this pod left; pod 0 hosting the store keeps it up until every supervisor left, or
        no other pod's heartbeat moves any more, within the shutdown timeout (at least
        :data:`LINGER_S`).

        A pod says it left only when it finished (0) or the gang was halted: one stopped alone
        (143) or fenced off (76) leaves its slot to a replacement that the store's host must
        watch, and must not count as done at the run's end.
        """
        watch = self.beats.watch  # None: this pod hosts no store
        if code == exitcodes.DEVICE_SUSPECT:
            # leaving a bad GPU, pod 0 has halted the gang: the others read the halt or lose the
            # store, 75 either way, after its own exit, which names the cause to the operator
            return
        if watch is None and code != 0 and rendezvous.halted(self.store) is None:
            return
        self.store.set(rendezvous.left_key(self.pod), "1")
        left = self.store.add(rendezvous.DONE, 1)
        if watch is None:
            return
        deadline = time.monotonic() + max(LINGER_S, self.args.shutdown_timeout)
        while left < self.args.nnodes and time.monotonic() < deadline:
            if not watch.alive(store_host.QUIET_S):
                return
            time.sleep(POLL_S)
            left = self.store.add(rendezvous.DONE, 0)

    def finished_anyway(self) -> int | None:
        """The store went away after rank 0 passed its final barrier: 0 when this pod's workers
        finish too (within the shutdown timeout), else None."""
        if not self.rank0_finished:
            return None
        deadline = time.monotonic() + self.args.shutdown_timeout
        for child in self.workers.values():
            try:
                code = child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
            if code != 0:
                return None
        self.pool.close()
        return 0


class Heartbeats(threading.Thread):
    """Bumps this pod's heartbeat on its own store connection (the main loop may block in
    ``stop_workers``); pod 0's, when it hosts the store, also declares pods whose heartbeat
    stopped lost (:class:`.liveness.PodWatch`) and a gang that stopped making progress hung
    (:class:`.stall.StallWatch`)."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__(name="heartbeats", daemon=True)
        self.supervisor = supervisor
        self.store = supervisor.store.clone()
        self.heartbeat = 0
        hosts = supervisor.pod == 0 and not supervisor.config.store_pod
        self.watch = (
            liveness.PodWatch(
                self.store,
                range(1, supervisor.args.nnodes),
                supervisor.local,
                supervisor.config.in_place_limit,
                functools.partial(_say, supervisor.pod),
            )
            if hosts
            else None
        )
        config = supervisor.config
        self.stalls = (
            stall.StallWatch(
                self.store,
                supervisor.args.nnodes * supervisor.local,
                config.stall_timeout_s,
                config.in_place_limit if config.in_place else 0,
                functools.partial(_say, supervisor.pod),
            )
            if hosts
            else None
        )
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(liveness.HEARTBEAT_S):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the main loop decides whether the store is gone
                continue

    def stop(self) -> None:
        self._stopping.set()

    def beat(self) -> None:
        """Bump this pod's heartbeat; the host's also looks for pods whose heartbeat stopped."""
        self.heartbeat += 1
        self.store.set(liveness.heartbeat_key(self.supervisor.pod), str(self.heartbeat))
        if self.watch is not None:
            self.watch.look()
        if self.stalls is not None:
            self.stalls.look()


def loopback_command(pods: int, local: int, pod: int, port: int, *flags: str) -> list[str]:
    """The command of pod ``pod``'s supervisor when ``pods`` supervisors share this machine
    (tests and benchmarks; a pod runs it with its ``PET_*`` environment instead)."""
    return [
        sys.executable,
        "-m",
        "meshtrain.trainer.supervise",
        f"--nnodes={pods}",
        f"--nproc-per-node={local}",
        f"--node-rank={pod}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        *flags,
    ]


def loopback_env(spec: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, str]:
    """The environment of loopback supervisors on the CPU (tests and benchmarks): the spec, logs
    under ``out/logs``, checkpoints under ``out/checkpoints``, one thread per rank."""
    return {
        **os.environ,
        "MESHTRAIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "MESHTRAIN_SPEC_FILE": str(spec),
        "MESHTRAIN_LOG_DIR": os.path.join(out, "logs"),
        "MESHTRAIN_CHECKPOINT_DIR": os.path.join(out, "checkpoints"),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("MESHTRAIN_JOB_STARTED_AT", f"{time.time():.3f}")  # goodput's wall start
    config = settings(args)
    try:
        store = rendezvous.connect(
            args.master_addr,
            args.master_port,
            master=args.node_rank == 0 and not config.store_pod,
            timeout_s=STORE_POD_CONNECT_S if config.store_pod else STORE_CONNECT_S,
        )
        # the long wait is for the connection only: a store call that hangs (its node gone
        # silent) must fail as soon as it would with pod 0's store
        store.set_timeout(datetime.timedelta(seconds=STORE_CONNECT_S))
    except (RuntimeError, OSError) as err:
        why = f"cannot reach the rendezvous store {args.master_addr}:{args.master_port}: {err}"
        _say(args.node_rank, why)
        progress.write_failure(exitcodes.GANG_RESTART, why)
        return exitcodes.GANG_RESTART
    supervisor = Supervisor(args, config, store)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        code = supervisor.run()
    except (
        RuntimeError,
        OSError,
    ) as err:  # the store is gone: its host (pod 0, the store pod) was lost
        done = supervisor.finished_anyway()
        if done is not None:
            _say(args.node_rank, f"the store left after rank 0 finished ({err}): exit 0")
            return done
        _say(args.node_rank, f"lost the rendezvous store ({err})")
        supervisor.stop_workers(args.shutdown_timeout)
        progress.write_failure(exitcodes.GANG_RESTART, f"lost the rendezvous store: {err}")
        return exitcodes.GANG_RESTART
    try:
        supervisor.linger(code)
    except (RuntimeError, OSError):
        pass
    finally:
        supervisor.beats.stop()
    _say(args.node_rank, f"exit {code}")
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: with the store's server gone, a store client's destructor or a
    # heartbeat still inside a store call can throw in C++ at finalisation, and std::terminate
    # turns the exit code into SIGABRT (seen under load: -6 instead of 75, a lost gang rebuild).
    os._exit(exit_code)
