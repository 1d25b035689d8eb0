"""Experiment trackers, read back with each tracker's own reader: a real ``meshtrain run`` with
TensorBoard, MLflow (a real ``mlflow server`` on loopback) and W&B (offline) all on, that trains
to step 4, loses its step-4 checkpoint (a crash past the last checkpoint, at step 2) and is
resumed to step 6, so steps 3 and 4 are trained twice.  TensorBoard must show steps 1..6 once
with the resumed values of 3..4; MLflow a job run with one nested run per attempt, each equal to
its attempt's steps.jsonl; W&B one run per attempt in the job's group, each equal to its
attempt's records.  A dead or silent MLflow server costs one warning on the terminal, not the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mt_harness
import pytest

from meshtrain.api import job_dir, loading
from meshtrain.trainer import launch
from meshtrain.trainer.checkpointing import store
from meshtrain.trainer.telemetry import steplog
from meshtrain.trainer.telemetry.tracking import backend, mlflow_run, runner
from meshtrain.trainer.telemetry.tracking import log as tracked_log
from tests.builders import JobBuilder

INSTALL = "the tracking extra and the MLflow server: pip install -e '.[trainer,tracking,test]'"
try:
    import mlflow.server  # noqa: F401 - the server the fixture starts
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing import event_accumulator
    from wandb.proto import wandb_internal_pb2  # W&B's own record schema
except ImportError as missing:  # a missing component fails, saying how to get it
    raise ImportError(f"{missing}: tests/trainer/test_trackers.py needs {INSTALL}") from missing

pytestmark = pytest.mark.slow

EXPERIMENT = "trackers-test"
RUN_NAME = "tracked run"
CRASHED_AT, SAVED_AT, ALL_STEPS = 4, 2, 6
"""The first attempt trains to step 4 but keeps only the step-2 checkpoint; the resume trains 3..6."""
SERVER_START_S = 240.0
"""The mlflow server's start (migrations, imports): 43 s to its first line beside two busy
workers in a fresh-clone run, and more than 90 s to healthy."""
ALWAYS = ("loss", "lr", "tokens_per_second", "step_seconds", "grad_norm", "mfu")
"""Fields every record has, so every tracker must plot them."""
CLOSE_S = 30
"""The end's shared deadline for the silent-server test (MESHTRAIN_TRACKERS_CLOSE_SECONDS)."""


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"mlflow server not healthy in {SERVER_START_S:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback: sqlite store, artifacts served from a local folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = launch.free_port()
    log = root / "server.log"
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root / 'store.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"]
    # no job runner: it starts seven task-queue processes that this test never uses
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _job(tmp_path: Path, tracking: dict) -> Path:
    return mt_harness.write_job(
        tmp_path,
        JobBuilder.cpu_run()
        .training(steps=ALL_STEPS)
        .checkpoint(intervalSteps=SAVED_AT, keep=3, asyncSave=False)
        .tracking(**tracking)
        .raw(),
    )


def _meshtrain_run(spec: Path, steps: int, logs: Path, **env: str) -> subprocess.CompletedProcess:
    """``meshtrain run`` as a user types it (stdout and stderr captured, not a terminal)."""
    command = [sys.executable, "-m", "meshtrain.cli.main", "run", str(spec), "--steps", str(steps)]
    done = subprocess.run(
        [*command, "--log-dir", str(logs)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:] + (logs / "rank-0.log").read_text()[-3000:]
    return done


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, mlflow_server):
    """Train to step 4, drop the step-4 checkpoint (the crash came before it was saved), resume to
    6 in the same log directory, every tracker on; each attempt's step records and output."""
    tmp = tmp_path_factory.mktemp("tracked")
    tracking = {
        "tensorboard": {},
        "mlflow": {"trackingUri": mlflow_server, "experimentName": EXPERIMENT, "runName": RUN_NAME},
        "wandb": {"project": "meshtrain-test", "mode": "offline"},
    }
    spec_path = _job(tmp, tracking)
    logs = tmp / "logs"
    attempts, outputs = [], []
    for steps in (CRASHED_AT, ALL_STEPS):
        outputs.append(_meshtrain_run(spec_path, steps, logs))
        attempts.append(steplog.read(logs / steplog.FILENAME))
        shutil.copy(logs / "rank-0.log", tmp / f"rank-0-to-{steps}.log")
        if steps == CRASHED_AT:
            shutil.rmtree(logs / "checkpoints" / store.step_dir_name(CRASHED_AT))
    assert [r["step"] for r in attempts[0]] == list(range(1, CRASHED_AT + 1))
    assert [r["step"] for r in attempts[1]] == list(range(SAVED_AT + 1, ALL_STEPS + 1))
    return {
        "logs": logs,
        "attempts": attempts,
        "outputs": outputs,
        "spec": spec_path,
        "tmp": tmp,
        "url": mlflow_server,
    }


