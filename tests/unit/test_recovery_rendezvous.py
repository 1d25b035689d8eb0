"""The rendezvous protocol on a real TCPStore: one bump per failure (threads racing), reports, the
limit, joins counted once per rank, fencing of old incarnations; the supervisor's code classes;
the abort's choices."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import threading
import time

import pytest
import torch.distributed

from meshtrain.api import exitcodes
from meshtrain.api.spec import run_policy as api_run_policy
from meshtrain.operator.policy import progress_report
from meshtrain.trainer import launch, supervise
from meshtrain.trainer.recovery import abort, generations, rendezvous, spares
from meshtrain.trainer.telemetry import context, recoveries

POD0 = rendezvous.Incarnation(0, 1, "pod-0-uid")


@pytest.fixture
def store():
    return rendezvous.connect("127.0.0.1", launch.free_port(), master=True, timeout_s=10)


def join(store, round_, rank, world, timeout_s, *, member="a", incarnation=POD0, **kwargs):
    return rendezvous.join(
        store, round_, rank, world, timeout_s, member=member, incarnation=incarnation, **kwargs
    )


def failure(*ranks: int, tier: str = "process", cause: str = "SIGKILL") -> rendezvous.Failure:
    return rendezvous.Failure(tier, cause, ranks, time.time())


def test_a_new_store_starts_at_generation_zero_and_keeps_it(store):
    assert rendezvous.init_generation(store) == 0
    store.set(rendezvous.GENERATION, "3")
    assert rendezvous.init_generation(store) == 3


def test_two_observers_of_one_failure_bump_once(store):
    rendezvous.init_generation(store)
    first = rendezvous.start_round(store, 0, failure(3), limit=10)
    second = rendezvous.start_round(store, 0, failure(tier="process", cause="peer lost"), limit=10)
    assert (first, second) == (True, False)
    assert rendezvous.generation(store) == 1
    summary = rendezvous.summary(store, 1)
    assert summary["cause"] == "SIGKILL" and summary["ranks"] == (3,)
    assert summary["detected_at"] >= summary["failed_at"]


LONG_NODE = f"{'a' * 40}.{'b' * 40}"
"""A Node's name too long for a recovery record (81 characters)."""


def test_a_round_names_the_nodes_its_failed_ranks_ran_on_where_their_observers_said(store):
    """Reports of an observer on the failed ranks' node name it; a peer's report (no node), an
    older trainer's report (no key) and a name no Node can have leave their ranks unnamed.  The
    round names every node; its record keeps the lowest ranks' two whose names fit it."""
    rendezvous.init_generation(store)
    reports = [
        rendezvous.Failure("process", "exit 78", (5,), time.time(), node="node-c"),
        rendezvous.Failure("process", "exit 78", (3,), time.time(), node="node-b"),
        rendezvous.Failure("pod", "GPU failed twice", (2, 3), time.time(), node="node-b"),
        rendezvous.Failure("pod", "pod lost", (6, 7), time.time()),  # a peer's observation
        rendezvous.Failure("process", "exit 1", (1,), time.time(), node=LONG_NODE),
        rendezvous.Failure("process", "exit 1", (4,), time.time(), node="Not a node!"),
    ]
    for report in reports:
        rendezvous.report(store, 1, report)
    older = b'{"tier": "process", "cause": "exit 1", "ranks": [0], "at": 1.0}'
    store.set(f"rdzv/r1/fail{store.add('rdzv/r1/nfail', 1)}", older)
    nodes = [f.node for f in rendezvous.failures(store, 1)]
    assert nodes == ["node-c", "node-b", "node-b", "", LONG_NODE, "", ""]
    summary = rendezvous.summary(store, 1)
    assert summary["ranks"] == (0, 1, 2, 3, 4, 5, 6, 7)
    assert summary["nodes"] == {LONG_NODE: (1,), "node-b": (2, 3), "node-c": (5,)}
    record = recoveries.Recovery(1, "process", "exit 78", (3,), 1.0, 1.0, 1.0, 1.0, 0, "none", 0)
    written = dataclasses.replace(record, nodes=summary["nodes"]).to_json()["nodes"]
    assert written == [{"node": "node-b", "ranks": [2, 3]}, {"node": "node-c", "ranks": [5]}]


