"""The rendezvous protocol on a real TCPStore: one bump per failure, reports, the limit, joins; the supervisor's code classes."""

from __future__ import annotations

import signal
import time

import pytest
import torch.distributed

from meshtrain.api import exitcodes
from meshtrain.trainer import launch, supervise
from meshtrain.trainer.recovery import generations, rendezvous


@pytest.fixture
def store():
    return rendezvous.connect("127.0.0.1", launch.free_port(), master=True, timeout_s=10)


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


def test_a_rank_that_had_not_joined_the_round_only_reports_to_it(store):
    rendezvous.init_generation(store)
    rendezvous.join(store, 0, 0, 1, timeout_s=1)  # rank 0 joined round 0, rank 1 never did
    assert rendezvous.ranks_failed(store, (1,), failure(1), limit=10) == 0
    assert rendezvous.generation(store) == 0
    assert rendezvous.ranks_failed(store, (0,), failure(0), limit=10) == 1
    assert rendezvous.generation(store) == 1


def test_past_the_limit_the_gang_is_halted_for_a_rebuild(store):
    rendezvous.init_generation(store)
    assert rendezvous.start_round(store, 0, failure(1), limit=1)
    assert not rendezvous.start_round(store, 1, failure(1), limit=1)
    assert rendezvous.generation(store) == 1
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART
    assert rendezvous.halt(store, exitcodes.SPEC) == exitcodes.GANG_RESTART  # the first code stays


def test_the_widest_tier_names_the_round(store):
    rendezvous.init_generation(store)
    rendezvous.start_round(store, 0, failure(2, 3, tier="pod", cause="pod lost"), limit=10)
    rendezvous.report(store, 1, failure(2, 3, tier="container", cause="container restarted"))
    summary = rendezvous.summary(store, 1)
    assert summary["tier"] == "pod" and summary["ranks"] == (2, 3)


def test_a_join_waits_for_every_rank_and_sees_a_newer_round(store):
    rendezvous.init_generation(store)
    assert rendezvous.join(store, 0, 0, 2, timeout_s=0.2) == "timeout"
    assert rendezvous.join(store, 0, 1, 2, timeout_s=1) == "ready"
    store.set(rendezvous.GENERATION, "1")
    assert rendezvous.join(store, 0, 0, 2, timeout_s=1) == "moved"
    rendezvous.halt(store, exitcodes.GANG_RESTART)
    assert rendezvous.join(store, 1, 0, 2, timeout_s=1) == "halt"


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