def _as_seen(attempts) -> list[dict]:
    """What the job trained, as a user reads it: each step once, the latest attempt's value."""
    by_step = {r["step"]: r for records in attempts for r in records}
    return [by_step[step] for step in sorted(by_step)]


def _metric_fields(records) -> set[str]:
    return {
        k
        for r in records
        for k, v in r.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _series(records, field: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[field])) for r in records if field in r]


def test_no_tracker_warned_and_the_summary_shows_each_run(tracked_run):
    for log in sorted(tracked_run["tmp"].glob("rank-0-to-*.log")):
        assert "experiment tracker" not in log.read_text(), log.read_text()[-3000:]
    home = tracked_run["logs"] / "checkpoints"
    mlflow_ids = json.loads((home / job_dir.TRACKING_SUBDIR / "mlflow.json").read_text())
    wandb_ids = json.loads((home / job_dir.TRACKING_SUBDIR / "wandb.json").read_text())
    done = tracked_run["outputs"][-1]
    assert "experiment tracker" not in done.stderr
    summary = {
        line.split(maxsplit=1)[0]: line
        for line in done.stdout.splitlines()
        if line.startswith("  ")
    }
    assert f"tensorboard --logdir {home / job_dir.TENSORBOARD_SUBDIR}" in summary["tensorboard"]
    assert mlflow_ids["attempt_run_id"] in summary["mlflow"]
    assert tracked_run["url"] in summary["mlflow"]
    assert wandb_ids["run_dir"] in summary["wandb"] and Path(wandb_ids["run_dir"]).is_dir()


def test_tensorboard_shows_each_step_once_with_the_resumed_values(tracked_run):
    folder = tracked_run["logs"] / "checkpoints" / job_dir.TENSORBOARD_SUBDIR
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one per attempt, in one folder
    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    records = _as_seen(tracked_run["attempts"])
    assert [r["step"] for r in records] == list(range(1, ALL_STEPS + 1))
    tags = set(events.Tags()["scalars"])
    assert set(ALWAYS) <= tags
    assert tags == _metric_fields(records)
    for tag in tags:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        expected = _series(records, tag)
        assert [s for s, _ in logged] == [s for s, _ in expected], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    first, resumed = (_series(a, "lr") for a in tracked_run["attempts"])
    assert dict(first)[CRASHED_AT] != dict(resumed)[CRASHED_AT]  # a replayed step differs


def _param_of(document: dict, key: str) -> str:
    """The spec's value at a dotted param key, written as the param is (strings as they are)."""
    value = document
    for part in key.split("."):
        value = value[part]
    return value if isinstance(value, str) else json.dumps(value)


def _assert_metrics_equal(client, run, records) -> None:
    assert set(run.data.metrics) == _metric_fields(records)
    for field in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, field)
        logged, expected = sorted((m.step, m.value) for m in history), _series(records, field)
        assert [step for step, _ in logged] == [step for step, _ in expected], field
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected]), field