def test_a_rank_that_had_not_joined_the_round_only_reports_to_it(store):
    rendezvous.init_generation(store)
    join(store, 0, 0, 1, timeout_s=1)  # rank 0 joined round 0, rank 1 never did
    assert rendezvous.ranks_failed(store, (1,), failure(1), limit=10) == 0
    assert rendezvous.generation(store) == 0
    assert rendezvous.ranks_failed(store, (0,), failure(0), limit=10) == 1
    assert rendezvous.generation(store) == 1


def test_past_the_limit_the_gang_is_halted_for_a_rebuild(store):
    rendezvous.init_generation(store)
    assert rendezvous.start_round(store, 0, failure(1), limit=1)
    assert not rendezvous.start_round(store, 1, failure(1), limit=1)
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART
    assert join(store, rendezvous.generation(store), 0, 1, timeout_s=1) == "halt"
    assert rendezvous.halt(store, exitcodes.SPEC) == exitcodes.GANG_RESTART  # the first code stays


def test_a_halt_past_the_budget_after_a_device_error_names_its_rank_beside_a_bare_code(store):
    """The halt stays a bare number (every trainer release reads it); the device error's rank is
    named beside it, and a second pod's failed rank merges in, by threads racing on one store."""
    rendezvous.init_generation(store)
    device = failure(3, cause=exitcodes.DEVICE_ERROR_CAUSE)
    assert not rendezvous.start_round(store, 0, device, limit=0)
    assert store.get(rendezvous.HALT) == str(exitcodes.GANG_RESTART).encode()
    assert rendezvous.named_device_ranks(store) == (3,)
    writers = [
        threading.Thread(target=rendezvous.name_device_ranks, args=(store.clone(), (r,)))
        for r in (5, 9, 3)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(10)
    assert rendezvous.named_device_ranks(store) == (3, 5, 9)
    rendezvous.name_device_ranks(store, ())  # nothing to name: nothing written
    assert rendezvous.named_device_ranks(store) == (3, 5, 9)


def test_a_halt_for_another_cause_names_no_rank(store):
    rendezvous.init_generation(store)
    assert not rendezvous.start_round(store, 0, failure(1), limit=0)
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART
    assert rendezvous.named_device_ranks(store) == ()


def test_after_a_quiet_stretch_the_in_place_budget_starts_again(store, monkeypatch):
    rendezvous.init_generation(store)
    now = [1_000_000.0]
    monkeypatch.setattr(rendezvous.time, "time", lambda: now[0])
    assert rendezvous.start_round(store, 0, failure(1), limit=1)
    now[0] += api_run_policy.STEADY_RUNNING_SECONDS
    assert rendezvous.start_round(store, 1, failure(1), limit=1), "counted anew"
    assert rendezvous.halted(store) is None and rendezvous.generation(store) == 2
    now[0] += api_run_policy.STEADY_RUNNING_SECONDS - 1
    assert not rendezvous.start_round(store, 2, failure(1), limit=1), "2 within the stretch"
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART


def test_each_round_is_counted_once_by_tier_whoever_asks(store):
    rendezvous.init_generation(store)
    assert rendezvous.counted(store, 1, "process") == {"process": 1, "container": 0, "pod": 0}
    assert rendezvous.counted(store, 1, "process")["process"] == 1, "a new rank 0 asks again"
    assert rendezvous.counted(store, 2, "pod") == {"process": 1, "container": 0, "pod": 1}


def test_the_widest_tier_names_the_round(store):
    rendezvous.init_generation(store)
    rendezvous.start_round(store, 0, failure(2, 3, tier="pod", cause="pod lost"), limit=10)
    rendezvous.report(store, 1, failure(2, 3, tier="container", cause="container restarted"))
    summary = rendezvous.summary(store, 1)
    assert summary["tier"] == "pod" and summary["ranks"] == (2, 3)


def test_a_join_waits_for_every_rank_and_sees_a_newer_round(store):
    rendezvous.init_generation(store)
    assert join(store, 0, 0, 2, timeout_s=0.2) == "timeout"
    assert join(store, 0, 1, 2, timeout_s=1, member="b") == "ready"
    store.set(rendezvous.GENERATION, "1")
    assert join(store, 0, 0, 2, timeout_s=1) == "moved"
    rendezvous.halt(store, exitcodes.GANG_RESTART)
    assert join(store, 1, 0, 2, timeout_s=1) == "halt"


def test_a_garbled_report_is_skipped(store):
    store.add("rdzv/r1/nfail", 1)
    store.set("rdzv/r1/fail1", "not json" * 1000)
    assert rendezvous.failures(store, 1) == []


@pytest.mark.parametrize(
    ("code", "verdict"),
    [
        (0, "done"),
        (exitcodes.SPEC, "final"),
        (exitcodes.CHECKPOINT, "final"),
        (exitcodes.STOPPED, "final"),
        (exitcodes.GANG_RESTART, "final"),
        (1, "failed"),
        (17, "failed"),
        (-signal.SIGKILL, "failed"),
    ],
)
def test_worker_codes_are_classified(code, verdict):
    assert supervise.classify(code) == verdict


def test_causes_name_signals():
    assert supervise.cause(-signal.SIGKILL) == "SIGKILL" and supervise.cause(1) == "exit 1"


def test_communication_errors_are_told_from_a_ranks_own():
    gloo = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer"
    )
    assert generations.communication_error(gloo)
    assert generations.communication_error(torch.distributed.DistBackendError("NCCL error"))
    assert not generations.communication_error(
        RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    )


