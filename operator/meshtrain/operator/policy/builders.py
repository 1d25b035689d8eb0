"""Manifests of a TrainingJob's children: gang pods, headless Service, spec ConfigMap, PodGroup,
NetworkPolicy, DRA claim objects.

Pure ``build_*`` functions from a job (its identity, validated spec, gang attempt and planned
nodes) to plain dict manifests, each with an owner reference to the job.  What a pod carries
(command, environment, ports, volumes, security, gate, affinity): docs/operator.md, "Children
of a job".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import exitcodes, loading
from meshtrain.api import job_dir as api_job_dir
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import object_storage as api_object_storage
from meshtrain.api.spec import pod as api_pod
from meshtrain.operator.policy import (
    device_claims,
    identity,
    kubelet_tier,
    naming,
    node_affinity,
    pod_override,
    replacement,
    torchrun_tier,
)

SHUTDOWN_MARGIN_SECONDS = 5
"""torchrun stops waiting for its ranks this long before the kubelet's SIGKILL."""


def owner_reference(job: identity.JobRef) -> dict[str, Any]:
    """Controller owner reference to the job: the garbage collector deletes children with it."""
    return {
        "apiVersion": naming.API_VERSION,
        "kind": api_spec.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    job: identity.JobRef, name: str, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {
            naming.LABEL_JOB: job.name,
            naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
            **(labels or {}),
        },
        "ownerReferences": [owner_reference(job)],
    }


def pipeline_stages(spec: api_spec.TrainingJobSpec, index: int) -> str:
    """Pipeline stages of the ranks pod ``index`` runs: ``"2"`` or ``"0-1"``."""
    stages = spec.parallelism.layout.stages_of_pod(index, spec.resources.gpus_per_node)
    return str(stages[0]) if len(stages) == 1 else f"{stages[0]}-{stages[-1]}"


def build_configmap(job: identity.JobRef, spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """The ConfigMap with the whole TrainingJob (defaults filled in) as ``job.yaml``."""
    document = api_spec.to_manifest(job.name, spec, job.namespace)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, naming.configmap_name(job.name)),
        "data": {"job.yaml": loading.dump_yaml(document)},
    }


