"""The LocalQueue a job that names none is put in when the cluster requires Kueue (a table).

tests/integration/operator/test_operator_kueue_required.py runs it against a real Kueue.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshtrain.cli import main
from meshtrain.operator.policy import kueue_workload, queue_defaulting
from tests.builders import JobBuilder

QUEUED = {"type": "Queued", "status": "False", "reason": "Admitted", "message": "admitted"}
PLACED = [{"node": "n1", "pods": [0]}]


def body(labels: dict[str, str] | None = None, **status: Any) -> dict[str, Any]:
    manifest = JobBuilder("llm", "team").manifest()
    manifest["metadata"].update(resourceVersion="41", labels=labels or {})
    manifest["status"] = status
    return manifest


@pytest.mark.parametrize(
    ("case", "job", "labelled"),
    [
        ("new job, no label", body(), True),
        ("empty label", body({kueue_workload.QUEUE_LABEL: ""}), True),
        ("pending, not yet placed", body(phase="Pending"), True),
        ("its own label", body({kueue_workload.QUEUE_LABEL: "team-queue"}), False),
        ("finished", body(phase="Failed"), False),
        (
            "placed before the requirement, never queued",
            body(phase="Running", placement=PLACED),
            False,
        ),  # fmt: skip
        (
            "queued, label removed while admitted",
            body(phase="Running", placement=PLACED, conditions=[QUEUED]),
            True,
        ),  # fmt: skip
    ],
)
def test_a_job_naming_no_queue_is_labelled_unless_it_runs_as_admitted_before(
    case: str, job: dict[str, Any], labelled: bool
) -> None:
    patch = queue_defaulting.label_patch(job, queue_defaulting.KUEUE_DEFAULT)
    if not labelled:
        assert patch is None, case
        return
    assert patch == {
        "metadata": {
            "labels": {kueue_workload.QUEUE_LABEL: "default"},
            "resourceVersion": "41",  # decided on this version: a changed job is decided again
        }
    }, case


def test_without_a_default_queue_nothing_is_labelled() -> None:
    assert queue_defaulting.label_patch(body(), None) is None
    assert queue_defaulting.label_patch(body(), "") is None


def test_the_event_names_the_label_the_queue_and_the_way_out() -> None:
    said = queue_defaulting.message("default")
    assert 'metadata.labels["kueue.x-k8s.io/queue-name"] set to "default"' in said
    assert "set the label to choose another LocalQueue" in said


def test_the_operator_takes_the_default_queue_from_its_flag_or_env_and_refuses_a_bad_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MESHTRAIN_DEFAULT_QUEUE", raising=False)
    assert main.build_parser().parse_args(["operator"]).default_queue is None
    monkeypatch.setenv("MESHTRAIN_DEFAULT_QUEUE", "default")
    assert main.build_parser().parse_args(["operator"]).default_queue == "default"
    for bad in ("Team_Queue", "q" * 254):
        assert main.main(["operator", "--default-queue", bad]) == 2  # before kopf starts
        assert "cannot name a LocalQueue" in capsys.readouterr().err