def test_a_replacement_fences_the_pod_it_replaces(store):
    old, new = "uid-old", "uid-new"
    assert rendezvous.claim_slot(store, 2, old)
    assert rendezvous.claim_slot(store, 2, old)  # its container restarted: still its slot
    assert rendezvous.claim_slot(store, 2, new)  # the replacement takes node rank 2
    assert not rendezvous.claim_slot(store, 2, old)  # the old pod, back later, stays fenced
    assert rendezvous.claim_slot(store, 2, new)
    assert rendezvous.claim_slot(store, 1, old) is False  # fenced for every slot
    assert rendezvous.claim_slot(store, 1, "")


def test_a_fenced_supervisor_exits_and_leaves_the_gang_alone(store, monkeypatch, tmp_path):
    """The old pod's supervisor starts again (its node came back) after the replacement took
    node rank 1: it starts no worker, exits FENCED, says why, and halts nothing."""
    assert rendezvous.claim_slot(store, 1, "uid-old")
    assert rendezvous.claim_slot(store, 1, "uid-new")
    monkeypatch.setenv("MESHTRAIN_POD_UID", "uid-old")
    monkeypatch.setenv("MESHTRAIN_TERMINATION_LOG", str(tmp_path / "termination"))
    argv = ["--node-rank", "1", "--nnodes", "2", "--warm-spares", "0"]
    args = supervise.build_parser().parse_args(argv)
    supervisor = supervise.Supervisor(args, supervise.settings(args), store)
    assert supervisor.run() == exitcodes.FENCED
    assert not supervisor.workers and rendezvous.halted(store) is None
    assert "replaced" in (tmp_path / "termination").read_text()


