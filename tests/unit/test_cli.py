"""The command line: `meshtrain validate` reports every problem and exits 2."""

import yaml

from meshtrain.api import loading, spec
from meshtrain.cli import main
from tests.builders import JobBuilder


def test_validate_accepts_a_good_job(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            spec.to_manifest(
                "ok", loading.parse_spec(JobBuilder().layout(2, 2, 2, gpus_per_node=4).raw())
            )
        )
    )
    assert main.main(["validate", str(path)]) == 0
    assert "dp2·pp2·tp2" in capsys.readouterr().out


def test_validate_lists_every_problem_and_exits_2(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "bad"},
                "spec": JobBuilder().layout(2, 3, 3, gpus_per_node=4).raw(),
            }
        )
    )
    assert main.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.parallelism.tensor" in err and "spec.model.heads" in err and str(path) in err
