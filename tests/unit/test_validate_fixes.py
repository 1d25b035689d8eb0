"""``meshtrain validate`` names the fix (issue #37 item 5): did-you-mean for unknown fields,
duplicate keys with both lines, YAML errors with the file, line and column.

The expected field names come from the generated CRD schema (what the API server knows), not
from the loader's own walk of the model; the CLI runs as a user runs it, in a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshtrain.api import crd, limits, loading, suggest
from meshtrain.cli import main
from tests.builders import JobBuilder


def validate(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``meshtrain validate PATH`` through the CLI's module, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "validate", str(path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _sections(
    node: dict[str, Any], path: tuple[str | int, ...] = ()
) -> list[tuple[tuple[str | int, ...], list[str]]]:
    """(path, field names) of every object of the CRD's spec schema with fields of its own."""
    found = []
    if node.get("items"):
        found += _sections(node["items"], (*path, 0))
    properties = node.get("properties") or {}
    if properties:
        found.append((path, list(properties)))
    for name, child in properties.items():
        found += _sections(child, (*path, name))
    return found


SECTIONS = _sections(crd.spec_schema())


def _typo(name: str, known: list[str]) -> str | None:
    """A misspelling of ``name`` no other field has: lower case, else a letter too many."""
    typo = name.lower() if name.lower() != name else f"{name}x"
    return None if typo in known else typo


def _nested(path: tuple[str | int, ...], leaf: dict[str, Any]) -> Any:
    """``leaf`` placed at ``path`` (a list index becomes a one-item list)."""
    value: Any = leaf
    for item in reversed(path):
        value = [value] if isinstance(item, int) else {item: value}
    return value


def _where(path: tuple[str | int, ...], key: str) -> str:
    text = "spec"
    for item in (*path, key):
        text += f"[{item}]" if isinstance(item, int) else f".{item}"
    return text


CASES = [
    (path, name, typo)
    for path, known in SECTIONS
    for name in known
    if (typo := _typo(name, known)) is not None
]


def test_the_schema_has_the_sections_a_user_misspells():
    paths = {path for path, _ in SECTIONS}
    assert {(), ("training",), ("parallelism",), ("model",), ("training", "datasets", 0)} <= paths
    assert len(CASES) > 100


@pytest.mark.parametrize("path,name,typo", CASES, ids=[_where(p, t) for p, _, t in CASES])
def test_every_misspelt_field_is_answered_with_the_real_one(path, name, typo):
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(_nested(path, {typo: 1}))
    where = _where(path, typo)
    messages = [p.message for p in err.value.problems if p.path == where]
    assert messages, (where, [str(p) for p in err.value.problems])
    suggested = messages[0].split("did you mean ", 1)[1].rstrip("?").split(" or ")
    assert name in suggested, messages[0]
    assert set(suggested) <= set(dict(SECTIONS)[path]), messages[0]  # real fields of that section


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_validate_suggests_learning_rate_for_learningrate(tmp_path):
    known = dict(SECTIONS)[("training",)]
    assert "learningRate" in known and "learningrate" not in known
    run = validate(
        _written(tmp_path, yaml.safe_dump(JobBuilder().training(learningrate=3e-4).manifest()))
    )
    assert run.returncode == 2, run
    assert "spec.training.learningrate: unknown field" in run.stderr
    assert "did you mean learningRate?" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_misspelt_section_is_one_line_naming_the_section_and_not_its_subtree(tmp_path):
    assert "parallelism" in dict(SECTIONS)[()]
    manifest = JobBuilder().layout(2, 2, 2, gpus_per_node=4).parallelism(microBatches=4).manifest()
    manifest["spec"]["paralelism"] = manifest["spec"].pop("parallelism")
    run = validate(_written(tmp_path, yaml.safe_dump(manifest)))
    assert run.returncode == 2, run
    lines = [line for line in run.stderr.splitlines() if "paralelism" in line]
    assert lines == [
        "  - spec.paralelism: unknown field: not permitted in spec; did you mean parallelism?"
    ]
    assert "microBatches" not in run.stderr and "mapping" not in run.stderr