def build_service(job: identity.JobRef, spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """Headless Service: stable DNS names for the pods, published before they are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, naming.service_name(job.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {naming.LABEL_JOB: job.name},
            "ports": [
                {
                    "name": "rendezvous",
                    "port": naming.MASTER_PORT,
                    "targetPort": naming.MASTER_PORT,
                },
                {"name": "metrics", "port": spec.metrics.port, "targetPort": spec.metrics.port},
            ],
        },
    }


@dataclasses.dataclass(frozen=True)
class GangPeers:
    """Who besides the gang's own pods may reach a gang (the chart's flags, docs/operator.md)."""

    operator: tuple[dict[str, Any], ...] = ()
    """NetworkPolicyPeers of the operator's pods: admitted on the job's progress port."""
    metrics: tuple[dict[str, Any], ...] = ()
    """NetworkPolicyPeers of Prometheus (and the chart's extraIngressFrom): admitted on the exporters' ports."""


NO_PEERS = GangPeers()
"""Only the gang's own pods (no ``--gang-network-policy-*-peers``)."""


def metrics_ports(spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """The exporters' ports as one NetworkPolicyPort: ``metrics.port`` + each local rank."""
    last = spec.metrics.port + spec.resources.gpus_per_node - 1
    port: dict[str, Any] = {"protocol": "TCP", "port": spec.metrics.port}
    return {**port, "endPort": last} if last > spec.metrics.port else port


def build_network_policy(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec, peers: GangPeers = NO_PEERS
) -> dict[str, Any]:
    """NetworkPolicy: the job's pods take connections from the job's own pods on any port, the
    operator on the progress port and Prometheus on the exporters' ports.

    Self-contained: it keeps the operator and Prometheus in when the chart's namespace-wide
    trainer policy is gone.  Rendezvous and collectives (gloo, NCCL) use ports chosen at run
    time, so the own-pods rule names no port; every other rule names its ports, so only the
    gang reaches the unauthenticated rendezvous store.  A rule with no peer is left out (an
    empty ``from`` would admit everyone).
    """
    own = {"matchLabels": {naming.LABEL_JOB: job.name}}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": own}]}]
    port = naming.progress_port(spec)
    if peers.operator and port is not None:
        progress = {"protocol": "TCP", "port": port}
        ingress.append({"from": list(peers.operator), "ports": [progress]})
    if peers.metrics:
        ingress.append({"from": list(peers.metrics), "ports": [metrics_ports(spec)]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, naming.network_policy_name(job.name)),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _env(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    index: int,
    device_error_at: int | None = None,
) -> list[dict[str, Any]]:
    p = spec.parallelism
    plain = {
        "PET_NNODES": spec.pods,
        "PET_NPROC_PER_NODE": spec.resources.gpus_per_node,
        "PET_NODE_RANK": index,
        "WORLD_SIZE": spec.world_size,
        "MASTER_ADDR": naming.master_addr(
            job.name, job.namespace, attempt, store_pod=kubelet_tier.store_pod(spec)
        ),
        "MASTER_PORT": naming.MASTER_PORT,
        # torchrun's own defaults for --master-addr/--master-port: a custom program's plain
        # `torchrun train.py` joins the gang with no flags.
        "PET_MASTER_ADDR": naming.master_addr(
            job.name, job.namespace, attempt, store_pod=kubelet_tier.store_pod(spec)
        ),
        "PET_MASTER_PORT": naming.MASTER_PORT,
        "MESHTRAIN_TP": p.tensor,
        "MESHTRAIN_PP": p.pipeline,
        "MESHTRAIN_DP": p.data,
        "MESHTRAIN_JOB_NAME": job.name,
        "MESHTRAIN_NAMESPACE": job.namespace,
        "MESHTRAIN_JOB_UID": job.uid,  # the job's own checkpoint directory records it (docs/checkpoints.md)
        "MESHTRAIN_ATTEMPT": attempt,
        "MESHTRAIN_SPEC_FILE": naming.SPEC_FILE,
        "MESHTRAIN_CHECKPOINT_DIR": spec.checkpoint.path,
        # the job's own directory on that root, for a custom program (meshtrain's trainer derives it)
        "MESHTRAIN_JOB_CHECKPOINT_DIR": api_job_dir.job_dir(
            spec.checkpoint.path, job.namespace, job.name
        ),
        "MESHTRAIN_LOG_DIR": naming.log_dir(spec.checkpoint.path, job.namespace, job.name),
        "MESHTRAIN_METRICS_PORT": spec.metrics.port,
        "MESHTRAIN_TERMINATION_LOG": naming.TERMINATION_LOG,
        "PET_SHUTDOWN_TIMEOUT": torchrun_shutdown_timeout(spec),
        **kubelet_tier.recovery_env(spec),
        **torchrun_tier.elastic_env(job, spec, attempt, index),
    }
    if (
        p.context > 1
    ):  # the fourth degree, for a custom program's rank arithmetic (docs/operator.md)
        plain["MESHTRAIN_CP"] = p.context
    if job.created:  # the goodput account's wall time starts with the job (docs/telemetry.md)
        plain["MESHTRAIN_JOB_STARTED_AT"] = job.created
    if device_error_at is not None:  # the node's first strike, kept past the gang (device_errors)
        plain[exitcodes.DEVICE_ERROR_AT_ENV] = device_error_at
    env: list[dict[str, Any]] = [{"name": key, "value": str(value)} for key, value in plain.items()]
    env.append(
        {"name": "MESHTRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    )
    env.append(  # the supervisor fences its rank slot with it (a replaced pod's exits)
        {"name": "MESHTRAIN_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
    )
    env.append(
        {"name": "MESHTRAIN_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    )
    env.append(  # the straggler metrics name the node
        {"name": "MESHTRAIN_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    )
    return env + object_storage_env(spec.object_storage)


def object_storage_env(storage: api_object_storage.ObjectStorage | None) -> list[dict[str, Any]]:
    """The S3 client's variables: endpoint, region, style, CA plain; the keys by ``secretKeyRef``
    (the operator never reads the Secret; a missing key keeps the pod from starting, and says so)."""
    if storage is None:
        return []
    env: list[dict[str, Any]] = [
        {"name": key, "value": value}
        for key, value in api_object_storage.client_environment(storage).items()
    ]
    if storage.credentials_secret:
        for key in (api_object_storage.ACCESS_KEY_ID, api_object_storage.SECRET_ACCESS_KEY):
            ref = {"name": storage.credentials_secret, "key": key}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
        token = {"name": storage.credentials_secret, "key": api_object_storage.SESSION_TOKEN}
        env.append(
            {
                "name": api_object_storage.SESSION_TOKEN,
                "valueFrom": {"secretKeyRef": {**token, "optional": True}},
            }
        )
    return env


def torchrun_shutdown_timeout(spec: api_spec.TrainingJobSpec) -> int:
    """Seconds torchrun gives its ranks after SIGTERM: the pod's grace period less a margin to exit before SIGKILL."""
    return spec.run_policy.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS


def _resources(spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    r = spec.resources
    gpus = {} if r.dra else {r.gpu_resource_name: str(r.gpus_per_node)}  # DRA: claims instead
    amounts: dict[str, str] = {**gpus, **r.extra_resources}
    if spec.pod.rdma and spec.pod.rdma_resource:
        amounts.setdefault(spec.pod.rdma_resource, "1")
    if r.cpu:
        amounts["cpu"] = r.cpu
    if r.memory:
        amounts["memory"] = r.memory
    return {"requests": dict(amounts), "limits": dict(amounts)}


def build_device_claims(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec
) -> list[dict[str, Any]]:
    """With ``resources.dra``: the GPU ResourceClaimTemplate and, asked, the ComputeDomain
    (``device_claims``), each labelled with the hash of its immutable spec."""
    return [
        {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": _metadata(job, name, {naming.LABEL_SPEC_HASH: device_claims.stamp(body)}),
            "spec": body,
        }
        for api_version, kind, name, body in device_claims.objects(job.name, spec)
    ]


def _volumes(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    checkpoint: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}}
        if spec.checkpoint.claim_name
        else {"emptyDir": {}}
    )
    volumes = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
        {"name": "checkpoints", **checkpoint},
        {"name": "spec", "configMap": {"name": naming.configmap_name(job.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    # The root filesystem is read-only: these are the only places the trainer writes.
    mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "checkpoints", "mountPath": naming.volume_dir(spec.checkpoint.path)},
        {"name": "spec", "mountPath": naming.SPEC_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": naming.SCRATCH_DIR},
    ]
    storage = spec.object_storage
    if storage is not None and storage.ca_config_map:  # the private CA of the store's endpoint
        ca = api_object_storage.CA_KEY
        volumes.append(
            {
                "name": api_object_storage.CA_VOLUME,
                "configMap": {"name": storage.ca_config_map, "items": [{"key": ca, "path": ca}]},
            }
        )
        mounts.append(
            {
                "name": api_object_storage.CA_VOLUME,
                "mountPath": api_object_storage.CA_MOUNT_DIR,
                "readOnly": True,
            }
        )
    return volumes, mounts


TRAINER_UID = 65532
"""The trainer image's numeric USER (trainer/Dockerfile); pods run as it, never as root."""

POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": TRAINER_UID,
    "runAsGroup": TRAINER_UID,
    "fsGroup": TRAINER_UID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Pod securityContext: the restricted Pod Security Standard; fsGroup makes the checkpoint claim writable."""


def _container_security(spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """Restricted: no privilege escalation, every capability dropped, read-only root filesystem.

    ``spec.pod.rdma`` adds IPC_LOCK (pinning memory for RDMA), which only the
    privileged Pod Security level admits.
    """
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if spec.pod.rdma:
        capabilities["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }


def _trainer_container(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    index: int,
    image: str,
    mounts: list[dict[str, Any]],
    restart_rules: bool,
    restart_all: bool = False,
    device_error_at: int | None = None,
) -> dict[str, Any]:
    """The trainer container: the built-in trainer's supervisor (restarted in place by the kubelet
    when it dies, ``kubelet_tier``, where ``restart_rules``), or the job's own command (torchrun,
    the gang rebuilt)."""
    run, args = kubelet_tier.command(spec)
    container = {
        "name": naming.CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": run,
        "args": args,
        "env": _env(job, spec, attempt, index, device_error_at),
        "ports": [
            *(
                {"name": naming.metrics_port_name(r), "containerPort": spec.metrics.port + r}
                for r in range(spec.resources.gpus_per_node)
            ),
            {"name": "rendezvous", "containerPort": naming.MASTER_PORT},
        ],
        "resources": _resources(spec)
        | (
            {"claims": claims} if (claims := device_claims.container_claims(job.name, spec)) else {}
        ),
        "volumeMounts": mounts,
        "securityContext": _container_security(spec),
        # Rank 0 writes its final progress here; a failed container reports its log's end instead.
        "terminationMessagePath": naming.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **kubelet_tier.restart_fields(spec, index, rules=restart_rules, all_containers=restart_all),
    }
    if spec.trainer.type == "custom" and spec.trainer.working_dir:
        container["workingDir"] = spec.trainer.working_dir
    return container


def _pinned_to(node: str) -> dict[str, Any]:
    """A required node affinity to ``node`` alone (``matchFields`` on ``metadata.name``)."""
    terms = node_affinity.pinned((), node)
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }
    }


def _named_in_service(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec, name: str
) -> dict[str, Any]:
    """What every pod of a gang's rendezvous shares: never restarted whole, the gang's grace
    period, its DNS name ``name`` in the job's headless Service, the restricted security context."""
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds,
        "hostname": name,
        "subdomain": naming.service_name(job.name),
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
    }


def build_pod(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    index: int,
    node: str,
    *,
    default_image: str = naming.DEFAULT_TRAINER_IMAGE,
    pod_group: str | None = None,
    name: str | None = None,
    restart_rules: bool = True,
    restart_all: bool = False,
    device_errors: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Pod ``index`` of gang ``attempt``, gated, pinned to ``node``; ``default_image`` runs when spec.image is empty.

    It runs ranks ``[index*gpusPerNode, (index+1)*gpusPerNode)`` as torchrun node ``index``.
    With ``pod_group`` the pod names its PodGroup (``spec.schedulingGroup``): the
    scheduler then binds the gang all at once or not at all.  ``name``: a replacement's
    (``naming.replacement_pod_name``), else the gang's own ``<job>-r<attempt>-<index>``.
    ``restart_rules``: the API server accepts container restart rules (``kubelet_tier``);
    ``restart_all``: and their ``RestartAllContainers`` action.  ``device_errors``: node -> the
    job's newest device error there within the window (``device_errors.newest_by_node``); the pod
    on such a node is told it (``exitcodes.DEVICE_ERROR_AT_ENV``).
    """
    name = name or naming.pod_name(job.name, attempt, index)
    volumes, mounts = _volumes(job, spec)
    labels = {
        naming.LABEL_NODE_RANK: str(index),
        naming.LABEL_ATTEMPT: str(attempt),
        naming.LABEL_PIPELINE_STAGES: pipeline_stages(spec, index),
        naming.LABEL_SPEC_HASH: identity.spec_hash(spec),
        **({naming.LABEL_REJOINS: "true"} if replacement.rejoins(spec) else {}),
    }
    metadata = _metadata(job, name, labels)
    metadata["annotations"] = {naming.ANNOTATION_NODE: node}
    image = spec.image or default_image
    told = (device_errors or {}).get(node)
    container = _trainer_container(
        job, spec, attempt, index, image, mounts, restart_rules, restart_all, told
    )
    pod_spec: dict[str, Any] = {
        **_named_in_service(job, spec, name),
        "automountServiceAccountToken": bool(spec.pod.service_account_name),
        "schedulingGates": [{"name": naming.GANG_GATE}],
        "affinity": _pinned_to(node),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True, mode="json")
            for t in spec.resources.tolerations
        ]
    if replacement.rejoins(spec):  # a lost node seen within the rejoin window, not after 300 s
        pod_spec["tolerations"] = [
            *pod_spec.get("tolerations", []),
            *replacement.node_loss_tolerations(spec),
        ]
    if pod_group:
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group}
    if claims := device_claims.pod_claims(job.name, spec):
        pod_spec["resourceClaims"] = claims
    _apply_pod_settings(spec.pod, metadata, container, pod_spec)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
    return pod_override.merge(pod, spec.pod_template_override, node)


SPARE_PROGRAM = (
    "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()"
)
"""What a spare pod runs: nothing, until SIGTERM, which it answers at once (its node is wanted)."""
SPARE_GRACE_SECONDS = 5
"""Grace period of a spare pod: it exits at SIGTERM, so its GPUs are free within a moment."""


def build_spare_pod(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    number: int,
    node: str,
    *,
    default_image: str = naming.DEFAULT_TRAINER_IMAGE,
) -> dict[str, Any]:
    """Spare pod ``number`` of gang ``attempt``, pinned to ``node``: it requests what a gang pod
    requests (so neither kube-scheduler nor another job's plan gives those GPUs away) and runs
    an idle Python in the trainer image, with no volume, port or environment of the gang."""
    pod = build_pod(job, spec, attempt, 0, node, default_image=default_image)
    name = naming.spare_pod_name(job.name, attempt, number)
    labels = pod["metadata"]["labels"]
    for key in (naming.LABEL_NODE_RANK, naming.LABEL_PIPELINE_STAGES, naming.LABEL_REJOINS):
        labels.pop(key, None)
    labels[naming.LABEL_SPARE] = str(number)
    pod["metadata"]["name"] = name
    pod_spec = pod["spec"]
    pod_spec.update(hostname=name, terminationGracePeriodSeconds=SPARE_GRACE_SECONDS, volumes=[])
    pod_spec.pop("schedulingGates", None)
    pod_spec.pop("initContainers", None)
    trainer = next(c for c in pod_spec["containers"] if c["name"] == naming.CONTAINER)
    trainer.update(
        command=["python", "-c", SPARE_PROGRAM], args=[], env=[], ports=[], volumeMounts=[]
    )
    trainer.pop("workingDir", None)
    pod_spec["containers"] = [trainer]
    return pod


STORE_COMMAND = ("python", "-m", "meshtrain.trainer.recovery.store_host")
STORE_CONTAINER = "store"
STORE_RESOURCES = {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
"""The store pod's container: a Python with torch's store (about 525 MiB resident measured with
the CPU wheel's import) and a few keys per rank; no CPU limit, so a busy node never throttles the
store every rank waits on."""


def build_store_pod(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    *,
    placed: str = "",
    avoid: Sequence[str] = (),
    default_image: str = naming.DEFAULT_TRAINER_IMAGE,
) -> dict[str, Any]:
    """The rendezvous store's pod of gang ``attempt`` (``kubelet_tier.store_pod``): the trainer
    image running ``meshtrain.trainer.recovery.store_host`` on ``MASTER_PORT``, no GPU, no volume,
    never restarted (a restarted store would be empty: its loss is a gang rebuild).  Left to
    kube-scheduler (the job's tolerations, not its GPU node selector), kept off the gang's planned
    nodes ``avoid`` where it can be (a lost node then takes a trainer pod or the store, not both;
    the gang's pods are not bound yet when it is scheduled), and with the gang's grace period: it
    serves the stopping ranks until they left.  ``placed``: the placement's ``startTime``
    (``naming.ANNOTATION_PLACED``)."""
    name = naming.store_pod_name(job.name, attempt)
    labels = {
        naming.LABEL_ATTEMPT: str(attempt),
        naming.LABEL_SPEC_HASH: identity.spec_hash(spec),
        naming.LABEL_STORE: "true",
    }
    metadata = _metadata(job, name, labels)
    container: dict[str, Any] = {
        "name": STORE_CONTAINER,
        "image": spec.image or default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(STORE_COMMAND),
        "args": [
            f"--port={naming.MASTER_PORT}",
            f"--nnodes={spec.pods}",
            f"--nproc-per-node={spec.resources.gpus_per_node}",
            f"--in-place-limit={spec.run_policy.recovery.in_place_limit}",
            f"--stall-timeout={spec.run_policy.recovery.stall_timeout_seconds}",
            f"--shutdown-timeout={torchrun_shutdown_timeout(spec)}",
        ],
        "env": [],
        "ports": [{"name": "rendezvous", "containerPort": naming.MASTER_PORT}],
        "resources": STORE_RESOURCES,
        "securityContext": _container_security(spec) | {"capabilities": {"drop": ["ALL"]}},
    }
    gang = {
        "matchLabels": {naming.LABEL_JOB: job.name, naming.LABEL_ATTEMPT: str(attempt)},
        "matchExpressions": [{"key": naming.LABEL_NODE_RANK, "operator": "Exists"}],
    }
    planned = sorted({n for n in avoid if n})
    off_planned = {
        "weight": 100,
        "preference": {  # one value per field requirement (the API server's rule), ANDed
            "matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in planned
            ]
        },
    }
    pod_spec: dict[str, Any] = {
        **_named_in_service(job, spec, name),
        "automountServiceAccountToken": False,
        "affinity": {
            **(
                {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [off_planned]}}
                if planned
                else {}
            ),
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": gang,
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            },
        },
        "containers": [container],
    }
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True, mode="json")
        for t in spec.resources.tolerations
    ]
    if tolerations:  # not the gang's short node-loss ones: a store pod is never replaced
        pod_spec["tolerations"] = tolerations
    settings = spec.pod
    metadata["labels"] = {**settings.labels, **metadata["labels"]}
    metadata["annotations"] = {**settings.annotations, naming.ANNOTATION_PLACED: placed}
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    if settings.priority_class_name:
        pod_spec["priorityClassName"] = settings.priority_class_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _apply_pod_settings(
    settings: api_pod.PodSettings,
    metadata: dict[str, Any],
    container: dict[str, Any],
    pod_spec: dict[str, Any],
) -> None:
    """The job's spec.pod: its labels and annotations never replace the operator's own."""
    metadata["labels"] = {**settings.labels, **metadata["labels"]}
    metadata["annotations"] = {**settings.annotations, **metadata.get("annotations", {})}
    container["env"] = [
        *container["env"],
        *(v.model_dump(by_alias=True, exclude_none=True, mode="json") for v in settings.env),
    ]
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    if settings.service_account_name:
        pod_spec["serviceAccountName"] = settings.service_account_name
    if settings.priority_class_name:
        pod_spec["priorityClassName"] = settings.priority_class_name


def build_pod_group(
    job: identity.JobRef, spec: api_spec.TrainingJobSpec, attempt: int, stamped: str | None = None
) -> dict[str, Any]:
    """The native gang of attempt ``attempt`` (scheduling.k8s.io/v1alpha2): all ``spec.pods`` or none.

    ``stamped``: the running gang's specHash; a pod recreated into it joins its PodGroup even
    when an earlier release computed that hash.
    """
    hashed = identity.spec_hash(spec)
    if stamped is not None and identity.same_spec(stamped, spec):
        hashed = stamped
    name = naming.pod_group_name(job.name, attempt, hashed)
    return {
        "apiVersion": "scheduling.k8s.io/v1alpha2",
        "kind": "PodGroup",
        "metadata": _metadata(job, name),
        "spec": {"schedulingPolicy": {"gang": {"minCount": spec.pods}}},
    }


def build_pods(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    nodes: Sequence[str],
    *,
    default_image: str = naming.DEFAULT_TRAINER_IMAGE,
    pod_group: str | None = None,
    restart_rules: bool = True,
    restart_all: bool = False,
    device_errors: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """The whole gang: pod ``i`` on ``nodes[i]``."""
    if len(nodes) != spec.pods:
        raise ValueError(f"placement has {len(nodes)} node(s) but the job has {spec.pods} pod(s)")
    return [
        build_pod(
            job,
            spec,
            attempt,
            index,
            node,
            default_image=default_image,
            pod_group=pod_group,
            restart_rules=restart_rules,
            restart_all=restart_all,
            device_errors=device_errors,
        )
        for index, node in enumerate(nodes)
    ]
