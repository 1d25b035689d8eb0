"""The peers each gang's NetworkPolicy admits, as the operator reads them from its flags."""

from __future__ import annotations

import argparse
import json

import pytest

from meshtrain.operator import command

PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_the_flags_give_the_operator_and_metrics_peers(monkeypatch) -> None:
    monkeypatch.setenv("MESHTRAIN_GANG_NETWORK_POLICY_METRICS_PEERS", '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]')  # fmt: skip
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["operator", "--gang-network-policy-operator-peers", json.dumps([PEER])]
    )
    peers = command.gang_peers(args)
    assert peers.operator == (PEER,)
    assert peers.metrics == ({"ipBlock": {"cidr": "10.0.0.0/8"}},)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", ["--flag is not JSON", "list of NetworkPolicyPeers"]),
        ('{"podSelector": {}}', ["--flag must be a JSON list"]),
        ("[" + ",".join(["{}"] * 33) + "]", ["at most 32"]),
        ("[{}]", ["--flag[0]", "podSelector"]),
        ('[{"podSelector": {}, "ports": []}]', ["--flag[0]", "ipBlock"]),
        ('["monitoring"]', ["--flag[0] must be an object"]),
    ],
)
def test_bad_peers_are_refused_naming_the_flag_and_the_fix(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        command.parse_peers("--flag", text)
    assert all(word in str(err.value) for word in words), err.value
