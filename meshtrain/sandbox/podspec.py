"""Pod -> local process translation for the sandbox's node agent.

Pure functions that turn a Pod object (a dict as the API server
returns it) into a :class:`PodPlan`: for every container the argv, the
environment and the working directory of a local process, plus the files and
directories its volumes become on this machine.  Everything the kubelet and
the container runtime would provide is emulated here, with the same rules:

- ``env``: literal values, ``$(VAR)`` references to earlier variables (``$$``
  escapes), the downward API (``fieldRef``), ``configMapKeyRef`` and
  ``envFrom.configMapRef``; ``$(VAR)`` in ``command``/``args`` as well.
- volumes: ``configMap`` files are materialised into the pod directory,
  ``emptyDir`` is a pod directory (``/dev/shm`` stays the host's),
  ``persistentVolumeClaim`` is a host directory per claim, ``hostPath`` stays.
  A container's mount paths do not exist on this machine, so every mount path
  found in env values, arguments and ConfigMap files is rewritten to its host
  directory.  So is a container's ``terminationMessagePath``: it becomes a
  file of the pod directory (:attr:`ContainerProcess.termination_log`).
- networking: each pod has its own loopback address (``127.0.1.N``).  Cluster
  DNS names (``host.subdomain[.ns[.svc[.cluster.local]]]`` and
  ``service.ns.svc...``) in env values and arguments are replaced by the pod
  IP they resolve to; a name that will resolve once its pod is placed raises
  :class:`Unresolved` so the agent retries later.

Not a container runtime.  No image is pulled, nothing is isolated:
the processes run the command of the pod with this machine's Python and
meshtrain.  Secrets are not supported (:class:`Unsupported`).  No I/O here:
the agent writes the files and starts the processes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
"""The cluster DNS domain the sandbox pretends to serve."""
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The kubelet's default ``terminationMessagePath``."""

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_HOST_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})+$")
_VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_RE = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class Unsupported(ValueError):
    """The pod uses something the sandbox cannot emulate (the message says what)."""


