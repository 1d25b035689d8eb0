"""``meshtrain report``: charts of a synthetic run whose durations are known, and clear refusals."""

from __future__ import annotations

import base64
import io
import json
import re

import matplotlib.image
import pytest

from meshtrain.cli import main
from meshtrain.trainer.telemetry import report
from tests.unit import test_telemetry_timeline

FWD, BWD, M, BUCKETS, BUCKET_SECONDS = 0.01, 0.02, 4, 2, 0.003
"""The synthetic pipeline of test_telemetry_timeline.run: 1f1b, p = 2, m = 4, two 3 ms buckets."""


@pytest.fixture
def log_dir(tmp_path):
    return test_telemetry_timeline.run(tmp_path / "run", "1f1b", 2, M, dp=2, steps=4)


def test_step_split_of_every_stage_adds_up_to_its_step(log_dir):
    run = report.load(log_dir)
    split = report.stage_split(run)
    assert sorted(split) == [0, 1]
    for stage, parts in split.items():
        assert parts["compute"] == pytest.approx(M * (FWD + BWD)), stage
        step = report._stage_lines(run)[stage][-1]["seconds"]
        assert sum(parts.values()) == pytest.approx(step), stage
        assert parts["bubble"] > 0  # a 2-stage pipeline idles


def test_collective_time_by_group_is_the_buckets_of_each_step(log_dir):
    by_group = report.collective_seconds(report.load(log_dir))
    assert by_group["dp"] == pytest.approx({s: BUCKETS * BUCKET_SECONDS for s in (1, 2, 3, 4)})


def test_every_rank_computes_its_micro_batches(log_dir):
    times = report.rank_times(report.load(log_dir))
    assert sorted(times) == [0, 1, 2, 3]
    assert all(compute == pytest.approx(M * (FWD + BWD)) for _, compute in times.values())


def embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_html_is_one_file_with_every_chart_embedded(log_dir, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main.main(["report", str(log_dir), "-o", str(out)]) == 0
    page = out.read_text()
    assert len(re.findall(r"<img ", page)) == len(report.CHARTS) + 1  # and the pipeline timeline
    assert not re.search(r'(src|href)="(?!data:)', page), "the page must not link other files"
    for png in embedded_pngs(page):
        assert matplotlib.image.imread(io.BytesIO(png), format="png").shape[0] > 100
    assert f"{out}: 4 steps, 4 rank trace(s)" in capsys.readouterr().out


def test_png_output_is_one_picture(log_dir, tmp_path):
    out = tmp_path / "report.png"
    assert main.main(["report", str(log_dir), "-o", str(out)]) == 0
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 1000


def test_a_step_log_without_traces_draws_what_it_can(log_dir, tmp_path):
    for trace in (log_dir / "trace").iterdir():
        trace.unlink()
    out = tmp_path / "report.html"
    assert main.main(["report", str(log_dir), "-o", str(out)]) == 0
    page = out.read_text()
    assert len(embedded_pngs(page)) == 3 and "No trace/rank-N.jsonl" in page


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "holds no meshtrain run: expected steps.jsonl"),
        (lambda d: (d / "notes.txt").write_text("hello"), "holds no meshtrain run"),
        (lambda d: (d / "steps.jsonl").write_text(""), "steps.jsonl is empty"),
        (
            lambda d: (d / "steps.jsonl").write_text("step,loss\n1,2.0\n"),
            "steps.jsonl:1 is not JSON",
        ),
        (
            lambda d: (d / "steps.jsonl").write_text(json.dumps({"epoch": 1}) + "\n"),
            "steps.jsonl:1 is not a meshtrain record (no loss, step, step_seconds, tokens_per_second)",
        ),
    ],
)
def test_an_empty_or_foreign_directory_is_refused_with_what_was_expected(
    tmp_path, capsys, make, message
):
    directory = tmp_path / "dir"
    directory.mkdir()
    make(directory)
    assert main.main(["report", str(directory), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain report: ") and message in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_missing_directory_is_refused(tmp_path, capsys):
    assert main.main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
