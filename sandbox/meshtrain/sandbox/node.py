"""The sandbox's real nodes: a network namespace each, containerd, kubelet, kube-proxy; CoreDNS.

Setting up and joining the nodes' networks (addresses from :mod:`.nodeconfig`), writing the
components' files, their command lines, and tearing down what they leave behind (containers,
shims, mounts, cgroups, the namespace); :mod:`.supervisor` starts and stops the processes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import re
import signal
import subprocess
import time
from collections.abc import Callable

import yaml

from meshtrain.sandbox import dra, nodeconfig
from meshtrain.sandbox import nodes as nodes_mod
from meshtrain.sandbox import registry as registry_mod
from meshtrain.sandbox.controlplane import binaries as binaries_mod

REPO = pathlib.Path(__file__).resolve().parents[3]
CGROUP_FS = pathlib.Path("/sys/fs/cgroup")


class NodeSetupError(RuntimeError):
    """A node component cannot start; the message names it, the reason and the fix."""


@dataclasses.dataclass(frozen=True)
class Node:
    """Files and names of one of the sandbox's nodes (all under ``root``)."""

    root: pathlib.Path
    """``<state>/nodes/<node name>``."""
    net: nodeconfig.Addresses
    spec: nodes_mod.NodeSpec
    """Name, topology labels and GPU count."""

    @property
    def socket(self) -> pathlib.Path:
        """containerd's CRI socket."""
        return self.root / "containerd.sock"

    @property
    def cdi_dir(self) -> pathlib.Path:
        """The node's CDI spec directory: its DRA driver writes there, its containerd reads."""
        return self.root / "cdi"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroup root (``/<netns name>``) in every v1 hierarchy."""
        return f"/{self.net.netns}"

    def path(self, name: str) -> pathlib.Path:
        """A file of the node."""
        return self.root / name

    def to_state(self) -> dict[str, str]:
        """What :func:`teardown` needs, for state.json."""
        return {
            "name": self.spec.name,
            "root": str(self.root),
            "pod_cidr": self.net.pod_cidr,
            "netns": self.net.netns,
            "host_link": self.net.host_link,
            "socket": str(self.socket),
            "cgroup_root": self.cgroup_root,
        }


def taken_indices() -> set[int]:
    """Sandbox network indices in use on this host (addresses 10.201.N.1 present)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    prefix = re.escape(nodeconfig.LINK_PREFIX)
    return {int(m) for m in re.findall(rf"inet {prefix}\.(\d+)\.1/", out)}


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NodeSetupError(
            f"network: `ip {' '.join(args)}` failed: {result.stderr.strip()}. "
            "The sandbox needs root (CAP_NET_ADMIN) and iproute2 to make its network namespace."
        )


def setup_network(net: nodeconfig.Addresses) -> None:
    """The namespace, the veth link and the host's route to the pod /24 (no default route inside)."""
    _ip("netns", "add", net.netns)
    _ip(
        "link",
        "add",
        net.host_link,
        "type",
        "veth",
        "peer",
        "name",
        net.node_link,
        "netns",
        net.netns,
    )
    _ip("addr", "add", f"{net.host_ip}/30", "dev", net.host_link)
    _ip("link", "set", net.host_link, "up")
    _ip("-n", net.netns, "link", "set", "lo", "up")
    _ip("-n", net.netns, "addr", "add", f"{net.node_ip}/30", "dev", net.node_link)
    _ip("-n", net.netns, "link", "set", net.node_link, "up")
    _ip("route", "add", net.pod_cidr, "via", net.node_ip, "dev", net.host_link)


def join_nodes(nets: list[nodeconfig.Addresses]) -> None:
    """Peer links from the first node's namespace to every other's, their routes, and forwarding in each namespace.

    ``net.ipv4.ip_forward`` is set per namespace: the host's own stays as it is.
    """
    hub = nets[0]
    for net in nets:
        _ip_netns_sysctl(net.netns, "net.ipv4.ip_forward=1")
    for ordinal, net in enumerate(nets[1:], start=1):
        peer = nodeconfig.PeerLink(hub=hub, ordinal=ordinal)
        _ip(
            "-n",
            hub.netns,
            "link",
            "add",
            peer.hub_link,
            "type",
            "veth",
            "peer",
            "name",
            peer.node_link,
            "netns",
            net.netns,
        )
        _ip("-n", hub.netns, "addr", "add", f"{peer.hub_ip}/30", "dev", peer.hub_link)
        _ip("-n", hub.netns, "link", "set", peer.hub_link, "up")
        _ip("-n", net.netns, "addr", "add", f"{peer.node_ip}/30", "dev", peer.node_link)
        _ip("-n", net.netns, "link", "set", peer.node_link, "up")
    for route in nodeconfig.node_routes(nets):
        _ip("-n", route.netns, "route", "add", route.destination, "via", route.via)