class Unresolved(LookupError):
    """A cluster DNS name in the pod's env or args does not resolve yet."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            f"waiting for cluster DNS names to resolve: {', '.join(sorted(set(names)))}"
        )
        self.names = names
        """The names that did not resolve."""


@dataclasses.dataclass(frozen=True)
class ContainerProcess:
    """One container as a local process."""

    name: str
    argv: tuple[str, ...]
    """Command and arguments, variables expanded and paths and names rewritten."""
    env: Mapping[str, str]
    """The process environment (base environment plus the container's env)."""
    cwd: str
    """Working directory: the pod directory, or workingDir rewritten like any path."""
    init: bool
    """True for an init container (run to completion before the main containers)."""
    ports: tuple[tuple[str, int], ...]
    """Declared container ports as (name, number)."""
    termination_log: str = ""
    """Host file standing for the container's ``terminationMessagePath`` (default /dev/termination-log):
    a file of the pod directory, so processes never write the host's /dev; the agent may report its
    content as ``state.terminated.message``."""


@dataclasses.dataclass(frozen=True)
class PodPlan:
    """Everything the agent needs to run one pod."""

    namespace: str
    name: str
    ip: str
    """The pod's loopback address."""
    directories: tuple[str, ...]
    """Host directories to create (emptyDir volumes, claim directories)."""
    files: Mapping[str, str]
    """Host path -> content of every ConfigMap file."""
    path_map: Mapping[str, str]
    """Container mount path -> host path, for the record and the logs."""
    containers: tuple[ContainerProcess, ...]
    """Init containers first (in order), then the main containers."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What the translation may look up about the cluster (all in memory, no I/O)."""

    config_maps: Mapping[tuple[str, str], Mapping[str, str]]
    """(namespace, name) -> data of the ConfigMaps the pod refers to."""
    resolve: Callable[[str, str], str | None]
    """(dns name, pod namespace) -> IP; None when the name is a cluster name not resolvable yet.
    Raises KeyError when the name is not a cluster name at all (left unchanged)."""
    claim_dir: Callable[[str, str], str]
    """(namespace, claim name) -> host directory of a PersistentVolumeClaim."""


def translate(
    pod: Mapping[str, Any], *, ip: str, pod_dir: str, base_env: Mapping[str, str], cluster: Cluster
) -> PodPlan:
    """The processes, files and directories that emulate ``pod`` on this machine.

    Raises :class:`Unresolved` when a cluster DNS name cannot be resolved yet and
    :class:`Unsupported` for features the sandbox does not emulate.
    """
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    namespace, name = meta.get("namespace", "default"), meta["name"]
    volumes = _volumes(
        spec.get("volumes") or [], namespace=namespace, pod_dir=pod_dir, cluster=cluster
    )
    unresolved: list[str] = []
    containers: list[ContainerProcess] = []
    path_map: dict[str, str] = {}
    all_containers = [(c, True) for c in spec.get("initContainers") or []] + [
        (c, False) for c in spec.get("containers") or []
    ]
    for container, init in all_containers:
        mounts = _mounts(container, volumes)
        termination_log = f"{pod_dir}/termination-log-{container['name']}"
        mounts[container.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH] = (
            termination_log
        )
        path_map.update(mounts)
        env = _container_env(container, pod, ip=ip, cluster=cluster, base_env=base_env)
        env = {k: _rewrite(v, mounts, namespace, cluster, unresolved) for k, v in env.items()}
        command = [_expand(part, env) for part in container.get("command") or []]
        args = [_expand(part, env) for part in container.get("args") or []]
        argv = tuple(
            _rewrite(part, mounts, namespace, cluster, unresolved) for part in command + args
        )
        if not argv:
            raise Unsupported(
                f"container {container.get('name')!r} has no command: the sandbox cannot read an image's entrypoint"
            )
        working_dir = container.get("workingDir")
        cwd = _rewrite_paths(working_dir, mounts) if working_dir else pod_dir
        ports = tuple(
            (p.get("name", ""), int(p["containerPort"])) for p in container.get("ports") or []
        )
        containers.append(
            ContainerProcess(
                name=container["name"],
                argv=argv,
                env=env,
                cwd=cwd,
                init=init,
                ports=ports,
                termination_log=termination_log,
            )
        )
    if unresolved:
        raise Unresolved(unresolved)
    files = {path: _rewrite_paths(text, path_map) for path, text in volumes.files.items()}
    return PodPlan(
        namespace=namespace,
        name=name,
        ip=ip,
        directories=tuple(volumes.directories),
        files=files,
        path_map=path_map,
        containers=tuple(containers),
    )


# --- volumes -------------------------------------------------------------------


@dataclasses.dataclass
class _Volumes:
    host_dirs: dict[str, str | None]
    """Volume name -> host directory (None: use the container path as is, e.g. /dev/shm)."""
    directories: list[str]
    files: dict[str, str]


def _volumes(
    volumes: list[Mapping[str, Any]], *, namespace: str, pod_dir: str, cluster: Cluster
) -> _Volumes:
    result = _Volumes(host_dirs={}, directories=[], files={})
    for volume in volumes:
        name = volume["name"]
        host = f"{pod_dir}/volumes/{name}"
        if "configMap" in volume:
            source = volume["configMap"]
            data = cluster.config_maps.get((namespace, source["name"]))
            if data is None:
                if source.get("optional"):
                    data = {}
                else:
                    raise Unresolved([f"configmap/{namespace}/{source['name']}"])
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] in data:
                    result.files[f"{host}/{item['path']}"] = data[item["key"]]
            result.host_dirs[name] = host
            result.directories.append(host)
        elif "emptyDir" in volume:
            medium = (volume["emptyDir"] or {}).get("medium")
            result.host_dirs[name] = None if medium == "Memory" else host
            if medium != "Memory":
                result.directories.append(host)
        elif "persistentVolumeClaim" in volume:
            claim = cluster.claim_dir(namespace, volume["persistentVolumeClaim"]["claimName"])
            result.host_dirs[name] = claim
            result.directories.append(claim)
        elif "hostPath" in volume:
            result.host_dirs[name] = volume["hostPath"]["path"]
        elif "projected" in volume or "downwardAPI" in volume:
            result.host_dirs[name] = host  # service-account token projections: an empty directory
            result.directories.append(host)
        elif "secret" in volume:
            raise Unsupported(
                f"volume {name!r} is a Secret: the sandbox does not materialise Secrets"
            )
        else:
            raise Unsupported(
                f"volume {name!r} has a type the sandbox does not emulate: {sorted(volume)}"
            )
    return result


def _mounts(container: Mapping[str, Any], volumes: _Volumes) -> dict[str, str]:
    """Container mount path -> host path for one container (only mounts that move)."""
    mounts: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        host = volumes.host_dirs.get(mount["name"])
        if host is None:
            continue
        if mount.get("subPath"):
            host = f"{host}/{mount['subPath']}"
        if host != mount["mountPath"]:
            mounts[mount["mountPath"].rstrip("/") or "/"] = host
    return mounts


def _rewrite_paths(text: str, mounts: Mapping[str, str]) -> str:
    """Replace every mount path (as a whole path prefix) in ``text`` by its host path.

    One pass over all mount paths (longest first): a host path put in by one mount is never
    rewritten again by another (``/tmp`` mounted while the sandbox's own directory is under /tmp).
    """
    paths = sorted((p for p in mounts if p != "/"), key=len, reverse=True)
    if not paths:
        return text
    alternatives = "|".join(re.escape(p) for p in paths)
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?=/|$|[^\w.-])")
    return pattern.sub(lambda m: mounts[m.group(1)], text)


