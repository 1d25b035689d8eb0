"""The strict schema of rank 0's progress document, table-driven: what passes, what is dropped and why."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from meshtrain.operator.policy import progress_report, progress_status
from meshtrain.trainer.guards import stragglers as trainer_stragglers
from meshtrain.trainer.telemetry import progress as trainer_progress
from meshtrain.trainer.telemetry import recoveries as trainer_recoveries
from tests.unit.test_recoveries_log import record as recovery_record

TRAINER_DOCUMENT = {
    "step": 120,
    "loss": 2.5,
    "tokens_per_second": 4096.0,
    "last_checkpoint_step": 100,
    "updated_at": "2026-01-01T12:00:00Z",
    "eval_loss": 2.75,
    "skipped_updates": 1,
    "straggler": {"rank": 3, "slowdown": 1.8, "since_step": 90},
    "stragglers": [{"rank": 3, "slowdown": 1.8, "since_step": 90}],
    "gradient_noise_scale": 512.0,
    "resumed_from_uid": "0b6c1f5e-6f8e-4c7a-9a43-3f1e2d4c5b6a",
    "recovery": [  # the trainer's own JSON form of a record
        dataclasses.replace(
            recovery_record(1),
            cause="exit 1",
            resumed_step=40,
            source="memory",
            lost_steps=2,
            first_step_at=102.0,
            nodes={"gpu-b0-l0-n1": (3,)},
        ).to_json()
    ],
    "recovery_counts": {"process": 1, "container": 0, "pod": 0},
    "goodput": {
        "ratio": 0.875,
        "productive_seconds": 3500.0,
        "wall_seconds": 4000.0,
        "lost_seconds": {"detection": 1.5, "restart": 20.0, "reload": 3.5, "recompute": 40.0},
    },
}
"""Every field the trainer sends (meshtrain.trainer.telemetry.progress.FIELDS, and ``recovery``
and ``recovery_counts`` once it recovered in place)."""


def parse(doc: object) -> progress_report.Reading:
    return progress_report.parse(json.dumps(doc).encode())


def test_the_trainers_document_passes_whole():
    reading = parse(TRAINER_DOCUMENT)
    assert reading.document == TRAINER_DOCUMENT and reading.notes == ()


def test_the_schema_knows_every_field_the_trainer_sends():
    assert set(progress_report.FIELDS) == set(TRAINER_DOCUMENT)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", -1),
        ("step", 2**64),
        ("step", 10**3000),
        ("step", 1.5),
        ("step", True),
        ("step", "17"),
        ("step", None),
        ("loss", "low"),
        ("loss", 10**400),
        ("tokens_per_second", -5.0),
        ("last_checkpoint_step", [1]),
        ("updated_at", "yesterday"),
        ("updated_at", "2026-01-01T12:00:00"),  # no offset
        ("updated_at", "2026-01-01T12:00:00Z" + " " * 100),
        ("eval_loss", {"v": 1}),
        ("skipped_updates", -1),
        ("straggler", {"rank": -1, "slowdown": 2.0}),
        ("straggler", {"rank": 1, "slowdown": 0}),
        ("straggler", {"rank": 1, "slowdown": 2.0, "since_step": "x"}),
        ("straggler", "rank 3"),
        ("stragglers", [{"rank": 1, "slowdown": 2.0}] * 17),
        ("stragglers", [{"rank": 1}]),
        ("stragglers", None),
        ("gradient_noise_scale", 0),
        ("resumed_from_uid", "../../etc"),
        ("resumed_from_uid", "0b6c1f5e-6f8e-4c7a-9a43-3f1e2d4c5b6a" * 100),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "ratio": 1.5}),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "wall_seconds": -1}),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "wall_seconds": 3000.0}),  # < productive + lost
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "wall_seconds": True}),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "extra": 1}),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "lost_seconds": {"detection": 1}}),
        ("goodput", {**TRAINER_DOCUMENT["goodput"], "lost_seconds": [1, 2, 3, 4]}),
        ("goodput", [0.5]),
    ],
)
def test_a_field_out_of_the_schema_is_dropped_with_a_note_naming_it(field, value):
    reading = parse({"step": 5, field: value} if field != "step" else {field: value})
    assert reading.document is not None and field not in reading.document
    assert len(reading.notes) == 1 and reading.notes[0].startswith(f"{field}:")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"step": 1, "step": 2}', "duplicate key 'step'"),
        (b'{"step": 1, "loss": NaN}', "NaN is not a number JSON allows"),
        (b'{"step": 1, "loss": -Infinity}', "-Infinity is not a number JSON allows"),
        (b'{"step": 1', "not UTF-8 JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b"[" * 5000 + b"]" * 5000, "more than 4096 bytes"),
        (b"[" * 2000 + b"]" * 2000, "nested too deep"),
        (b'{"a": "\xff"}', "not UTF-8 JSON"),
        (b"\x00\x01binary", "not UTF-8 JSON"),
    ],
)
def test_a_body_that_is_no_json_object_is_refused_whole(body, why):
    reading = progress_report.parse(body)
    assert reading.document is None
    assert len(reading.notes) == 1 and why in reading.notes[0]


def test_deep_nesting_is_refused_whatever_the_recursion_limit():
    """torch's compiler raises the interpreter's recursion limit in the operator's process's
    neighbours (the test suite's): the parser's RecursionError cannot be the bound."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        reading = progress_report.parse(b"[" * 2000 + b"]" * 2000)
    finally:
        sys.setrecursionlimit(limit)
    assert reading.document is None and "nested too deep" in reading.notes[0]


def test_brackets_and_escaped_quotes_inside_strings_are_not_nesting():
    body = json.dumps({"step": 3, "note": '"' + "[{" * 20 + '\\"'}).encode()
    reading = progress_report.parse(body)
    assert reading.document is not None and reading.document["step"] == 3, reading.notes


def test_nulls_the_trainer_sends_before_its_first_step_are_kept():
    doc = {"step": 0, "loss": None, "updated_at": None, "straggler": None, "eval_loss": None}
    assert parse(doc).document == doc


def test_unknown_fields_are_dropped_and_quoted_bounded():
    reading = parse({"step": 1, "x" * 1000: 1, "extra": 2, "third": 3})
    assert reading.document == {"step": 1}
    (note,) = reading.notes
    assert note.startswith("3 unknown field(s) ignored") and len(note) < 120


def test_notes_are_bounded_in_number():
    reading = parse({key: "junk" for key in progress_report.FIELDS})
    assert reading.document == {}
    assert len(reading.notes) == progress_report.MAX_NOTES
    more = len(progress_report.FIELDS) - progress_report.MAX_NOTES + 1
    assert reading.notes[-1] == f"and {more} more field(s) ignored"


def test_goodput_becomes_status_goodput_in_camel_case():
    changes = progress_status.status_changes(parse(TRAINER_DOCUMENT).document)
    assert changes["goodput"] == {
        "ratio": 0.875,
        "productiveSeconds": 3500.0,
        "wallSeconds": 4000.0,
        "lostSeconds": {"detection": 1.5, "restart": 20.0, "reload": 3.5, "recompute": 40.0},
    }


def test_the_goodput_ratio_is_derived_from_the_seconds():
    sent = {**TRAINER_DOCUMENT, "goodput": {**TRAINER_DOCUMENT["goodput"], "ratio": 0.99}}
    assert progress_status.status_changes(parse(sent).document)["goodput"]["ratio"] == 0.875
    # productive + lost may pass wall by 1% + 1 s (rounding, another pod's clock), not more
    wall = (3500.0 + 65.0 - 1.0) / 1.01
    near = {**TRAINER_DOCUMENT["goodput"], "wall_seconds": wall + 0.01}
    assert parse({**TRAINER_DOCUMENT, "goodput": near}).document["goodput"] is not None
    far = {**TRAINER_DOCUMENT["goodput"], "wall_seconds": wall - 0.01}
    assert "goodput" not in parse({**TRAINER_DOCUMENT, "goodput": far}).document


def test_a_hostile_termination_message_changes_nothing():
    assert progress_status.from_termination_message('{"step": 12, "loss": NaN}') == {}
    assert progress_status.from_termination_message('{"step": 1e400}') == {}


@pytest.mark.parametrize(
    ("failures", "wait"), [(0, 10.0), (1, 20.0), (2, 40.0), (5, 300.0), (10**6, 300.0)]
)
def test_polls_of_a_failing_pod_slow_down_to_five_minutes(failures, wait):
    assert progress_report.wait_after(failures, 10.0) == wait


def test_a_poll_interval_above_the_cap_is_kept():
    assert progress_report.wait_after(3, 600.0) == 600.0


def test_the_trainers_largest_document_fits_and_passes():
    doc = trainer_progress.Progress()
    doc.update(
        step=progress_report.MAX_INTEGER,
        loss=-1.2345678901234567e-300,
        tokens_per_second=1.2345678901234567e300,
        last_checkpoint_step=progress_report.MAX_INTEGER,
        eval_loss=-1.2345678901234567e-300,
        skipped_updates=progress_report.MAX_INTEGER,
        gradient_noise_scale=1.2345678901234567e300,
        resumed_from_uid="0b6c1f5e-6f8e-4c7a-9a43-3f1e2d4c5b6a",
        goodput={
            "ratio": 0.12345678901234567,
            "productive_seconds": 1.2345678901234567e299,  # as long as e300; within the wall
            "wall_seconds": 1.2345678901234567e300,
            "lost_seconds": dict.fromkeys(progress_report.GOODPUT_PHASES, 1.2345678901234567e299),
        },
    )
    flags = tuple(
        trainer_stragglers.Flag(65535 - i, 1.2345678901234567e300, progress_report.MAX_INTEGER)
        for i in range(100)
    )
    doc.straggler_verdict(trainer_stragglers.Verdict(1, (), flags))
    many = tuple(range(65535, 65435, -1))
    for generation in range(3):  # the document keeps the newest two
        record = trainer_recoveries.Recovery(
            generation=progress_report.MAX_INTEGER - generation,
            tier="process",
            cause="x" * 500,
            ranks=many,
            failed_at=1.2345678901234567e300,
            detected_at=1.2345678901234567e300,
            rejoined_at=1.2345678901234567e300,
            restored_at=1.2345678901234567e300,
            resumed_step=progress_report.MAX_INTEGER,
            source="storage",
            lost_steps=progress_report.MAX_INTEGER,
            first_step_at=1.2345678901234567e300,
            nodes={f"{i}".rjust(n, "n"): many for i, n in enumerate((63, 64, 63, 63))},
        )
        counts = dict.fromkeys(progress_report.COUNTED_TIERS, progress_report.MAX_INTEGER)
        doc.recovered(record.to_json(), counts)
    body = json.dumps(doc.document()).encode()
    assert len(body) <= progress_report.BODY_LIMIT
    assert trainer_progress.MAX_STRAGGLERS == progress_report.MAX_STRAGGLERS
    reading = progress_report.parse(body)
    assert reading.notes == () and len(reading.document["stragglers"]) == 16
    names = [[len(n["node"]) for n in r["nodes"]] for r in reading.document["recovery"]]
    assert names == [[63, 63], [63, 63]], reading.document["recovery"]  # the 64 left out