def test_mlflow_nests_a_clean_run_per_attempt_under_the_job(tracked_run, tmp_path):
    client = MlflowClient(tracking_uri=tracked_run["url"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and len(runs) == 3, [r.info.run_name for r in runs]
    parent = parents[0]
    assert parent.info.run_name == RUN_NAME and parent.info.status == "FINISHED"
    assert parent.data.tags["namespace"] == "local" and parent.data.tags["trainingjob"] == "logs"
    children = sorted(
        (r for r in runs if r is not parent), key=lambda r: int(r.data.tags["attempt"])
    )
    assert [c.data.tags["mlflow.parentRunId"] for c in children] == [parent.info.run_id] * 2
    assert [c.info.run_name for c in children] == [f"{RUN_NAME} attempt {n}" for n in (1, 2)]
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED"]
    for child, records in zip(children, tracked_run["attempts"], strict=True):
        _assert_metrics_equal(client, child, records)
    assert not parent.data.metrics  # the job's run holds no series of its own to mix attempts in
    job = loading.load_spec_file(str(tracked_run["spec"]))
    job = loading.apply_overrides(job, [f"training.steps={CRASHED_AT}"])  # the run that made it
    document = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    params = parent.data.params
    assert params["layout"] == job.parallelism.layout_string
    assert {k.split(".")[0] for k in params} == {"layout", "parallelism", "model", "training"}
    for key, value in params.items():
        if key != "layout":
            assert value == _param_of(document, key), key
    assert params["training.learningRate"] == "0.003" and params["model.hidden"] == "32"
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"plan.txt", "report.html"} <= names
    assert "report.html" in {a.path for a in client.list_artifacts(children[-1].info.run_id)}
    report = Path(client.download_artifacts(parent.info.run_id, "report.html", str(tmp_path)))
    assert "meshtrain report" in report.read_text()
    plan = Path(client.download_artifacts(parent.info.run_id, "plan.txt", str(tmp_path)))
    assert "cores of this host shared by the ranks" in plan.read_text()  # meshtrain plan's host
    stored = tracked_run["logs"] / "checkpoints" / job_dir.TRACKING_SUBDIR / "mlflow.json"
    ids = json.loads(stored.read_text())
    assert ids["run_id"] == parent.info.run_id
    assert ids["attempt_run_id"] == children[-1].info.run_id


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB log blocks of 32 KiB, each record with a crc32, length and type."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    out, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # a block's tail too short for a header is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 2, 3, 4):
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                out.append(pending)
                pending = b""
        elif kind == 0 and length == 0:
            break
    return out


def _wandb_run(path: Path) -> tuple[dict, dict[int, dict[str, float]]]:
    """A W&B offline run file's run record (name, group, config) and its history by step."""
    run: dict = {"config": {}}
    history: dict[int, dict[str, float]] = {}
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            assert record.history.step.num not in history, "a step logged twice in one run"
            history[record.history.step.num] = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
        elif kind == "run":  # the run's config (the spec) is sent with the run
            run.update(name=record.run.display_name, group=record.run.run_group)
            run["job_type"] = record.run.job_type
            run["config"].update(
                {i.key: json.loads(i.value_json) for i in record.run.config.update}
            )
    return run, history


def test_wandb_runs_one_per_attempt_in_the_jobs_group(tracked_run):
    folder = tracked_run["logs"] / "checkpoints" / job_dir.TRACKING_SUBDIR
    stored = json.loads((folder / "wandb.json").read_text())
    files = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    runs = sorted((_wandb_run(path) for path in files), key=lambda run: run[0]["name"])
    assert [run["name"] for run, _ in runs] == [f"local/logs attempt {n}" for n in (1, 2)]
    assert {run["group"] for run, _ in runs} == {stored["group"]}
    assert {run["job_type"] for run, _ in runs} == {"train"}
    for (run, history), records in zip(runs, tracked_run["attempts"], strict=True):
        assert sorted(history) == [r["step"] for r in records]
        for record in records:
            logged = history[record["step"]]
            for field in ALWAYS:
                assert logged[field] == pytest.approx(record[field], rel=1e-9), record["step"]
            assert set(_metric_fields([record])) <= set(logged)
        assert run["config"]["parallelism"]["data"] == 1 and run["config"]["model"]["hidden"] == 32


def test_dead_mlflow_server_warns_once_on_the_terminal_and_training_succeeds(tmp_path):
    dead = f"http://127.0.0.1:{launch.free_port()}"  # nothing listens there
    spec_path = _job(tmp_path, {"mlflow": {"trackingUri": dead}})
    done = _meshtrain_run(spec_path, 3, tmp_path / "logs")
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert log.count("WARNING: experiment tracker mlflow") == 1, log[-3000:]
    assert done.stderr.count("WARNING: experiment tracker mlflow") == 1, done.stderr[-3000:]
    assert "training goes on without it" in done.stderr
    assert [r["step"] for r in steplog.read(tmp_path / "logs" / steplog.FILENAME)] == [1, 2, 3]


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers (an MLflow behind a stuck proxy)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for one in [*held, listener]:
        one.close()


def test_a_silent_mlflow_server_holds_the_end_only_to_the_shared_deadline(
    tmp_path, silent_server, monkeypatch
):
    tracking = {"mlflow": {"trackingUri": silent_server}, "tensorboard": {}}
    spec_path = _job(tmp_path, tracking)
    env = {runner.CLOSE_ENV: str(CLOSE_S)}
    done = _meshtrain_run(spec_path, 3, tmp_path / "logs", **env)
    ended = time.time()
    records = steplog.read(tmp_path / "logs" / steplog.FILENAME)
    assert [r["step"] for r in records] == [1, 2, 3]
    monkeypatch.setenv(runner.CLOSE_ENV, str(CLOSE_S))
    bound = tracked_log.end_seconds()  # docs/tracking.md: the shared deadline + the exit grace
    assert ended - records[-1]["time"] < bound + 30, "the end outlived its documented bound"
    assert done.stderr.count("WARNING: experiment tracker") == 1, done.stderr[-3000:]
    assert f"did not finish within {CLOSE_S} s" in done.stderr
    folder = tmp_path / "logs" / "checkpoints" / job_dir.TENSORBOARD_SUBDIR
    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()  # TensorBoard, beside the stuck MLflow, closed its run with every step
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


TENSORBOARD_ALONE = """
import sys
from pathlib import Path
from meshtrain.api import loading
from meshtrain.trainer.telemetry.tracking import backend, tensorboard_files
from tests.builders import JobBuilder

job = loading.parse_spec(JobBuilder.cpu_run().tracking(tensorboard={}).raw())
for first, last, value in ((1, 4, 1.0), (3, 6, 2.0)):  # an attempt to 4, a resume from 3
    context = backend.Context(job, "ns", "job", Path(sys.argv[1]), first, None)
    files = tensorboard_files.TensorBoardFiles(job.tracking.tensorboard, context)
    files.start()
    for step in range(first, last + 1):
        files.log(step, {"loss": value}, 1.7e9 + step)
    files.finish(None, True)
assert "torch" not in sys.modules, "the trackers' process must not load torch for TensorBoard"
"""


def test_tensorboard_files_purge_on_resume_without_torch(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TENSORBOARD_ALONE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / job_dir.TENSORBOARD_SUBDIR
    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 1.0),
        (2, 1.0),
        (3, 2.0),
        (4, 2.0),
        (5, 2.0),
        (6, 2.0),
    ]


