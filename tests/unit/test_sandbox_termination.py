"""The node agent reports a container's termination-log file as the kubelet does."""

from meshtrain.sandbox import nodeagent, podstatus


def test_reads_the_file(tmp_path):
    log = tmp_path / "termination-log-trainer"
    log.write_text('{"step": 40, "last_checkpoint_step": 40}\n')
    assert nodeagent._termination_message(str(log)) == '{"step": 40, "last_checkpoint_step": 40}\n'


def test_keeps_only_the_tail_the_kubelet_would(tmp_path):
    log = tmp_path / "termination-log-trainer"
    log.write_text("x" * 10_000 + "END")
    message = nodeagent._termination_message(str(log))
    assert len(message) == podstatus.TERMINATION_MESSAGE_LIMIT and message.endswith("END")


def test_no_file_or_no_path_is_no_message(tmp_path):
    assert nodeagent._termination_message(str(tmp_path / "never-written")) == ""
    assert nodeagent._termination_message("") == ""
