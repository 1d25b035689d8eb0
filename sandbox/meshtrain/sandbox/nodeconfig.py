"""Configuration of the sandbox's real nodes: addresses, containerd, CNI, kubelet, kube-proxy, CoreDNS.

Pure builders; :mod:`.node` writes them and starts the processes.  Each node has a network
namespace of its own, joined to the host by a veth pair on a /30, and the first node's namespace
forwards pod traffic between the nodes (a star: the host itself forwards nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

from meshtrain.sandbox import nodes as nodes_mod

LINK_PREFIX = "10.201"
"""Host<->namespace links are 10.201.<index>.0/30 (host .1, node .2)."""
POD_PREFIX = "10.202"
"""Pod networks are 10.202.<index>.0/24 (gateway .1 on the bridge)."""
CLUSTER_DOMAIN = "cluster.local"
"""The cluster's DNS domain, as on kind and most clusters."""
CNI_BIN_DIR = "/usr/lib/cni"
"""Where Debian's containernetworking-plugins puts the plugins."""
RUNC = "/usr/sbin/runc"
"""Debian's runc."""


@dataclasses.dataclass(frozen=True)
class Addresses:
    """One node's network: namespace, veth pair and subnets.

    Pods hang off a bridge inside the node's namespace, on their /24; no
    namespace has a default route, so no pod packet can leave the machine.  The
    host gets a route to each pod /24 through that node's veth, so host
    processes (Prometheus, kubectl port-forward) reach pod IPs as they would on
    a kind network.
    """

    index: int
    """Third octet shared by the link and pod subnets (0..255)."""
    netns: str
    """Name of the network namespace (``ip netns``) the node and its pods live in."""
    host_link: str
    """Host end of the veth pair."""
    node_link: str
    """Namespace end of the veth pair."""

    @property
    def host_ip(self) -> str:
        """The host end's address: the API server and CoreDNS listen here."""
        return f"{LINK_PREFIX}.{self.index}.1"

    @property
    def node_ip(self) -> str:
        """The namespace end's address: the node's InternalIP (kubelet API)."""
        return f"{LINK_PREFIX}.{self.index}.2"

    @property
    def link_cidr(self) -> str:
        """The /30 of the veth pair."""
        return f"{LINK_PREFIX}.{self.index}.0/30"

    @property
    def pod_cidr(self) -> str:
        """The pods' /24."""
        return f"{POD_PREFIX}.{self.index}.0/24"


MAX_PEERS = 63
"""Peer /30s fit in the hub's link /24 after its own host link (.0/30)."""


@dataclasses.dataclass(frozen=True)
class PeerLink:
    """The veth pair between the first node's namespace (the hub) and node ``ordinal``'s: pod traffic between nodes.

    Its /30 is carved from the hub's link /24 (``.4*ordinal``), which no other
    sandbox uses; the interfaces live only inside the two namespaces.
    """

    hub: Addresses
    """The first node's network."""
    ordinal: int
    """The other node's position in the sandbox (1..63)."""

    def __post_init__(self) -> None:
        if not 1 <= self.ordinal <= MAX_PEERS:
            raise ValueError(
                f"a sandbox has at most {MAX_PEERS + 1} nodes (got ordinal {self.ordinal})"
            )

    @property
    def hub_link(self) -> str:
        """The hub's end (in the first node's namespace)."""
        return f"mtpeer{self.ordinal}"

    @property
    def node_link(self) -> str:
        """The other node's end (in its namespace)."""
        return "mthub"

    @property
    def hub_ip(self) -> str:
        """The hub end's address."""
        return f"{LINK_PREFIX}.{self.hub.index}.{4 * self.ordinal + 1}"

    @property
    def node_ip(self) -> str:
        """The other node's end's address."""
        return f"{LINK_PREFIX}.{self.hub.index}.{4 * self.ordinal + 2}"


@dataclasses.dataclass(frozen=True)
class Route:
    """``ip route add <destination> via <via>`` in a node's namespace."""

    netns: str
    destination: str
    via: str