def test_a_misspelt_top_level_field_is_answered_with_the_objects_field(tmp_path):
    version = crd.build()["spec"]["versions"][0]
    assert "spec" in version["schema"]["openAPIV3Schema"]["properties"]  # the object's fields
    manifest = JobBuilder().manifest()
    manifest["specs"] = manifest.pop("spec")
    run = validate(_written(tmp_path, yaml.safe_dump(manifest)))
    assert run.returncode == 2, run
    assert (
        "  - specs: unknown field: not permitted in a TrainingJob; did you mean spec?" in run.stderr
    )


def test_a_duplicate_key_at_any_depth_names_it_both_lines_and_the_file(tmp_path):
    text = yaml.safe_dump(JobBuilder().training(steps=5).manifest(), sort_keys=False)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == "steps: 5")
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, f"{indent}steps: 7")
    path = _written(tmp_path, "\n".join(lines) + "\n")
    run = validate(path)
    assert run.returncode == 2, run
    assert (
        f"{path}: not valid YAML: duplicate key 'steps' at line {at + 2} (first at line {at + 1})"
        in run.stderr
    )
    assert (
        yaml.safe_load(path.read_text())["spec"]["training"]["steps"] == 7
    )  # PyYAML alone keeps the last


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    text = yaml.safe_dump(JobBuilder().manifest(), sort_keys=False).replace("kind: ", "kind: [", 1)
    path = _written(tmp_path, text)
    with pytest.raises(yaml.MarkedYAMLError) as plain:  # where PyYAML itself says it is
        yaml.safe_load(text)
    mark = plain.value.problem_mark
    run = validate(path)
    assert run.returncode == 2, run
    assert f"{path}: not valid YAML: line {mark.line + 1}, column {mark.column + 1}: " in run.stderr
    assert "<unicode string>" not in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "name,known,expected",
    [
        ("learningrate", ["learningRate", "minLearningRate", "steps"], ["learningRate"]),
        ("learning_rate", ["learningRate", "minLearningRate"], ["learningRate"]),
        ("LEARNING-RATE", ["learningRate"], ["learningRate"]),
        ("paralelism", ["parallelism", "resources", "model"], ["parallelism"]),
        ("microbatch", ["microBatches", "microBatch"], ["microBatch"]),
        ("stepz", ["steps", "seed"], ["steps"]),
        ("zzzz", ["steps", "seed"], []),
        ("steps", ["steps"], []),  # never the name itself
        ("x" * 200, ["x" * 199], []),  # a hostile key: no search
    ],
)
def test_closest(name, known, expected):
    assert suggest.closest(name, known) == expected


def test_closest_offers_at_most_the_limit_best_first():
    names = suggest.closest("dat", ["data", "date", "dato", "datum", "steps"], limit=2)
    assert len(names) == 2 and set(names) <= {"data", "date", "dato"}


def test_did_you_mean():
    assert suggest.did_you_mean("seqlen", ["seqLen", "layers"]) == "did you mean seqLen?"
    assert suggest.did_you_mean("qqq", ["seqLen"]) == ""


# --- the persistence warning -------------------------------------------------------------------

README_FIRST = Path(__file__).parents[2] / "manifests" / "examples" / "tiny-cpu.yaml"


def test_the_cluster_only_persistence_warning_is_one_short_line_and_absent_with_local():
    cluster = validate(README_FIRST)
    assert cluster.returncode == 0, cluster
    [warned] = [line for line in cluster.stderr.splitlines() if line.startswith("warning:")]
    assert "spec.checkpoint.claimName is not set" in warned and len(warned) <= 200, warned
    local = validate(README_FIRST, "--local")  # for meshtrain run: checkpoints stay on this disk
    assert local.returncode == 0, local
    assert "claimName" not in local.stderr, local.stderr


