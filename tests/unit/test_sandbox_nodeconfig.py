"""The sandbox node's configuration files (pure builders), read back by independent parsers."""

from __future__ import annotations

import ipaddress
import pathlib
import tomllib

from meshtrain.sandbox import nodeconfig, nodes

STATE = pathlib.Path("/tmp/some-sandbox")


def test_addresses_are_derived_from_the_state_dir_and_skip_taken_indices() -> None:
    first = nodeconfig.addresses(STATE, set())
    assert nodeconfig.addresses(STATE, set()) == first
    other = nodeconfig.addresses(STATE, {first.index})
    assert other.index != first.index and other.netns != first.netns
    for net in (first, other):
        # Linux interface names are at most 15 bytes.
        assert len(net.host_link) <= 15 and len(net.node_link) <= 15
        link = ipaddress.ip_network(net.link_cidr)
        assert ipaddress.ip_address(net.host_ip) in link
        assert ipaddress.ip_address(net.node_ip) in link
        assert not ipaddress.ip_network(net.pod_cidr).overlaps(link)


def test_no_free_index_is_an_error_that_says_what_to_do() -> None:
    try:
        nodeconfig.addresses(STATE, set(range(256)))
    except RuntimeError as err:
        assert "sandbox down" in str(err)
    else:
        raise AssertionError("expected RuntimeError")


def test_containerd_config_is_version_3_with_private_paths_and_cgroupfs(
    tmp_path: pathlib.Path,
) -> None:
    text = nodeconfig.containerd_config(
        root=tmp_path / "root",
        state=tmp_path / "state",
        socket=tmp_path / "c.sock",
        cni_conf_dir=tmp_path / "cni",
        pause_image="localhost/pause:1",
    )
    config = tomllib.loads(text)
    assert config["version"] == 3
    assert config["root"] == str(tmp_path / "root") and config["grpc"]["address"] == str(
        tmp_path / "c.sock"
    )
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    runc = runtime["containerd"]["runtimes"]["runc"]
    assert runc["options"]["SystemdCgroup"] is False
    assert runc["options"]["Root"].startswith(str(tmp_path / "state"))
    assert runtime["netns_mounts_under_state_dir"] is True
    assert runtime["cni"]["conf_dir"] == str(tmp_path / "cni")
    assert (
        config["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
        == "localhost/pause:1"
    )


def test_cni_bridge_uses_the_pod_subnet_without_masquerade() -> None:
    net = nodeconfig.addresses(STATE, set())
    bridge = nodeconfig.cni_config(net)["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"] == [[{"subnet": net.pod_cidr}]]


def test_kubelet_runs_on_cgroup_v1_with_cgroupfs_and_cluster_dns_on_the_host_end(
    tmp_path: pathlib.Path,
) -> None:
    net = nodeconfig.addresses(STATE, set())
    config = nodeconfig.kubelet_config(
        net=net,
        socket=tmp_path / "c.sock",
        ca_file=tmp_path / "ca.crt",
        cgroup_root="/x",
        resolv_conf=tmp_path / "resolv.conf",
    )
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["clusterDNS"] == [net.host_ip] and config["address"] == net.node_ip
    assert config["authentication"]["anonymous"]["enabled"] is False


def test_coredns_listens_only_on_the_host_end_of_the_link(tmp_path: pathlib.Path) -> None:
    net = nodeconfig.addresses(STATE, set())
    text = nodeconfig.corefile(net=net, kubeconfig=tmp_path / "k")
    binds = [line.split()[1] for line in text.splitlines() if line.strip().startswith("bind ")]
    assert binds and set(binds) == {net.host_ip}
    assert "forward" not in text


def test_gpu_patch_adds_the_extended_resource_to_capacity() -> None:
    patch = nodeconfig.gpu_capacity_patch(4)
    assert patch == [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "4"}]
    node = nodes.NodeSpec(name="n", block="b", leaf="l", gpus=4)
    labels = nodeconfig.node_labels(node)
    assert labels[nodes.BLOCK_LABEL] == "b" and labels[nodes.LEAF_LABEL] == "l"