# --- environment ---------------------------------------------------------------


def _container_env(
    container: Mapping[str, Any],
    pod: Mapping[str, Any],
    *,
    ip: str,
    cluster: Cluster,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    env: dict[str, str] = dict(base_env)
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            data = cluster.config_maps.get((namespace, source["configMapRef"]["name"]))
            if data is None and not source["configMapRef"].get("optional"):
                raise Unresolved([f"configmap/{namespace}/{source['configMapRef']['name']}"])
            env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
        elif "secretRef" in source:
            raise Unsupported("envFrom.secretRef: the sandbox does not materialise Secrets")
    for var in container.get("env") or []:
        if "value" in var or "valueFrom" not in var:
            env[var["name"]] = _expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = field_value(pod, source["fieldRef"]["fieldPath"], ip=ip)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = cluster.config_maps.get((namespace, ref["name"]))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise Unresolved([f"configmap/{namespace}/{ref['name']}#{ref['key']}"])
            env[var["name"]] = data[ref["key"]]
        elif "resourceFieldRef" in source:
            env[var["name"]] = _resource_value(container, source["resourceFieldRef"]["resource"])
        elif "secretKeyRef" in source:
            raise Unsupported(f"env {var['name']}: secretKeyRef is not supported by the sandbox")
    return env


def field_value(pod: Mapping[str, Any], field_path: str, *, ip: str) -> str:
    """The downward-API value of ``field_path`` for ``pod`` running at ``ip``."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": ip,
        "status.podIPs": ip,
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if field_path in simple:
        return simple[field_path]
    match = _FIELD_RE.match(field_path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise Unsupported(f"downward API field {field_path!r} is not supported by the sandbox")


def _resource_value(container: Mapping[str, Any], resource: str) -> str:
    """requests.cpu / limits.memory ...: the quantity as written (divisors are not applied)."""
    kind, _, name = resource.partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name)
    return str(value) if value is not None else "0"


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_RE.sub(substitute, text)


# --- names ---------------------------------------------------------------------


def _rewrite(
    text: str, mounts: Mapping[str, str], namespace: str, cluster: Cluster, unresolved: list[str]
) -> str:
    """Rewrite mount paths, then a cluster DNS name that is the value (or after ``--flag=``, before ``:port``)."""
    text = _rewrite_paths(text, mounts)
    prefix, sep, value = text.rpartition("=") if text.startswith("-") else ("", "", text)
    host, colon, port = value.partition(":")
    if not _HOST_RE.match(host) or (colon and not port.isdigit()):
        return text
    try:
        ip = cluster.resolve(host, namespace)
    except KeyError:
        return text
    if ip is None:
        unresolved.append(host)
        return text
    return f"{prefix}{sep}{ip}{colon}{port}"


@dataclasses.dataclass(frozen=True)
class PodRecord:
    """What name resolution needs to know about one pod."""

    namespace: str
    name: str
    hostname: str
    """spec.hostname (or the pod name)."""
    subdomain: str
    """spec.subdomain (the headless Service that names it), or empty."""
    labels: Mapping[str, str]
    """Pod labels (for Service selectors)."""
    ip: str | None
    """The pod's address once the agent assigned one."""


def resolve(
    name: str,
    namespace: str,
    *,
    pods: list[PodRecord],
    services: Mapping[tuple[str, str], Mapping[str, str]],
) -> str | None:
    """Resolve a cluster DNS name like the cluster's DNS would.

    ``services`` maps (namespace, name) to the Service's selector.  Returns the
    IP, None when the name names a known Service whose pod has no address yet,
    and raises KeyError when the name is not a cluster name.
    """
    labels = name.removesuffix("." + CLUSTER_DOMAIN).split(".")
    if labels[-1] == "svc":
        labels = labels[:-1]
    # host.subdomain[.namespace]: a pod behind a headless Service.
    if len(labels) in (2, 3):
        ns = labels[2] if len(labels) == 3 else namespace
        if (ns, labels[1]) in services:
            for pod in pods:
                if pod.namespace == ns and pod.subdomain == labels[1] and pod.hostname == labels[0]:
                    return pod.ip
            return None
    # service.namespace: the first pod the Service selects (no kube-proxy, no virtual IPs).
    if len(labels) == 2 and (labels[1], labels[0]) in services:
        selector = services[(labels[1], labels[0])]
        ready = [
            p
            for p in pods
            if p.namespace == labels[1]
            and selector
            and all(p.labels.get(k) == v for k, v in selector.items())
        ]
        ready.sort(key=lambda p: p.name)
        return ready[0].ip if ready else None
    raise KeyError(name)