# --- input handling: directories, several files, several documents ----------------------------


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``meshtrain validate ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main.main(["validate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_directory_is_said_to_be_one(tmp_path, capsys):
    code, _, err = _run(capsys, str(tmp_path))
    assert code == 2
    assert "is a directory, not a file" in err and "file not found" not in err, err


def test_several_files_are_each_checked_and_any_failure_fails(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(JobBuilder("good").manifest()))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(JobBuilder("bad").training(steps=-1).manifest()))
    code, out, err = _run(capsys, str(good), str(good))
    assert code == 0 and out.count("valid TrainingJob") == 2, (out, err)
    code, out, err = _run(
        capsys, str(bad), str(good)
    )  # the good one after a bad one is checked too
    assert code == 2
    assert f"{good}: valid TrainingJob" in out and f"{bad} is not a valid TrainingJob" in err


def test_a_file_of_several_documents_has_its_trainingjobs_checked(tmp_path, capsys):
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"}}
    job = JobBuilder("kept").checkpoint(claimName="ckpt").manifest()
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([claim, job]) + "---\n")  # a trailing --- is an empty one
    code, out, err = _run(capsys, str(both))
    assert code == 0, err
    assert f"{both} (document 2): valid TrainingJob" in out
    assert f"note: {both} (document 1): a PersistentVolumeClaim, not a TrainingJob" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump_all([claim, JobBuilder("b").training(steps=-1).manifest()]))
    assert _run(capsys, str(broken))[0] == 2
    none = tmp_path / "none.yaml"
    none.write_text(yaml.safe_dump_all([claim, {**claim, "kind": "ConfigMap"}]))
    code, _, err = _run(capsys, str(none))
    assert code == 2 and "none of its 2 YAML documents is a TrainingJob" in err, err


def test_more_documents_than_the_bound_are_refused(tmp_path, capsys):
    many = tmp_path / "many.yaml"
    many.write_text("---\na: 1\n" * (limits.MAX_YAML_DOCUMENTS + 1))
    code, _, err = _run(capsys, str(many))
    assert code == 2 and f"more than {limits.MAX_YAML_DOCUMENTS} YAML documents" in err, err


# --- enum typos and validators' messages -------------------------------------------------------


def _enum(path: tuple[str, ...]) -> list[str]:
    node = crd.spec_schema()
    for name in path:
        node = node["properties"][name]
    return list(node["enum"])


@pytest.mark.parametrize(
    "path,typo,answer",
    [
        (("parallelism", "schedule"), "1F1B", "1f1b"),
        (("tracking", "wandb", "mode"), "ofline", "offline"),
    ],
)
def test_a_misspelt_choice_is_answered_with_the_closest_of_the_schemas(
    tmp_path, capsys, path, typo, answer
):
    assert answer in _enum(path) and typo not in _enum(path)  # the API server's choices
    builder = JobBuilder("typo")
    builder = (
        builder.parallelism(schedule=typo)
        if path[0] == "parallelism"
        else builder.tracking(wandb={"project": "p", "mode": typo})
    )
    job = _written(tmp_path, yaml.safe_dump(builder.manifest()))
    code, _, err = _run(capsys, str(job))
    assert code == 2
    [line] = [line for line in err.splitlines() if f"spec.{'.'.join(path)}:" in line]
    assert f"did you mean {answer}" in line and f"(got '{typo}')" in line, line


def test_a_validators_message_is_said_once_without_pydantics_prefix(tmp_path, capsys):
    job = _written(
        tmp_path, yaml.safe_dump(JobBuilder("t").tracking(mlflow={"trackingUri": "x"}).manifest())
    )
    code, _, err = _run(capsys, str(job))
    assert code == 2
    [line] = [line for line in err.splitlines() if "spec.tracking.mlflow.trackingUri:" in line]
    assert "Value error" not in line and line.count("(got 'x')") == 1, line
