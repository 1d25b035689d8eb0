"""The sandbox node's configuration files (pure builders), read back by independent parsers."""

from __future__ import annotations

import ipaddress
import pathlib
import tomllib

from meshtrain.sandbox import network_policies, nodeconfig, nodes

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


def test_cni_bridge_uses_the_pod_subnet_without_masquerade(tmp_path: pathlib.Path) -> None:
    net = nodeconfig.addresses(STATE, set())
    bridge = nodeconfig.cni_config(net, tmp_path / "ipam")["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"] == [[{"subnet": net.pod_cidr}]]
    assert bridge["ipam"]["dataDir"] == str(tmp_path / "ipam")


def _sandbox_nets(count: int) -> list[nodeconfig.Addresses]:
    nets: list[nodeconfig.Addresses] = []
    for n in range(count):
        nets.append(nodeconfig.addresses(STATE / f"node-{n}", {net.index for net in nets}))
    return nets


def _next_hop(
    routes: list[nodeconfig.Route],
    links: dict[str, set[ipaddress.IPv4Interface]],
    netns: str,
    dst: str,
) -> str | None:
    """The namespace a packet for ``dst`` leaves ``netns`` to (longest prefix: routes, then connected links).

    ``links``: the addresses each namespace (and "host") holds, with their prefixes.
    """
    address = ipaddress.ip_address(dst)
    candidates = [
        (ipaddress.ip_network(r.destination), r.via)
        for r in routes
        if r.netns == netns and address in ipaddress.ip_network(r.destination)
    ]
    candidates += [(i.network, str(address)) for i in links[netns] if address in i.network]
    if not candidates:
        return None
    _, via = max(candidates, key=lambda c: c[0].prefixlen)
    owner = [
        ns for ns, held in links.items() if ns != netns and any(str(i.ip) == via for i in held)
    ]
    if ipaddress.ip_address(via) in {i.ip for i in links[netns]}:
        return netns
    return owner[0] if owner else None


def test_node_routes_join_every_pair_of_nodes_through_the_hub_and_reach_the_api_server() -> None:
    """Walk the routes hop by hop, as the kernel's longest-prefix match would, from each node to every other's pods."""
    nets = _sandbox_nets(3)
    routes = nodeconfig.node_routes(nets)
    links: dict[str, set[ipaddress.IPv4Interface]] = {"host": set()}
    pod_gateway = {}
    for net in nets:
        links["host"].add(ipaddress.ip_interface(f"{net.host_ip}/30"))
        links[net.netns] = {ipaddress.ip_interface(f"{net.node_ip}/30")}
        gateway = ipaddress.ip_interface(f"{ipaddress.ip_network(net.pod_cidr)[1]}/24")
        links[net.netns].add(gateway)
        pod_gateway[net.netns] = str(gateway.ip)
    for ordinal, net in enumerate(nets[1:], start=1):
        peer = nodeconfig.PeerLink(hub=nets[0], ordinal=ordinal)
        links[nets[0].netns].add(ipaddress.ip_interface(f"{peer.hub_ip}/30"))
        links[net.netns].add(ipaddress.ip_interface(f"{peer.node_ip}/30"))
    # The host's routes to each pod /24 (node.setup_network).
    host_routes = [nodeconfig.Route("host", n.pod_cidr, n.node_ip) for n in nets]
    api = nets[0].host_ip
    for source in nets:
        for target in nets:
            pod = str(ipaddress.ip_network(target.pod_cidr)[5])
            hops, here = [source.netns], source.netns
            while here != target.netns and len(hops) < 5:
                here = _next_hop(routes + host_routes, links, here, pod)
                assert here is not None, (hops, pod)
                hops.append(here)
            assert here == target.netns and "host" not in hops, (
                "pod traffic between nodes stays in the nodes' namespaces (the host does not forward)",
                hops,
            )
            assert len(hops) <= 3, hops
        assert _next_hop(routes, links, source.netns, api) == "host", "the API server and CoreDNS"
        assert _next_hop(routes, links, source.netns, "8.8.8.8") is None, "no route off the machine"


def test_peer_links_fit_the_hubs_link_range_and_interface_names() -> None:
    hub = nodeconfig.addresses(STATE, set())
    seen = {hub.host_ip, hub.node_ip}
    for ordinal in (1, nodeconfig.MAX_PEERS):
        peer = nodeconfig.PeerLink(hub=hub, ordinal=ordinal)
        assert len(peer.hub_link) <= 15 and len(peer.node_link) <= 15
        link = ipaddress.ip_network(f"{peer.hub_ip}/30", strict=False)
        assert ipaddress.ip_address(peer.node_ip) in link
        assert link.subnet_of(ipaddress.ip_network(f"{nodeconfig.LINK_PREFIX}.{hub.index}.0/24"))
        assert not seen & {peer.hub_ip, peer.node_ip}
        seen |= {peer.hub_ip, peer.node_ip}
    try:
        nodeconfig.PeerLink(hub=hub, ordinal=nodeconfig.MAX_PEERS + 1)
    except ValueError as err:
        assert "at most" in str(err)
    else:
        raise AssertionError("expected ValueError")


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
        cluster_dns="10.201.7.1",
        pod_logs=tmp_path / "pod-logs",
    )
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["clusterDNS"] == ["10.201.7.1"] and config["address"] == net.node_ip
    assert config["podLogsDir"] == str(tmp_path / "pod-logs")
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


def test_the_policy_enforcer_runs_only_its_firewall_in_the_node() -> None:
    argv = network_policies.command(
        pathlib.Path("/cache/kube-router"),
        netns="mt-node-3",
        node_name="node-a",
        kubeconfig=STATE / "kubeconfig",
        service_range="10.0.0.0/24",
    )
    assert argv[:4] == ["nsenter", "--net=/run/netns/mt-node-3", "--", "/cache/kube-router"]
    assert "--hostname-override=node-a" in argv and f"--kubeconfig={STATE / 'kubeconfig'}" in argv
    assert "--run-firewall=true" in argv
    for other in ("--run-router=false", "--run-service-proxy=false", "--enable-cni=false"):
        assert other in argv  # kube-proxy and the bridge CNI keep their parts


def test_containerd_pulls_through_the_registry_host_configuration(tmp_path: pathlib.Path) -> None:
    text = nodeconfig.containerd_config(
        root=tmp_path / "root",
        state=tmp_path / "state",
        socket=tmp_path / "c.sock",
        cni_conf_dir=tmp_path / "cni",
        pause_image="10.201.7.1:5000/meshtrain/pause:1",
        registry_hosts=tmp_path / "certs.d",
    )
    images = tomllib.loads(text)["plugins"]["io.containerd.cri.v1.images"]
    assert images["registry"]["config_path"] == str(tmp_path / "certs.d")
    assert images["discard_unpacked_layers"] is True
