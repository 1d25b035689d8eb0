"""Step log, event trace and the timeline picture, from synthetic pipelines."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from meshtrain.api import loading
from meshtrain.cli import main
from meshtrain.trainer.telemetry import steplog, timeline, trace
from meshtrain.trainer.telemetry.recorder import make_recorder
from tests.builders import JobBuilder
from tests.unit import telemetry_feed


def run(tmp_path, schedule: str, p: int, m: int, v: int = 1, dp: int = 1, steps: int = 2):
    """A dp x pp synthetic run of ``steps`` steps logged under tmp_path; returns the log dir."""
    job = loading.parse_spec(
        JobBuilder()
        .layout(data=dp, pipeline=p)
        .parallelism(microBatches=m, schedule=schedule, virtualStages=v)
        .model(layers=8)
        .metrics(peakFlops=1e12)
        .raw()
    )
    layout = job.parallelism.layout
    recorders = [
        make_recorder(job, layout, r, tmp_path, serve=False) for r in range(layout.world_size)
    ]
    events, seconds = telemetry_feed.simulate_step(
        schedule, p, m, v, fwd=0.01, bwd=0.02, buckets=2, bucket_seconds=0.003
    )
    for step in range(1, steps + 1):
        for rank, rec in enumerate(recorders):
            telemetry_feed.feed(
                rec, step, events[layout.coords(rank).pp], seconds, origin=100.0 + step
            )
    for rec in recorders:
        rec.close()
    return tmp_path


def test_steps_jsonl_from_rank_zero_and_a_trace_per_rank(tmp_path):
    log_dir = run(tmp_path, "1f1b", 2, 4, dp=2)
    records = steplog.read(log_dir / steplog.FILENAME)
    assert [r["step"] for r in records] == [1, 2]
    assert {
        "step",
        "loss",
        "tokens",
        "step_seconds",
        "tokens_per_second",
        "allreduce_seconds",
        "exposed_comm_seconds",
        "bubble_ratio",
        "bubble_ratio_theoretical",
        "mfu",
    } <= set(records[0])
    traces = trace.read_trace(log_dir)
    assert sorted(traces) == [0, 1, 2, 3]
    line = traces[3][0]
    assert (line["pp"], line["dp"], line["tp"], line["schedule"], line["micro_batches"]) == (
        1,
        1,
        0,
        "1f1b",
        4,
    )
    forwards = [e for e in line["events"] if e["what"] == "compute" and e["kind"] == "forward"]
    assert sorted(e["microbatch"] for e in forwards) == [0, 1, 2, 3]
    buckets = [e for e in line["events"] if e["what"] == "collective" and e["group"] == "dp"]
    assert [(e["group"], e["bucket"], e["bytes"]) for e in buckets] == [
        ("dp", 0, 1 << 20),
        ("dp", 1, 1 << 20),
    ]
    assert all(0 <= e["start"] <= e["end"] <= line["seconds"] + 1e-9 for e in line["events"])


@pytest.mark.parametrize(
    "schedule,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2)]
)
def test_timeline_has_a_block_per_micro_batch_and_chunk_on_every_stage(tmp_path, schedule, p, m, v):
    log_dir = run(tmp_path / "logs", schedule, p, m, v)
    out = tmp_path / "timeline.png"
    view = timeline.render(log_dir, out)
    assert view.step == 2
    assert view.rows == [f"stage {s}" for s in range(p)] + [
        f"stage {s} all-reduce" for s in range(p)
    ]
    for s in range(p):
        blocks = [b for b in view.blocks if b.row == f"stage {s}"]
        for kind in ("forward", "backward"):
            labels = sorted((int(b.label), b.chunk) for b in blocks if b.kind == kind)
            assert labels == sorted((mb, c) for mb in range(m) for c in range(v))
        assert [b.label for b in view.blocks if b.row == f"stage {s} all-reduce"] == ["b0", "b1"]
    assert view.bubble_theoretical == pytest.approx((p - 1) / (v * m + p - 1))
    assert f"theoretical {view.bubble_theoretical:.3f}" in view.title
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_timeline_blocks_are_aligned_by_wall_clock(tmp_path):
    view = timeline.render(run(tmp_path / "logs", "gpipe", 2, 4), tmp_path / "t.png")
    first = {s: min(b.start for b in view.blocks if b.row == f"stage {s}") for s in (0, 1)}
    assert first[0] == pytest.approx(0.0, abs=1e-6)
    assert first[1] == pytest.approx(0.01, abs=1e-6)  # stage 1 waits one forward


def test_cli_timeline(tmp_path, capsys):
    log_dir = run(tmp_path / "logs", "1f1b", 2, 4)
    assert main.main(["timeline", str(log_dir), "-o", str(tmp_path / "x.png"), "--step", "1"]) == 0
    assert "step 1" in capsys.readouterr().out
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main.main(["timeline", str(log_dir), "-o", str(tmp_path / "y.png"), "--step", "9"]) == 2
    assert main.main(["timeline", str(tmp_path / "nothing"), "-o", str(tmp_path / "z.png")]) == 2


def test_restarted_run_draws_the_newest_attempt(tmp_path):
    log_dir = run(tmp_path, "gpipe", 2, 2, steps=1)
    traces = trace.read_trace(log_dir)
    stale = json.dumps({**traces[0][0], "bubble_ratio": 0.99})
    (log_dir / "trace" / "rank-0.jsonl").write_text(stale + "\n" + json.dumps(traces[0][0]) + "\n")
    view = timeline.step_view(timeline.stage_traces(log_dir), 1)
    assert view.bubble[0] == pytest.approx(traces[0][0]["bubble_ratio"])
