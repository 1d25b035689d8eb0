"""The loopback gang's environment keeps every file a test's ranks write inside the test's folder.

A stop's CI failed because the DDP example, run by a test as root, wrote its checkpoint to the
pod's ``/checkpoints/<namespace>/<name>`` on the host, and the next run resumed from it past the
step the test waited for.  The paths checked are those the operator's builders give the pod.
"""

from __future__ import annotations

from pathlib import Path

from tests import torchrun_agents


def test_no_path_the_pod_would_write_reaches_the_host_outside_the_tests_folder(
    tmp_path: Path,
) -> None:
    builder = torchrun_agents.ddp_example(10, 2, 1234)
    for pod in torchrun_agents.pods(builder):
        built = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        volume = built["MESHTRAIN_CHECKPOINT_DIR"]
        written = [key for key, value in built.items() if value.startswith(volume)]
        written.append("MESHTRAIN_TERMINATION_LOG")
        # the builders still give the job's own directory
        assert "MESHTRAIN_JOB_CHECKPOINT_DIR" in written
        env = torchrun_agents.loopback_env(pod, 29999, tmp_path / "bin")
        for key in written:
            assert Path(env[key]).is_relative_to(tmp_path), (key, env[key])
        # the job's own directory keeps its place below the volume's root
        assert env["MESHTRAIN_JOB_CHECKPOINT_DIR"] == str(
            tmp_path / Path(built["MESHTRAIN_JOB_CHECKPOINT_DIR"]).relative_to(volume)
        )
