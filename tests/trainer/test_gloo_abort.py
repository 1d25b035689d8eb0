"""The watcher's gloo abort: shutting down the gloo sockets frees a blocked collective at once, and
leaves the rendezvous store's connection and other connections (an HTTP pool's, opened after the
group or to a service's fixed port while a group is created) alone (docs/recovery.md, "In-process rebuild")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.trainer import launch

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_shutting_down_gloo_sockets_frees_a_blocked_all_reduce(tmp_path: Path) -> None:
    port, out = launch.free_port(), tmp_path / "rank0.json"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "mt_abort.py"), str(rank), str(port), str(out)]
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.wait(timeout=120)
    result = json.loads(out.read_text())
    assert result["error"], "the all_reduce returned although its peer never joined"
    assert result["shut"] and result["shut"][0] >= 1  # the pair's socket, not the store's
    assert result["seconds"] < 10, result  # the peer sleeps up to 60 s: only the abort freed it
    assert result["store"] == "still here"
    assert result["http"] == "GET / HTTP/1.1\r\n\r\n", result  # not gloo's: left alone
    assert result["pool"] == "PUT /bucket/key HTTP/1.1\r\n\r\n", result  # a service's port
    assert result["shut"][0] == result["tracked"], result  # only the sockets found as gloo's
