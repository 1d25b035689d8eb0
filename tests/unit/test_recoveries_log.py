"""recoveries.jsonl: the record's JSON form, appending, the bounded read, and the progress document's copy."""

from __future__ import annotations

import json

from meshtrain.trainer.telemetry import progress, recoveries


def record(generation: int) -> recoveries.Recovery:
    return recoveries.Recovery(
        generation=generation,
        tier="process",
        cause="SIGKILL",
        ranks=(3,),
        failed_at=100.0,
        detected_at=100.5,
        rejoined_at=101.0,
        restored_at=101.5,
        resumed_step=4,
        source="storage",
        lost_steps=1,
        first_step_at=102.25,
        nodes={"gpu-7": (3,)},
    )


def test_a_record_is_one_camel_case_line(tmp_path):
    path = recoveries.append(tmp_path, record(1))
    assert path.name == "recoveries.jsonl"
    assert json.loads(path.read_text()) == {
        "generation": 1,
        "tier": "process",
        "cause": "SIGKILL",
        "ranks": [3],
        "failedAt": 100.0,
        "detectedAt": 100.5,
        "rejoinedAt": 101.0,
        "restoredAt": 101.5,
        "resumedStep": 4,
        "source": "storage",
        "lostSteps": 1,
        "firstStepAt": 102.25,
        "nodes": [{"node": "gpu-7", "ranks": [3]}],
    }


def test_read_is_bounded_and_skips_partial_lines(tmp_path):
    for generation in range(1, 6):
        recoveries.append(tmp_path, record(generation))
    path = tmp_path / recoveries.FILENAME
    with path.open("a") as out:
        out.write('{"generation": 9')  # a write cut short
    assert [r["generation"] for r in recoveries.read(path, limit=3)] == [3, 4, 5]
    assert recoveries.read(tmp_path / "missing.jsonl") == []


def test_read_of_a_huge_file_reads_only_its_end(tmp_path):
    path = tmp_path / recoveries.FILENAME
    path.write_text("x" * (recoveries.MAX_READ_BYTES * 2) + "\n")
    recoveries.append(tmp_path, record(7))
    assert [r["generation"] for r in recoveries.read(path)] == [7]


def test_the_progress_document_keeps_the_newest_records():
    doc = progress.Progress()
    assert progress.RECOVERY not in doc.document()  # absent until the first recovery
    for generation in range(1, 5):
        doc.recovered(record(generation).to_json())
    kept = doc.document()[progress.RECOVERY]
    assert [r["generation"] for r in kept] == [1, 2, 3, 4][-recoveries.RECENT :]
    assert progress.RECOVERY_COUNTS not in doc.document(), "none given: an older caller"
    doc.recovered(record(5).to_json(), {"process": 5, "container": 0, "pod": 0})
    assert doc.document()[progress.RECOVERY_COUNTS] == {"process": 5, "container": 0, "pod": 0}
