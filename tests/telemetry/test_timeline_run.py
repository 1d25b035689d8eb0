"""The timeline picture of the real dp2·pp2·tp1 run scraped in conftest."""

from __future__ import annotations

import matplotlib.image
import pytest

from meshtrain.trainer.telemetry import timeline, trace
from tests.telemetry.conftest import MICRO_BATCHES

pytestmark = pytest.mark.slow


def test_timeline_png_of_the_real_run(scraped_run, tmp_path):
    out = tmp_path / "timeline.png"
    view = timeline.render(scraped_run.log_dir, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[1] > 1000 and image[..., :3].std() > 0.05
    assert view.rows == ["stage 0", "stage 1", "stage 0 all-reduce", "stage 1 all-reduce"]
    traces = trace.read_trace(scraped_run.log_dir)
    for stage, rank in ((0, 0), (1, 2)):  # dp 0, tp 0 of each stage
        blocks = [b for b in view.blocks if b.row == f"stage {stage}"]
        for kind in ("forward", "backward"):
            assert sorted(int(b.label) for b in blocks if b.kind == kind) == list(
                range(MICRO_BATCHES)
            )
        line = next(line for line in traces[rank] if line["step"] == view.step)
        buckets = [e for e in line["events"] if e["what"] == "collective" and e["group"] == "dp"]
        assert (
            len([b for b in view.blocks if b.row == f"stage {stage} all-reduce"])
            == len(buckets)
            >= 1
        )
        # 1f1b: a stage's blocks never overlap and follow the schedule's order
        ordered = sorted(blocks, key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(ordered, ordered[1:]))
    assert min(view.bubble.values()) >= 0.0 and max(view.bubble.values()) < 1.0