def _ip_netns_sysctl(netns: str, setting: str) -> None:
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "sysctl", "-q", "-w", setting],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise NodeSetupError(
            f"network: `sysctl -w {setting}` in namespace {netns} failed: {result.stderr.strip()}. "
            "The sandbox needs root and procps' sysctl."
        )


def image_store(node: Node, slot: int) -> tuple[pathlib.Path, int | None]:
    """containerd's root for the sandbox's ``slot``-th node: that slot's shared one unless another sandbox holds it, else a private one.

    The shared roots keep imported images between sandboxes (importing the
    trainer image takes minutes); one containerd at a time may use each, so
    the caller holds the returned lock descriptor for the sandbox's lifetime.
    """
    shared = binaries_mod.cache_bin_dir().parents[1] / "containerd"
    shared.mkdir(parents=True, exist_ok=True)
    suffix = f"-{slot}" if slot else ""
    fd = os.open(shared / f"lock{suffix}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return node.path("containerd/root"), None
    return shared / f"root{suffix}", fd


def write_configs(
    node: Node,
    *,
    kubeconfig: pathlib.Path,
    ca_file: pathlib.Path,
    pause_image: str,
    containerd_root: pathlib.Path,
    hub: nodeconfig.Addresses,
    registry_address: str,
) -> None:
    """containerd's config and registry hosts, the CNI conflist, kubelet's and kube-proxy's configs, the Corefile.

    ``hub``: the first node's network, on whose host end the API server, CoreDNS and the
    registry (``registry_address``, host:port) listen.
    """
    for directory in ("cni", "cdi", "containerd/state", "kubelet", "pod-logs"):
        node.path(directory).mkdir(parents=True, exist_ok=True)
    containerd_root.mkdir(parents=True, exist_ok=True)
    node.path("containerd.toml").write_text(
        nodeconfig.containerd_config(
            root=containerd_root,
            state=node.path("containerd/state"),
            socket=node.socket,
            cni_conf_dir=node.path("cni"),
            pause_image=pause_image,
            registry_hosts=node.path("certs.d"),
            cdi_spec_dir=node.cdi_dir,
        )
    )
    registry_mod.write_hosts(node.path("certs.d"), registry_address)
    node.path("cni/10-meshtrain.conflist").write_text(
        json.dumps(nodeconfig.cni_config(node.net, node.path("cni-ipam")), indent=2)
    )
    # Pods get the cluster DNS only: the host's resolvers are not reachable from the namespace.
    node.path("resolv.conf").write_text("")
    node.path("kubelet.yaml").write_text(
        yaml.safe_dump(
            nodeconfig.kubelet_config(
                net=node.net,
                socket=node.socket,
                ca_file=ca_file,
                cgroup_root=node.cgroup_root,
                resolv_conf=node.path("resolv.conf"),
                cluster_dns=hub.host_ip,
                pod_logs=node.path("pod-logs"),
            )
        )
    )
    node.path("kube-proxy.yaml").write_text(
        yaml.safe_dump(
            nodeconfig.kube_proxy_config(
                kubeconfig=kubeconfig, net=node.net, node_name=node.spec.name
            )
        )
    )
    if node.net == hub:  # one CoreDNS per sandbox, with the first node's files
        node.path("Corefile").write_text(nodeconfig.corefile(net=hub, kubeconfig=kubeconfig))


def _in_netns(net: nodeconfig.Addresses, argv: list[str]) -> list[str]:
    """``argv`` inside the node's network namespace.

    ``nsenter --net`` leaves the mount namespace shared, so the kubelet's volume
    mounts are the ones containerd sees.
    """
    return ["nsenter", f"--net=/run/netns/{net.netns}", "--", *argv]


def write_dra_config(node: Node, ordinal: int) -> pathlib.Path:
    """The DRA driver's config file of the ``ordinal``-th node (:func:`.dra.node_config`)."""
    path = node.path("dra-driver.json")
    path.write_text(json.dumps(dra.node_config(ordinal), indent=2))
    return path


def commands(node: Node, *, kubeconfig: pathlib.Path) -> dict[str, list[str]]:
    """Command lines of containerd, kubelet, kube-proxy (in the namespace), CoreDNS and the DRA driver (on the host)."""
    found = binaries_mod.locate_node()
    too_long = dra.long_socket_paths(node.path("kubelet"))
    if too_long:
        raise NodeSetupError(
            f"the DRA driver's sockets {too_long} are over {dra.MAX_SOCKET_PATH} bytes, the "
            "limit of a unix socket's path: use a shorter state dir (--state-dir or "
            "MESHTRAIN_SANDBOX_DIR)"
        )
    labels = ",".join(f"{k}={v}" for k, v in nodeconfig.node_labels(node.spec).items())
    return {
        "containerd": _in_netns(
            node.net, [str(found.containerd), "--config", str(node.path("containerd.toml"))]
        ),
        "kubelet": _in_netns(
            node.net,
            [
                str(found.kubelet),
                f"--config={node.path('kubelet.yaml')}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={node.spec.name}",
                f"--node-ip={node.net.node_ip}",
                f"--node-labels={labels}",
                f"--root-dir={node.path('kubelet')}",
                f"--cert-dir={node.path('kubelet/pki')}",
                "--v=1",
            ],
        ),
        "kube-proxy": _in_netns(
            node.net, [str(found.kube_proxy), f"--config={node.path('kube-proxy.yaml')}"]
        ),
        "coredns": [str(found.coredns), "-conf", str(node.path("Corefile"))],
        "dra-driver": dra.command(
            dra.locate(),
            node=node.spec,
            kubeconfig=kubeconfig,
            config=node.path("dra-driver.json"),
            kubelet_root=node.path("kubelet"),
            cdi_dir=node.cdi_dir,
        ),
    }


def node_env(found_dir: pathlib.Path) -> dict[str, str]:
    """Environment of the node's processes: containerd finds its shim next to itself."""
    return {**os.environ, "PATH": f"{found_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def wait_socket(
    socket: pathlib.Path, *, alive: Callable[[], bool], log: pathlib.Path, timeout: float = 60.0
) -> None:
    """Until containerd's socket exists; raises NodeSetupError with its log's end otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.exists():
            return
        if not alive():
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise NodeSetupError(
        f"containerd did not open {socket}: see {log}.\n{tail}\n"
        "containerd needs root, overlayfs and runc (scripts/bootstrap.sh installs Debian's runc)."
    )


def image_names() -> tuple[str, str, str]:
    """(operator, trainer, pause) image names as the sandbox's nodes pull them from its registry."""
    return registry_mod.images().all()


# --- teardown ------------------------------------------------------------------------


def _pids_with(needle: bytes) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def _cgroup_dirs(cgroup_root: str) -> list[pathlib.Path]:
    """The node's cgroups in every v1 hierarchy (and the unified one), deepest first."""
    found: list[pathlib.Path] = []
    if not CGROUP_FS.is_dir():
        return found
    for hierarchy in CGROUP_FS.iterdir():
        top = hierarchy / cgroup_root.lstrip("/")
        # os.walk skips a cgroup removed while it walks (a container's, torn down meanwhile).
        found.extend(pathlib.Path(directory) for directory, _, _ in os.walk(top))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def container_pids(cgroup_root: str) -> list[int]:
    """Processes in the node's pod cgroups (the containers' processes)."""
    pids: set[int] = set()
    for directory in _cgroup_dirs(cgroup_root):
        try:
            pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
        except OSError:
            continue
    return sorted(pids)


def make_cgroups(cgroup_root: str) -> None:
    """The kubelet's cgroup root in every hierarchy (the kubelet requires it to exist).

    A new v1 cpuset cgroup has no CPUs or memory nodes: it gets its parent's.
    """
    if not CGROUP_FS.is_dir():
        raise NodeSetupError(f"kubelet: {CGROUP_FS} is missing; the node needs cgroups mounted")
    for hierarchy in CGROUP_FS.iterdir():
        if not (hierarchy / "cgroup.procs").exists():
            continue
        top = hierarchy / cgroup_root.lstrip("/")
        top.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (top / name).exists() and not (top / name).read_text().strip():
                (top / name).write_text((hierarchy / name).read_text())


def leftovers(state: dict[str, str]) -> list[int]:
    """Processes of the node still alive: containers (by cgroup) and shims (by socket)."""
    if not state:
        return []
    shims = _pids_with(f"-address\0{state['socket']}".encode())
    return sorted({*container_pids(state["cgroup_root"]), *shims})


def remove_containers(socket: pathlib.Path) -> None:
    """Delete every task and container from containerd (while it still runs), so a shared image store keeps only images."""
    if not socket.exists():
        return
    ctr = [str(binaries_mod.locate_node().ctr), "--address", str(socket), "--namespace", "k8s.io"]
    for kind in ("tasks", "containers"):
        listed = subprocess.run(
            [*ctr, kind, "ls", "-q"], capture_output=True, text=True, timeout=30
        )
        ids = listed.stdout.split()
        if ids:
            delete = [*ctr, kind, "rm", *(["-f"] if kind == "tasks" else []), *ids]
            subprocess.run(delete, capture_output=True, timeout=60)


def teardown(state: dict[str, str]) -> list[int]:
    """Kill containers and shims, unmount, remove cgroups and the namespace; returns the pids killed."""
    if not state:
        return []
    killed = leftovers(state)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 10
    while leftovers(state) and time.monotonic() < deadline:
        time.sleep(0.2)
    root = state["root"].rstrip("/") + "/"
    mounts = [
        line.split()[4]
        for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(root)
    ]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    for directory in _cgroup_dirs(state["cgroup_root"]):
        try:
            directory.rmdir()
        except OSError:
            pass
    subprocess.run(["ip", "netns", "del", state["netns"]], capture_output=True)
    subprocess.run(["ip", "link", "del", state["host_link"]], capture_output=True)
    return killed