def race(store, count: int, call) -> list:
    """``call(client, i)`` from ``count`` threads at once, each on its own connection."""
    clients = [store.clone() for _ in range(count)]
    results: list = [None] * count
    gate = threading.Barrier(count)

    def one(i: int) -> None:
        gate.wait()
        results[i] = call(clients[i], i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_racing_claimants_bump_once_and_count_one_restart(store):
    rendezvous.init_generation(store)
    won = race(store, 8, lambda c, i: rendezvous.start_round(c, 0, failure(i), 10, token=f"t{i}"))
    assert won.count(True) == 1
    assert rendezvous.generation(store) == 1
    assert int(store.get(rendezvous.IN_PLACE)) == 1
    winner = won.index(True)
    assert store.get(rendezvous.GENERATION) == f"1:t{winner}".encode()  # the bump is the claim
    assert len(rendezvous.failures(store, 1)) == 8  # every observer's report kept


def test_a_claim_on_a_moved_round_fails_without_a_second_bump(store):
    rendezvous.init_generation(store)
    assert rendezvous.start_round(store, 0, failure(1), 10)
    assert not rendezvous.start_round(store, 0, failure(tier="process", cause="peer lost"), 10)
    assert rendezvous.generation(store) == 1 and int(store.get(rendezvous.IN_PLACE)) == 1


def test_a_worker_never_joins_a_round_twice_and_waits_for_it_to_move(store):
    rendezvous.init_generation(store)
    assert join(store, 0, 0, 2, timeout_s=0.2) == "timeout"
    # its collective failed, the claim was lost: joining the old round again counts nothing ...
    assert join(store, 0, 0, 2, timeout_s=0.2) == "timeout"
    assert store.add("rdzv/g0/joined", 0) == 1
    # ... and it returns once another caller's bump moves the round
    later = threading.Timer(0.3, lambda: rendezvous.start_round(store.clone(), 0, failure(1), 10))
    later.start()
    assert join(store, 0, 0, 2, timeout_s=10) == "moved"
    later.join()
    assert rendezvous.generation(store) == 1


def test_interleaved_joins_count_each_rank_once(store):
    rendezvous.init_generation(store)
    # two processes claim rank 1 at once (a replacement while the old one still runs): one counts
    outcomes = race(store, 2, lambda c, i: join(c, 0, 1, 2, 0.5, member=f"p{i}"))
    assert sorted(outcomes) == ["timeout", "timeout"]
    assert store.add("rdzv/g0/joined", 0) == 1
    assert join(store, 0, 0, 2, timeout_s=2, member="r0") == "ready"


def test_an_older_incarnation_is_fenced_off(store):
    rendezvous.init_generation(store)
    old = rendezvous.take_incarnation(store, 1, "uid-old")
    new = rendezvous.take_incarnation(store, 1, "uid-new")
    assert (old.number, new.number) == (1, 2)
    assert rendezvous.superseded(store, old) and not rendezvous.superseded(store, new)
    assert join(store, 0, 2, 4, 0.2, incarnation=old) == "superseded"
    assert store.add("rdzv/g0/joined", 0) == 0
    assert rendezvous.Incarnation.loads(1, new.dumps()) == new


def test_a_rank_key_held_by_a_newer_incarnation_fences_the_older(store):
    rendezvous.init_generation(store)
    older = rendezvous.Incarnation(1, 1, "uid-a")
    newer = rendezvous.Incarnation(1, 2, "uid-b")
    assert join(store, 0, 2, 4, 0.2, member="uid-b/7", incarnation=newer) == "timeout"
    assert join(store, 0, 2, 4, 0.2, member="uid-a/9", incarnation=older) == "superseded"
    assert store.add("rdzv/g0/joined", 0) == 1


def test_a_newer_incarnation_watching_a_superseded_process_is_told(store):
    rendezvous.init_generation(store)
    old = rendezvous.take_incarnation(store, 0, "uid")
    later = threading.Timer(0.3, lambda: rendezvous.take_incarnation(store.clone(), 0, "uid"))
    later.start()
    assert join(store, 0, 0, 2, timeout_s=10, incarnation=old) == "superseded"
    later.join()


def test_a_stop_during_a_rejoin_ends_the_wait(store):
    rendezvous.init_generation(store)
    assert join(store, 0, 0, 2, timeout_s=10, stopped=lambda: True) == "stopped"
    assert generations.JOIN_EXITS["stopped"] == exitcodes.STOPPED


def test_the_budget_left_is_what_start_round_allows(store, monkeypatch):
    """``recoveries_left`` (a rank stopped with its gang asks it before waiting in place) agrees
    with ``start_round``: one left, the round starts; none left, it would halt with 75."""
    rendezvous.init_generation(store)
    now = [1_000_000.0]
    monkeypatch.setattr(rendezvous.time, "time", lambda: now[0])
    assert rendezvous.recoveries_left(store, 1) == 1
    assert rendezvous.start_round(store, 0, failure(1), limit=1)
    assert rendezvous.recoveries_left(store, 1) == 0
    assert rendezvous.recoveries_left(store, 0) == 0
    now[0] += api_run_policy.STEADY_RUNNING_SECONDS
    assert rendezvous.recoveries_left(store, 1) == 1
    assert (
        rendezvous.start_round(store, 1, failure(1), limit=1) and rendezvous.halted(store) is None
    )


def test_a_rank_counted_in_a_round_that_leaves_it_moves_the_gang_on(store):
    """A stop during the join after the rank was counted: the round must not start without it
    (its peers would wait for the process-group timeout); one not counted moves nothing."""
    rendezvous.init_generation(store)
    assert join(store, 0, 0, 2, timeout_s=10, member="m0", stopped=lambda: True) == "stopped"
    rendezvous.leave(store, 0, 1, "m1", failure(1, cause="stopped in the join"), limit=10)
    assert rendezvous.generation(store) == 0, "rank 1 never joined: nothing to move"
    rendezvous.leave(store, 0, 0, "m0", failure(0, cause="stopped in the join"), limit=10)
    assert rendezvous.generation(store) == 1
    assert rendezvous.summary(store, 1)["cause"] == "stopped in the join"
    rendezvous.leave(store, 0, 0, "m0", failure(0), limit=10)  # a round already moved: no bump
    assert rendezvous.generation(store) == 1


def test_a_replacement_of_a_pod_that_said_it_left_is_watched_again(store):
    """A pod that finished or was halted says so (``pod{p}/left``: pod 0 stops watching its
    heartbeat); the pod that takes its slot next clears it."""
    store.set("rdzv/pod1/left", "1")
    assert rendezvous.take_incarnation(store, 1, "new", uid="uid-2") is not None
    assert not store.check(["rdzv/pod1/left"])


def test_a_garbled_generation_reads_as_no_round():
    assert rendezvous.number(b"7:abc") == 7 and rendezvous.number(b"x:1") == -1


def test_one_store_error_is_not_a_lost_store():
    errors = generations.StoreErrors(failures=3, span_s=0.2)
    assert not errors.failed() and not errors.failed()
    errors.ok()
    assert not errors.failed() and not errors.failed()
    time.sleep(0.25)
    assert errors.failed()


def test_the_abort_is_chosen_by_backend_and_bounded():
    sockets = abort.GlooSockets(1)
    called: list[str] = []
    left: list[int] = []
    abort.abort_groups(sockets, "gloo", nccl_abort=lambda: called.append("nccl"), leave=left.append)
    assert called == [] and left == []
    abort.abort_groups(sockets, "nccl", nccl_abort=lambda: called.append("nccl"), leave=left.append)
    assert called == ["nccl"] and left == []
    stuck = threading.Event()
    abort.abort_groups(sockets, "cpu:gloo,cuda:nccl", nccl_abort=stuck.wait, deadline_s=0.1,
                       leave=left.append)  # fmt: skip
    stuck.set()
    assert left == [abort.ABORT_STUCK]
    assert supervise.classify(abort.ABORT_STUCK) == "failed"  # the supervisor replaces it


def test_workers_get_nccl_error_handling_off_and_their_incarnation(store, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # what torch's docs warn against
    monkeypatch.setenv(rendezvous.POD_UID_ENV, "3f1c-uid")
    args = supervise.build_parser().parse_args(["--nnodes=2", "--node-rank=1", "--master-port=1"])
    sup = supervise.Supervisor(args, supervise.settings(args), store)
    sup.incarnation = rendezvous.take_incarnation(store, sup.pod, sup.identity)
    assert sup.child_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    handed = sup.rank_env(0)[rendezvous.INCARNATION_ENV]
    assert rendezvous.Incarnation.loads(1, handed) == rendezvous.Incarnation(1, 1, "3f1c-uid")
    assert supervise.classify(rendezvous.SUPERSEDED) == "superseded"


def test_a_supervisors_own_ranks_failure_names_its_node_in_the_rounds_record(
    store, monkeypatch, tmp_path
):
    """Pod 1's supervisor (on gpu-b by the downward API) reports rank 3's device error; rank 0's
    record of the round says gpu-b, and the operator's parser keeps it.  A node name no Node
    can have is not said."""
    monkeypatch.setenv(context.NODE_ENV, "gpu-b")
    args = supervise.build_parser().parse_args(["--nnodes=2", "--node-rank=1", "--master-port=1"])
    sup = supervise.Supervisor(args, supervise.settings(args), store)
    rendezvous.init_generation(store)
    assert rendezvous.start_round(store, 0, sup.failure("process", "exit 78", (3,)), 10)
    session = generations.Session(1, store, 0, None, str(tmp_path), [], 3)  # type: ignore[arg-type]
    session.restored(2, "memory")
    session.step_done(3)
    [record] = session.history
    assert record["ranks"] == [3] and record["nodes"] == [{"node": "gpu-b", "ranks": [3]}]
    parsed = progress_report.parse(json.dumps({"recovery": [record]}).encode()).document
    assert parsed is not None and parsed["recovery"][0]["nodes"] == record["nodes"]
    monkeypatch.setenv(context.NODE_ENV, "n" * 254)
    unnamed = supervise.Supervisor(args, supervise.settings(args), store)
    assert unnamed.failure("process", "exit 78", (3,)).node == ""


def test_a_recovery_that_restored_nothing_records_none(store, tmp_path):
    rendezvous.init_generation(store)
    rendezvous.start_round(store, 0, failure(1), 10)
    session = generations.Session(1, store, 0, None, str(tmp_path), [], 3)  # type: ignore[arg-type]
    session.restored(None, "none")
    session.step_done(1)
    assert session.history[0]["source"] == "none"
    assert "none" in progress_report.RECOVERY_SOURCES  # the operator keeps such a record


def test_the_store_leaving_after_rank_0_finished_is_a_clean_exit(store):
    args = supervise.build_parser().parse_args(["--nnodes=2", "--node-rank=1", "--master-port=1"])
    sup = supervise.Supervisor(args, supervise.settings(args), store)
    sup.workers = {0: spares.Child(subprocess.Popen(["true"]), time.time())}
    assert sup.finished_anyway() is None  # rank 0 had not finished: a lost store is a failure
    sup.rank0_finished = True
    assert sup.finished_anyway() == 0
    sup.workers = {0: spares.Child(subprocess.Popen(["false"]), time.time())}
    assert sup.finished_anyway() is None


def test_a_replaced_pod_that_comes_back_takes_no_incarnation(store):
    old = rendezvous.take_incarnation(store, 1, "uid-old", uid="uid-old")
    again = rendezvous.take_incarnation(store, 1, "uid-old", uid="uid-old")  # container restart
    assert old is not None and again is not None and again.number == old.number + 1
    new = rendezvous.take_incarnation(store, 1, "uid-new", uid="uid-new")  # the replacement
    assert new is not None and rendezvous.superseded(store, again)
    assert rendezvous.take_incarnation(store, 1, "uid-old", uid="uid-old") is None  # fenced
    assert not rendezvous.superseded(store, new)


def test_a_replaced_supervisor_exits_superseded_and_halts_nothing(store, monkeypatch, tmp_path):
    assert rendezvous.take_incarnation(store, 1, "uid-old", uid="uid-old")
    assert rendezvous.take_incarnation(store, 1, "uid-new", uid="uid-new")
    monkeypatch.setenv(rendezvous.POD_UID_ENV, "uid-old")
    monkeypatch.setenv("MESHTRAIN_TERMINATION_LOG", str(tmp_path / "termination"))
    args = supervise.build_parser().parse_args(["--nnodes=2", "--node-rank=1", "--warm-spares=0"])
    sup = supervise.Supervisor(args, supervise.settings(args), store)
    assert sup.run() == rendezvous.SUPERSEDED
    assert not sup.workers and rendezvous.halted(store) is None
    assert "replaced" in (tmp_path / "termination").read_text()


def test_a_rank_that_died_right_after_taking_its_key_starts_a_round(store):
    rendezvous.init_generation(store)
    store.set("rdzv/g0/rank1", "1:uid/42")  # its compare-and-set, then SIGKILL before counting
    assert rendezvous.ranks_failed(store, (1,), failure(1), limit=10) == 1
    assert rendezvous.generation(store) == 1  # its replacement is not left waiting for a move