def node_routes(nets: list[Addresses]) -> list[Route]:
    """The routes inside the nodes' namespaces that join a sandbox of ``nets`` (the first is the hub).

    Every node after the first reaches the API server and CoreDNS (the hub's
    host end) through its own host link, and every other node's pods through
    the hub; the hub reaches each node's pods over that node's peer link.
    """
    hub = nets[0]
    routes: list[Route] = []
    for ordinal, net in enumerate(nets[1:], start=1):
        peer = PeerLink(hub=hub, ordinal=ordinal)
        routes.append(Route(net.netns, f"{hub.host_ip}/32", net.host_ip))
        routes.append(Route(hub.netns, net.pod_cidr, peer.node_ip))
        routes.extend(
            Route(net.netns, other.pod_cidr, peer.hub_ip) for other in nets if other is not net
        )
    return routes


def addresses(state_dir: pathlib.Path, taken: set[int]) -> Addresses:
    """The network of the sandbox in ``state_dir``: a free index, preferring one derived from the path.

    ``taken``: indices already used on this host (by other sandboxes).
    """
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()
    start = int(digest[:4], 16) % 256
    for offset in range(256):
        index = (start + offset) % 256
        if index not in taken:
            tag = f"{index:02x}{digest[:6]}"
            return Addresses(
                index=index, netns=f"meshtrain-{tag}", host_link=f"mt{tag}h", node_link=f"mt{tag}n"
            )
    raise RuntimeError(
        f"no free sandbox network: all of {LINK_PREFIX}.0-255.0/30 are in use; "
        "stop other sandboxes (python -m meshtrain.sandbox down)"
    )


def containerd_config(
    *,
    root: pathlib.Path,
    state: pathlib.Path,
    socket: pathlib.Path,
    cni_conf_dir: pathlib.Path,
    pause_image: str,
    registry_hosts: pathlib.Path | None = None,
    cdi_spec_dir: pathlib.Path | None = None,
) -> str:
    """containerd 2.x config (version 3): own root, state and socket; runc with cgroupfs; CNI from ``cni_conf_dir``.

    ``cdi_spec_dir``: the node's own CDI directory, where its DRA driver writes the specs of the
    claims it prepares (containerd 2.x applies CDI devices by default; None: its default
    /etc/cdi and /var/run/cdi, which every node on the host would share).

    Images come from registries: ``registry_hosts`` is the ``config_path`` whose
    ``<host:port>/hosts.toml`` files name the sandbox's registry (plain HTTP; None: no
    registry host configuration), and
    ``discard_unpacked_layers`` drops a pulled layer's blob once it is unpacked (the
    snapshot is what containers use), so a node holds gigabytes of the trainer image once.

    ``restrict_oom_score_adj``: this host refuses to lower a process's OOM
    score (no CAP_SYS_RESOURCE over it), so the kubelet's negative scores for
    pause and Guaranteed containers are clamped to containerd's own instead of
    failing every container start.
    """
    cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return "\n".join(
        [
            "version = 3",
            f"root = {json.dumps(str(root))}",
            f"state = {json.dumps(str(state))}",
            "[grpc]",
            f"  address = {json.dumps(str(socket))}",
            "[ttrpc]",
            f"  address = {json.dumps(str(socket) + '.ttrpc')}",
            "[debug]",
            f"  address = {json.dumps(str(socket) + '.debug')}",
            "[metrics]",
            "  address = ''",
            # Pod network namespaces are mounted under the state dir, not /run/netns.
            f"[{cri_runtime}]",
            "  netns_mounts_under_state_dir = true",
            "  restrict_oom_score_adj = true",
            *([f"  cdi_spec_dirs = [{json.dumps(str(cdi_spec_dir))}]"] if cdi_spec_dir else []),
            f"[{cri_runtime}.containerd]",
            "  default_runtime_name = 'runc'",
            f"[{cri_runtime}.containerd.runtimes.runc]",
            "  runtime_type = 'io.containerd.runc.v2'",
            f"[{cri_runtime}.containerd.runtimes.runc.options]",
            f"  BinaryName = {json.dumps(RUNC)}",
            f"  Root = {json.dumps(str(state / 'runc'))}",
            "  SystemdCgroup = false",
            f"[{cri_runtime}.cni]",
            f"  bin_dirs = [{json.dumps(CNI_BIN_DIR)}]",
            f"  conf_dir = {json.dumps(str(cni_conf_dir))}",
            "  max_conf_num = 1",
            "[plugins.'io.containerd.cri.v1.images']",
            "  discard_unpacked_layers = true",
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"  sandbox = {json.dumps(pause_image)}",
            "[plugins.'io.containerd.cri.v1.images'.registry]",
            f"  config_path = {json.dumps(str(registry_hosts or ''))}",
            "[plugins.'io.containerd.grpc.v1.cri']",
            "  stream_server_address = '127.0.0.1'",
            "  stream_server_port = '0'",
            "",
        ]
    )


