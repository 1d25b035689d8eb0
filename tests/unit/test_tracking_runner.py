"""The trackers' plumbing without a tracker package: which fields are metrics, stored run ids read
defensively, and a failing or stalled tracker that warns once and never blocks the caller."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from meshtrain.api import job_dir, loading
from meshtrain.trainer.telemetry.tracking import backend, runner
from tests.builders import JobBuilder


def _context(home: Path | None) -> backend.Context:
    job = loading.parse_spec(JobBuilder.cpu_run().raw())
    return backend.Context(job, "ns", "job", home, first_step=1, log_dir=None)


def test_metrics_are_the_finite_numbers_but_step_and_time():
    record = {
        "step": 3,
        "time": 1.7e9,
        "loss": 2.5,
        "tokens": 256,
        "skipped": "nan-loss",
        "slowdowns": [1.0],
        "flag": True,
        "grad_norm": float("nan"),
        "batch_change": {"from": 8},
    }
    assert backend.metrics(record) == {"loss": 2.5, "tokens": 256.0}


def test_params_flatten_the_layout_model_and_training(tmp_path):
    params = _context(tmp_path).params()
    assert params["layout"] == "dp1·pp1·tp1"
    assert params["training.learningRate"] == "0.003" and params["model.layers"] == "4"
    assert params["training.dataset"] == "stdlib"  # a string as it is, not JSON-quoted
    assert {key.split(".")[0] for key in params} == {"layout", "parallelism", "model", "training"}


def test_stored_ids_round_trip_and_hostile_files_read_as_none(tmp_path):
    context = _context(tmp_path)
    assert context.stored_id("mlflow") == {}
    context.store_id("mlflow", {"run_id": "abc", "tracking_uri": "http://m"})
    assert context.stored_id("mlflow") == {"run_id": "abc", "tracking_uri": "http://m"}
    stored = tmp_path / job_dir.TRACKING_SUBDIR / "mlflow.json"
    for hostile in ("not json", "[1, 2]", '{"run_id": "' + "x" * 10_000 + '"}'):
        stored.write_text(hostile)
        assert context.stored_id("mlflow") == {}
    assert _context(None).stored_id("mlflow") == {}


class _Failing:
    name = "broken"

    def __init__(self) -> None:
        self.logged = 0

    def start(self) -> None:
        pass

    def log(self, step, values, wall_time) -> None:
        self.logged += 1
        raise ConnectionError("server down " + "x" * 5000)

    def finish(self, report, finished) -> None:
        raise AssertionError("a failed tracker is not finished")


def test_a_failing_tracker_warns_once_and_is_off(capsys):
    tracker = _Failing()
    one = runner.Runner(tracker)
    for step in range(1, 20):
        one.log(step, {"loss": 1.0}, 0.0)
    one.close(None, True, timeout=30)
    err = capsys.readouterr().err
    assert err.count("WARNING: experiment tracker broken") == 1
    assert "server down" in err and len(err) < runner.MAX_MESSAGE + 200
    assert one.failed is not None and tracker.logged == 1


class _Stalled:
    name = "stalled"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps: list[int] = []

    def start(self) -> None:
        self.release.wait(30)

    def log(self, step, values, wall_time) -> None:
        self.steps.append(step)

    def finish(self, report, finished) -> None:
        pass


def test_a_stalled_tracker_drops_steps_instead_of_blocking(capsys, monkeypatch):
    monkeypatch.setattr(runner, "MAX_PENDING", 5)
    tracker = _Stalled()
    one = runner.Runner(tracker)
    for step in range(1, 11):  # returns at once although nothing is consumed
        one.log(step, {"loss": 1.0}, 0.0)
    assert capsys.readouterr().err.count("steps are dropped") == 1
    tracker.release.set()
    one.close(None, True, timeout=30)
    assert tracker.steps == [1, 2, 3, 4, 5]


class _SlowEnd:
    """A tracker whose finish takes ``seconds`` (a server that answers late)."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name = name
        self.seconds = seconds
        self.finished = threading.Event()

    def start(self) -> None:
        pass

    def log(self, step, values, wall_time) -> None:
        pass

    def finish(self, report, finished) -> None:
        if self.seconds:
            time.sleep(self.seconds)
        self.finished.set()


def test_the_end_reaches_every_tracker_at_once_against_one_deadline(capsys):
    hung, fast = _SlowEnd("hung", 60.0), _SlowEnd("fast", 1.0)
    runners = [runner.Runner(hung), runner.Runner(fast)]  # the hung one first, as MLflow is
    started = time.monotonic()
    runner.close_all(runners, None, True, started + 5.0)
    waited = time.monotonic() - started
    assert fast.finished.is_set(), "the fast tracker must get its end while the first one hangs"
    assert 4.0 <= waited < 30.0  # one deadline: not 5 s per tracker, not the hung one's 60 s
    err = capsys.readouterr().err
    assert err.count("WARNING: experiment tracker") == 1 and "tracker hung" in err


def test_close_seconds_come_from_the_environment_within_bounds(monkeypatch):
    monkeypatch.delenv(runner.CLOSE_ENV, raising=False)
    assert runner.close_seconds() == runner.CLOSE_SECONDS
    for given, expected in (("7", 7.0), ("0", 1.0), ("1e9", runner.MAX_CLOSE_SECONDS)):
        monkeypatch.setenv(runner.CLOSE_ENV, given)
        assert runner.close_seconds() == expected
    for junk in ("soon", "nan", "inf"):
        monkeypatch.setenv(runner.CLOSE_ENV, junk)
        assert runner.close_seconds() == runner.CLOSE_SECONDS
