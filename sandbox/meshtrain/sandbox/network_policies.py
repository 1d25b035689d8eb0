"""The sandbox's NetworkPolicy enforcer: kube-router's firewall beside each node's kube-proxy.

The bridge CNI enforces no NetworkPolicy; kube-router (built by scripts/bootstrap.sh from its
Go module), run with only its network policy controller, does: iptables chains and ipsets in
the node's network namespace, for traffic bridged between pods (br_netfilter) and routed
between nodes.  kube-network-policies was the first choice, but it needs the nf_tables
``queue`` expression (nft_queue), which kernels built without it (this machine's) lack;
kube-router needs only iptables, ipset and the physdev match.
"""

from __future__ import annotations

import os
import pathlib

from meshtrain.sandbox.controlplane import binaries

DEFAULT_VERSION = "v2.1.0"
VERSION = os.environ.get("MESHTRAIN_KUBE_ROUTER_VERSION", DEFAULT_VERSION)
NAME = "kube-router"


def locate() -> pathlib.Path:
    """The enforcer's binary, or :class:`binaries.BinariesMissingError` saying how to build it."""
    return binaries.module_binary(NAME, VERSION, "github.com/cloudnativelabs/kube-router/v2")


def command(
    binary: pathlib.Path,
    *,
    netns: str,
    node_name: str,
    kubeconfig: pathlib.Path,
    service_range: str,
) -> list[str]:
    """kube-router's firewall alone, in the node's network namespace, as the node's kubelet is."""
    return [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "--",
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        "--enable-ibgp=false",
        "--enable-overlay=false",
        f"--service-cluster-ip-range={service_range}",
        "--metrics-port=0",
        "--v=1",
    ]