def cni_config(net: Addresses, ipam_dir: pathlib.Path) -> dict[str, Any]:
    """The pods' network: a bridge inside the node's namespace, host-local IPs from the pod /24.

    No ``ipMasq``: nothing is translated to leave the namespace, and the
    namespace has no default route.  Pods reach the host end of the link
    (API server, CoreDNS) through the namespace's connected route, other
    nodes' pods through :func:`node_routes`.  The IP allocations live in
    ``ipam_dir`` (the node's own), not in the host-wide /var/lib/cni.
    """
    return {
        "cniVersion": "1.0.0",
        "name": "meshtrain-sandbox",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "mtbr0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    *,
    net: Addresses,
    socket: pathlib.Path,
    ca_file: pathlib.Path,
    cgroup_root: str,
    resolv_conf: pathlib.Path,
    cluster_dns: str,
    pod_logs: pathlib.Path,
) -> dict[str, Any]:
    """KubeletConfiguration for this host: cgroup v1 (``failCgroupV1: false``), the cgroupfs driver.

    The host runs cgroup v1, which Kubernetes 1.35+ refuses unless told;
    systemd does not manage the node's cgroups here, so the driver is
    cgroupfs, under a cgroup root of the sandbox's own.  Eviction thresholds
    are low: the machine is shared, and its free disk and memory belong to
    other work as much as to the pods.  Pod logs go to the node's own
    ``pod_logs`` rather than the host-wide /var/log/pods, which another node's
    kubelet would also clean.
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{socket}",
        "address": net.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [cluster_dns],
        "podLogsDir": str(pod_logs),
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "failSwapOn": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "maxPods": 110,
        "serializeImagePulls": False,
    }


def kube_proxy_config(
    *, kubeconfig: pathlib.Path, net: Addresses, node_name: str
) -> dict[str, Any]:
    """KubeProxyConfiguration: iptables mode inside the namespace, for ClusterIP Services (the ``kubernetes`` one above all).

    ``conntrack.maxPerCore: 0`` leaves the host-wide conntrack table size alone.
    """
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node_name,
        "clusterCIDR": net.pod_cidr,
        "bindAddress": net.node_ip,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {"maxPerCore": 0, "min": 0},
        "nodePortAddresses": [f"{net.node_ip}/32"],
    }


def corefile(*, net: Addresses, kubeconfig: pathlib.Path, port: int = 53) -> str:
    """CoreDNS on the host end of the link: cluster names only (no upstream: pods have no way out)."""
    return (
        f"{CLUSTER_DOMAIN}:{port} in-addr.arpa:{port} {{\n"
        f"    bind {net.host_ip}\n"
        "    errors\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "        ttl 5\n"
        "    }\n"
        "}\n"
        f".:{port} {{\n"
        f"    bind {net.host_ip}\n"
        "    errors\n"
        "}\n"
    )


def node_labels(node: nodes_mod.NodeSpec) -> dict[str, str]:
    """The topology and GPU labels the node registers with (``kubelet --node-labels``)."""
    return {
        nodes_mod.BLOCK_LABEL: node.block,
        nodes_mod.LEAF_LABEL: node.leaf,
        "nvidia.com/gpu.count": str(node.gpus),
        "nvidia.com/gpu.product": "Sandbox-CPU",
        nodes_mod.SANDBOX_LABEL: "true",
    }


def gpu_capacity_patch(gpus: int) -> list[dict[str, Any]]:
    """JSON patch of node status that advertises ``gpus`` GPUs.

    The stand-in for the NVIDIA device plugin: extended resources are
    advertised by patching ``status.capacity``, the documented way for
    resources no device plugin manages; the kubelet copies capacity into
    allocatable.  The containers see no GPU (this machine has none).
    """
    key = nodes_mod.GPU_RESOURCE.replace("/", "~1")
    return [{"op": "add", "path": f"/status/capacity/{key}", "value": str(gpus)}]