def _mlflow_attempt(job, home: Path, first: int, last: int) -> mlflow_run.MLflowRun:
    """One attempt's MLflow run (steps ``first``..``last``), driven as the trackers' process does."""
    context = backend.Context(job, "ns", "job", home, first, None, local=True)
    run = mlflow_run.MLflowRun(job.tracking.mlflow, context)
    run.start()
    for step in range(first, last + 1):
        run.log(step, {"loss": float(step)}, time.time())
    run.finish(None, True)
    return run


def test_a_sqlite_store_and_a_deleted_job_run_start_afresh(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"  # MLflow's recommended local store
    (tmp_path / "store").mkdir()
    job = loading.parse_spec(JobBuilder.cpu_run().tracking(mlflow={"trackingUri": uri}).raw())
    home = tmp_path / "checkpoints"
    first = _mlflow_attempt(job, home, 1, 4)
    resumed = _mlflow_attempt(job, home, 3, 6)
    client = MlflowClient(tracking_uri=uri)
    assert resumed.parent_id == first.parent_id
    history = client.get_metric_history(resumed.run_id, "loss")
    assert sorted(m.step for m in history) == [3, 4, 5, 6]
    client.delete_run(first.parent_id)  # someone cleaned the experiment up
    again = _mlflow_attempt(job, home, 5, 6)
    assert again.parent_id != first.parent_id, "a deleted job run must not turn MLflow off"
    assert client.get_run(again.run_id).data.tags["mlflow.parentRunId"] == again.parent_id
    assert not (tmp_path / "mlruns").exists(), "artifacts go beside the database, not in ./mlruns"
    plans = list((tmp_path / "store" / mlflow_run.SQLITE_ARTIFACTS).rglob("plan.txt"))
    assert len(plans) == 2  # one job run each time
    stored = json.loads((home / job_dir.TRACKING_SUBDIR / "mlflow.json").read_text())
    assert stored == {
        "run_id": again.parent_id,
        "tracking_uri": uri,
        "attempts": "1",
        "attempt_run_id": again.run_id,
    }


def test_ctrl_c_ends_the_mlflow_runs_killed_not_running(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec_path = _job(tmp_path, {"mlflow": {"trackingUri": uri}})
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "meshtrain.cli.main", "run", str(spec_path), "--steps", "400"]
    # its own process group, which Ctrl-C signals as a terminal does
    proc = subprocess.Popen(
        [*command, "--log-dir", str(logs)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        steps = logs / steplog.FILENAME
        while not (steps.exists() and len(steplog.read(steps)) >= 2):
            assert time.monotonic() < deadline, "no two steps in 300 s"
            assert proc.poll() is None, (logs / "rank-0.log").read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("meshtrain").experiment_id])
    assert len(runs) == 2, (logs / "rank-0.log").read_text()[-3000:]
    assert {r.info.status for r in runs} == {"KILLED"}, (logs / "rank-0.log").read_text()[-3000:]
