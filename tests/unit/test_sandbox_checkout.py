"""``python -m meshtrain.sandbox up`` outside a checkout says so, instead of failing on a missing
script later."""

from __future__ import annotations

import pathlib

import pytest

from meshtrain.sandbox import __main__ as sandbox_main
from meshtrain.sandbox import supervisor


def test_up_outside_a_checkout_names_the_checkout(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(supervisor, "REPO", tmp_path / "site-packages")
    code = sandbox_main.main(["--state-dir", str(tmp_path / "state"), "up"])
    assert code == 69
    message = capsys.readouterr().err
    assert "runs from a checkout of meshtrain" in message and "make run" in message
    assert not (tmp_path / "state").exists(), "nothing started, nothing written"
