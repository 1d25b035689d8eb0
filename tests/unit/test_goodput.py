"""Goodput accounting against hand-built logs whose timeline the test lays out itself.

Each scenario places steps and failures on a clock and states, interval by interval, what is
productive and what each failure cost; the module must find the same from the two files.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import urllib.request

import pytest
from prometheus_client import parser

from meshtrain.api import loading
from meshtrain.cli import main
from meshtrain.trainer.telemetry import goodput, goodput_live, report, steplog
from meshtrain.trainer.telemetry.recorder import make_recorder
from tests.builders import JobBuilder
from tests.unit import telemetry_feed
from tests.unit.test_telemetry_exporter import free_base

T0 = 1_780_000_000.0


def _steps(log_dir, runs):
    """Write steps.jsonl: ``runs`` is a list of (first step, last step, start time, seconds each)."""
    with (log_dir / steplog.FILENAME).open("a") as out:
        for first, last, start, seconds in runs:
            for index, step in enumerate(range(first, last + 1)):
                end = start + (index + 1) * seconds
                record = {"step": step, "step_seconds": seconds, "time": end}
                record |= {"loss": 2.0, "tokens_per_second": 100.0}  # what meshtrain report needs
                out.write(json.dumps(record) + "\n")


def _recovery(log_dir, **fields):
    with (log_dir / goodput.RECOVERIES).open("a") as out:
        out.write(json.dumps(fields) + "\n")


def test_in_place_recovery_then_gang_rebuild(tmp_path):
    # 0..10: steps 1-10 at 1 s.  10.4: a process dies (in place): detected 10.9, process groups
    # back 12.0, state from memory (step 8) at 12.5.  12.5..19.5: steps 9-15 at 1 s.  Then the
    # gang fails after step 15's record (19.5) and is rebuilt: groups up at 40, step 12 loaded
    # from storage at 42.  42..58: steps 13-20 at 2 s.
    _steps(tmp_path, [(1, 10, T0, 1.0)])
    _recovery(
        tmp_path,
        generation=1,
        tier="process",
        cause="exit 1",
        ranks=[3],
        failedAt=T0 + 10.4,
        detectedAt=T0 + 10.9,
        rejoinedAt=T0 + 12.0,
        restoredAt=T0 + 12.5,
        resumedStep=8,
        source="memory",
        lostSteps=2,
        firstStepAt=T0 + 13.5,
    )
    _steps(tmp_path, [(9, 15, T0 + 12.5, 1.0)])
    record = goodput.gang_record(tmp_path, 12, rejoined_at=T0 + 40, restored_at=T0 + 42)
    assert record is not None
    assert (record["tier"], record["failedAt"], record["lostSteps"]) == ("gang", T0 + 19.5, 3)
    _recovery(tmp_path, **record)
    # a record of this restore exists now: a second start-up before a step writes none
    assert goodput.gang_record(tmp_path, 12, rejoined_at=T0 + 41, restored_at=T0 + 42) is None
    _steps(tmp_path, [(13, 20, T0 + 42, 2.0)])

    account = goodput.account_of(tmp_path)
    # productive: steps 1-8 (first run), 9-12 (second run), 13-20 (third run, 2 s each)
    assert account.productive_seconds == pytest.approx(8 + 4 + 16)
    assert account.wall_seconds == pytest.approx(58)
    assert account.ratio == pytest.approx(28 / 58)
    first, second = account.failures
    assert (first.tier, first.cause, first.resumed_step, first.lost_steps) == (
        "process",
        "exit 1",
        8,
        2,
    )
    # recompute: steps 9 and 10's first runs (2 s) and the 0.4 s of step 11 the failure cut short
    assert dict(first.seconds) == pytest.approx(
        {"detection": 0.5, "restart": 1.1, "reload": 0.5, "recompute": 2.4}
    )
    assert (second.tier, second.resumed_step, second.lost_steps) == ("gang", 12, 3)
    # the operator's detection is not seen by the trainer: failure to groups up is the restart
    assert dict(second.seconds) == pytest.approx(
        {"detection": 0.0, "restart": 20.5, "reload": 2.0, "recompute": 3.0}
    )
    assert dict(account.lost_seconds) == pytest.approx(
        {"detection": 0.5, "restart": 21.6, "reload": 2.5, "recompute": 5.4}
    )
    assert account.other_seconds == pytest.approx(0, abs=1e-6)  # every second of 0..58 is placed


def test_report_shows_goodput_and_each_failures_split(tmp_path, capsys):
    test_in_place_recovery_then_gang_rebuild(tmp_path)
    out = tmp_path / "report.html"
    assert main.main(["report", str(tmp_path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "goodput: 48.28%" in printed  # 28 / 58
    assert "lost to failures: restart: 21.6 s" in printed
    assert "gang (gang restart), resumed after step 12, 3 step(s) lost" in printed
    page = out.read_text()
    assert '<table id="goodput">' in page
    failures = page.split('<table id="failures">', 1)[1].split("</table>", 1)[0]
    assert failures.count("<tr><td>") == 2  # one row per failure
    attempts = page.split('<table id="attempts">', 1)[1].split("</table>", 1)[0]
    assert attempts.count("<tr><td>") == 3  # the run's three attempts (two failures)
    assert "<td>process</td><td>exit 1</td><td>step 8</td><td>2</td>" in page


def test_a_step_log_that_goes_back_without_a_record_is_an_unrecorded_restart(tmp_path):
    # steps 1-5 at 1 s (0..5); nothing until 9; steps 4-6 at 1 s (9..12)
    _steps(tmp_path, [(1, 5, T0, 1.0), (4, 6, T0 + 9, 1.0)])
    account = goodput.account_of(tmp_path)
    assert account.productive_seconds == pytest.approx(3 + 3)
    assert account.wall_seconds == pytest.approx(12)
    (failure,) = account.failures
    assert (failure.tier, failure.cause, failure.resumed_step, failure.lost_steps) == (
        "unrecorded",
        "unknown",
        3,
        2,
    )
    assert dict(failure.seconds) == pytest.approx(
        {"detection": 0.0, "restart": 4.0, "reload": 0.0, "recompute": 2.0}
    )


def test_hostile_lines_are_skipped_never_raised(tmp_path):
    _steps(tmp_path, [(1, 3, T0, 1.0)])
    with (tmp_path / steplog.FILENAME).open("a") as out:
        out.write("not json\n")
        out.write(json.dumps({"step": True, "step_seconds": 1, "time": T0}) + "\n")
        out.write(json.dumps({"step": 4, "step_seconds": "1", "time": T0}) + "\n")
        out.write('{"step": 4, "step_seconds": NaN, "time": 1}\n')
        out.write(json.dumps({"step": 4, "step_seconds": 1, "time": 1e300}) + "\n")
        out.write("[" * 100_000 + "\n")
        out.write('{"step": 4, "pad": "' + "x" * (goodput.MAX_STEP_LINE + 10) + '"}\n')
        out.write(json.dumps({"step": 4, "step_seconds": 1.0, "time": T0 + 4}) + "\n")
        out.write('{"step": 5, "step_sec')  # a partly written last line
    with (tmp_path / goodput.RECOVERIES).open("w") as out:
        out.write('"a string"\n{"tier": "process"}\n')
        out.write(json.dumps({"failedAt": -5, "tier": "process"}) + "\n")
        out.write("y" * (goodput.MAX_RECOVERY_LINE + 5) + "\n")
        out.write(
            json.dumps(
                {"failedAt": T0 + 10, "tier": "\u202e" * 9, "cause": "x" * 500, "resumedStep": -1}
            )
            + "\n"
        )
    account = goodput.account_of(tmp_path)
    assert account.productive_seconds == pytest.approx(4)
    (failure,) = account.failures  # the one record with a failure time: its strings replaced
    assert (failure.tier, failure.cause, failure.resumed_step) == ("unrecorded", "other", 0)
    assert all(math.isfinite(v) for v in failure.seconds.values())


def test_no_gang_record_when_the_log_does_not_go_further(tmp_path):
    assert goodput.gang_record(tmp_path, None, rejoined_at=T0, restored_at=T0) is None
    _steps(tmp_path, [(1, 10, T0, 1.0)])
    assert goodput.gang_record(tmp_path, 10, rejoined_at=T0, restored_at=T0) is None
    assert goodput.note_gang_restart(tmp_path, 10, rejoined_at=T0) is None
    written = goodput.note_gang_restart(tmp_path, None, rejoined_at=T0 + 30)
    assert written is not None and (written["resumedStep"], written["lostSteps"]) == (0, 10)
    assert goodput.read_recoveries(tmp_path)[0].tier == "gang"


def test_rank_0_exports_the_account_and_the_failures_it_sees(tmp_path, monkeypatch):
    """History before the process (a failure) sets the ratio, not the counters; a record
    appended while it runs is counted once, by phase and tier."""
    monkeypatch.setenv("MESHTRAIN_JOB_NAME", "demo")
    start = time.time() - 30
    _steps(tmp_path, [(1, 4, start, 1.0), (3, 4, start + 10, 1.0)])  # an unrecorded restart, before
    port = free_base(1)
    job = loading.parse_spec(JobBuilder().metrics(port=port, peakFlops=1e12).raw())
    recorder = make_recorder(job, job.parallelism.layout, 0, tmp_path, local_rank=0)
    try:
        stages, seconds = telemetry_feed.simulate_step("1f1b", 1, 1, fwd=0.01, bwd=0.02)
        telemetry_feed.feed(recorder, 5, stages[0], seconds)
        failed = time.time()
        _recovery(
            tmp_path,
            tier="process",
            cause="SIGKILL",
            failedAt=failed,
            detectedAt=failed + 0.2,
            rejoinedAt=failed + 1.2,
            restoredAt=failed + 1.5,
            resumedStep=4,
        )
        telemetry_feed.feed(recorder, 5, stages[0], seconds)
        document = recorder.progress.document()["goodput"]
        assert set(document) == {"ratio", "productive_seconds", "wall_seconds", "lost_seconds"}
        assert 0 < document["ratio"] < 1
        assert document["lost_seconds"]["detection"] == pytest.approx(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        recorder.close()
    samples = [s for f in parser.text_string_to_metric_families(body) for s in f.samples]

    def value(name, **labels):
        found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    assert value("meshtrain_goodput_ratio") == pytest.approx(document["ratio"], abs=1e-3)
    assert value("meshtrain_recoveries_total", tier="process", cause="SIGKILL") == 1
    # the unrecorded restart before this process: in the ratio, not in the counters
    assert value("meshtrain_recovery_seconds_count", phase="restart", tier="unrecorded") == 0
    assert value(
        "meshtrain_recovery_seconds_sum", phase="restart", tier="process"
    ) == pytest.approx(1.0)
    assert value("meshtrain_recovery_seconds_count", phase="reload", tier="process") == 1
    assert value("meshtrain_lost_steps_total") == 1  # step 5's first run


def test_the_gang_record_reads_the_end_of_a_long_log(tmp_path):
    _steps(tmp_path, [(1, 20_000, T0, 0.5)])  # about 2 MiB: more than the first tail read
    assert (tmp_path / steplog.FILENAME).stat().st_size > 2**20
    assert goodput.last_step(tmp_path) == (20_000, T0 + 10_000)
    record = goodput.gang_record(tmp_path, 19_990, rejoined_at=T0 + 10_100, restored_at=T0 + 10_101)
    assert record is not None and record["lostSteps"] == 10


def test_recovery_causes_are_bounded_label_values(monkeypatch):
    from meshtrain.trainer.telemetry import context, exporter, progress  # noqa: PLC0415

    job = loading.parse_spec(JobBuilder().raw())
    identity = context.RankIdentity.from_env(job.parallelism.layout, 0, env={})
    facts = make_recorder(job, job.parallelism.layout, 0, None, serve=False).facts
    sink = exporter.Exporter(identity, facts, port=free_base(1), progress=progress.Progress())
    try:
        spans = dict.fromkeys(goodput.PHASES, 1.0)
        failures = [goodput.Failure("process", f"exit {n}", T0, 0, 1, spans) for n in range(20)]
        sink.goodput(None, failures)
        counted = {
            s.labels["cause"]: s.value
            for f in sink.metrics.registry.collect()
            for s in f.samples
            if s.name == "meshtrain_recoveries_total"
        }
    finally:
        sink.close()
    assert len(counted) == exporter.MAX_CAUSES + 1 and counted["other"] == 20 - exporter.MAX_CAUSES


def test_a_tracker_kept_across_an_in_place_recovery_counts_it_once(tmp_path):
    """The producer's order: the session hands the tracker the record at restore time, the first
    step after it ends, only then is the record (with firstStepAt) appended; the live account is
    the replayed one, with no ``unrecorded`` failure."""
    record = {
        "generation": 1,
        "tier": "process",
        "cause": "exit 1",
        "ranks": [3],
        "failedAt": T0 + 10.4,
        "detectedAt": T0 + 10.9,
        "rejoinedAt": T0 + 12.0,
        "restoredAt": T0 + 12.5,
        "resumedStep": 8,
        "source": "memory",
        "lostSteps": 2,
        "firstStepAt": None,
    }
    tracker = goodput_live.Tracker(tmp_path)
    found = []
    for step in range(1, 11):  # generation 0: steps 1-10 at 1 s
        _steps(tmp_path, [(step, step, T0 + step - 1, 1.0)])
        found += tracker.step(step, 1.0, T0 + step)
    tracker.recovered(goodput.parse_recovery(record))  # Session.restored, generation 1
    for step in (9, 10, 11):
        _steps(tmp_path, [(step, step, T0 + 12.5 + step - 9, 1.0)])
        found += tracker.step(step, 1.0, T0 + 13.5 + step - 9)
        if step == 9:  # Session.step_done: the record, once its first step is whole
            _recovery(tmp_path, **record | {"firstStepAt": T0 + 13.5})
    live, replayed = tracker.accountant.account(), goodput.account_of(tmp_path)
    assert [(f.tier, f.lost_steps) for f in found] == [("process", 2)]
    assert live.failure_count == replayed.failure_count == 1
    assert live.productive_seconds == pytest.approx(replayed.productive_seconds) == 11
    assert dict(live.lost_seconds) == pytest.approx(dict(replayed.lost_seconds))
    assert dict(live.lost_seconds) == pytest.approx(
        {"detection": 0.5, "restart": 1.1, "reload": 0.5, "recompute": 2.4}
    )


def test_wall_time_starts_at_the_job_start_and_the_first_start_up_is_its_own(tmp_path):
    # the job started at T0 - 20 (RFC 3339, as Kubernetes writes it); its first step began at T0
    _steps(tmp_path, [(1, 10, T0, 1.0)])
    started = datetime.datetime.fromtimestamp(T0 - 20, tz=datetime.UTC).isoformat()
    tracker = goodput_live.Tracker(tmp_path, environ={goodput.JOB_STARTED_ENV: started})
    account = tracker.accountant.account()
    assert account.startup_seconds == pytest.approx(20)
    assert account.wall_seconds == pytest.approx(30)
    assert account.ratio == pytest.approx(10 / 30)
    assert account.other_seconds == pytest.approx(0, abs=1e-6)
    # unix seconds read too; a start after the first step (a restarted pod 0) counts from the step
    late = goodput_live.Tracker(tmp_path, environ={goodput.JOB_STARTED_ENV: str(T0 + 5)})
    assert late.accountant.account().wall_seconds == pytest.approx(10)
    assert late.accountant.account().startup_seconds == 0
    for bad in ("", "yesterday", "nan", "-1", "1e300"):
        assert goodput.job_started({goodput.JOB_STARTED_ENV: bad}) is None
    rows = dict(report.goodput_rows(account))
    assert rows["start-up before the first step"] == "20.0 s"


def test_a_new_process_starts_from_the_summary_and_what_the_logs_gained_since(tmp_path):
    _steps(tmp_path, [(1, 10, T0, 1.0)])
    first = goodput_live.Tracker(tmp_path)  # rank 0's process: it read the ten steps
    record = {"tier": "process", "cause": "exit 1", "failedAt": T0 + 10.4}
    record |= {"detectedAt": T0 + 10.9, "rejoinedAt": T0 + 12.0, "restoredAt": T0 + 12.5}
    record |= {"resumedStep": 8}
    first.recovered(goodput.parse_recovery(record))  # in place, at restore
    _steps(tmp_path, [(9, 9, T0 + 12.5, 1.0)])
    first.step(9, 1.0, T0 + 13.5)
    first.checkpoint_saved(9)  # published before the session writes the record
    _recovery(tmp_path, **record | {"firstStepAt": T0 + 13.5})
    assert (tmp_path / goodput_live.SUMMARY).is_file()
    # the steps before the summary are not read again: blank the first record (same length)
    with (tmp_path / steplog.FILENAME).open("r+b") as log:
        line = log.readline()
        log.seek(0)
        log.write(b" " * (len(line) - 1) + b"\n")
    _steps(tmp_path, [(10, 11, T0 + 13.5, 1.0)])
    second = goodput_live.Tracker(tmp_path)  # a new process (a container restart)
    account = second.accountant.account()
    assert account.failure_count == 1  # the record handed before the summary is not counted again
    assert account.productive_seconds == pytest.approx(11)  # step 1 from the summary
    assert dict(account.lost_seconds) == pytest.approx(
        {"detection": 0.5, "restart": 1.1, "reload": 0.5, "recompute": 2.4}
    )
    assert goodput.account_of(tmp_path).productive_seconds == pytest.approx(10)  # (blanked step 1)


def test_without_a_summary_a_process_start_reads_a_bounded_tail(tmp_path, monkeypatch):
    _steps(tmp_path, [(1, 200, T0, 1.0)])
    size = (tmp_path / steplog.FILENAME).stat().st_size
    monkeypatch.setattr(goodput_live, "START_TAIL_BYTES", size // 4)
    account = goodput_live.Tracker(tmp_path).accountant.account()
    assert 40 <= account.productive_seconds <= 51  # about the last quarter of the steps
    # a summary of another history (its log was longer) is not used
    (tmp_path / goodput_live.SUMMARY).write_text(
        json.dumps({"version": 1, "stepsOffset": size + 1, "recoveriesOffset": 0, "account": {}})
    )
    assert goodput_live.read_summary(tmp_path) is None
    (tmp_path / goodput_live.SUMMARY).write_text("{not json")
    assert goodput_live.Tracker(tmp_path).accountant.account().productive_seconds <= 51
