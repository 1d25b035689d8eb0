"""Names, labels and annotations the operator puts on the objects it owns.

The constants and the few pure functions that name a job's children (pods, headless Service,
ConfigMap, DRA claim templates and ComputeDomain) and read the operator's own labels back.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.api import job_dir as api_job_dir
from meshtrain.api import release
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import metrics as api_metrics
from meshtrain.api.spec import pod_template as api_pod_template
from meshtrain.api.spec import urls

GROUP = api_spec.API_GROUP
API_VERSION = f"{api_spec.API_GROUP}/{api_spec.API_VERSION}"

LABEL_JOB = f"{GROUP}/job"
"""Name of the TrainingJob a child object belongs to."""
LABEL_NODE_RANK = f"{GROUP}/node-rank"
"""Pod index in the gang (torchrun --node-rank)."""
LABEL_ATTEMPT = f"{GROUP}/attempt"
"""Gang attempt the pod belongs to: ``status.restarts`` when it was created."""
LABEL_PIPELINE_STAGES = f"{GROUP}/pipeline-stages"
"""Pipeline stages whose ranks the pod runs, ``"0"`` or ``"0-1"``."""
LABEL_SPEC_HASH = f"{GROUP}/spec-hash"
"""Hash of the spec the pod was built from (``status.specHash`` of its gang)."""
LABEL_REJOINS = f"{GROUP}/rejoins"
"""``"true"`` on a pod whose trainer can join its running gang's rendezvous (built-in trainer
recovering in place): only such a gang has a lost pod replaced alone."""
LABEL_SPARE = f"{GROUP}/spare"
"""On a spare pod (``runPolicy.recovery.spareNodes``): its number; it holds a node's GPUs for a
replacement and carries no node rank, so the gang's rules never count it."""
LABEL_STORE = f"{GROUP}/rendezvous-store"
"""On a job's store pod (``rendezvousStore: dedicated``), ``"true"``: it carries no node rank
either (the gang's rules never count it)."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "meshtrain-operator"
"""Value of ``app.kubernetes.io/managed-by`` on every child."""

ANNOTATION_NODE = f"{GROUP}/planned-node"
"""Node the planner chose for a pod (also its required node affinity)."""
ANNOTATION_PLACED = f"{GROUP}/placed-at"
"""On a store pod: its placement's ``status.startTime`` (a new one after a Kueue eviction or a
suspension, kept by crash recovery): a store of another placement is never reused."""

GANG_GATE = f"{GROUP}/gang"
"""Scheduling gate on every pod until the whole gang exists."""

CONTAINER = api_pod_template.TRAINER_CONTAINER
"""The trainer container's name (a podTemplateOverride container of this name merges into it)."""

DEFAULT_TRAINER_IMAGE = f"ghcr.io/meshtrain/trainer:{release.VERSION}"
"""The trainer image of this meshtrain release, for jobs with an empty spec.image when the
operator runs without --trainer-image (the chart always passes one)."""
MASTER_PORT = api_metrics.RENDEZVOUS_PORT
"""torchrun rendezvous port on the rank-0 pod."""
SPEC_DIR = "/etc/meshtrain"
SPEC_FILE = f"{SPEC_DIR}/job.yaml"
"""Where the job's spec (the ConfigMap) is mounted inside each pod."""
SCRATCH_DIR = "/tmp"
"""Writable scratch space of the trainer (an emptyDir; the image sets HOME to it)."""
TERMINATION_LOG = "/dev/termination-log"
"""The trainer container's terminationMessagePath: rank 0 writes its final progress there."""
METRICS_PORT_PREFIX = "metrics-"
"""Container port names of the per-rank exporters: ``metrics-0`` .. ``metrics-<gpusPerNode-1>``."""


def metrics_port_name(local_rank: int) -> str:
    """Name of the container port of local rank ``local_rank``'s exporter (metrics.port + local_rank)."""
    return f"{METRICS_PORT_PREFIX}{local_rank}"


VOLUME_DIR_FOR_BUCKET = "/checkpoints"
"""Where the checkpoint volume (logs, traces) is mounted when ``checkpoint.path`` is an ``s3://`` URL."""


def volume_dir(checkpoint_path: str) -> str:
    """Mount path of the checkpoint volume: ``checkpoint.path``, or :data:`VOLUME_DIR_FOR_BUCKET`
    when the checkpoints go to a bucket (the volume then keeps only the logs)."""
    return VOLUME_DIR_FOR_BUCKET if urls.is_url(checkpoint_path) else checkpoint_path


def log_dir(checkpoint_path: str, namespace: str, job: str) -> str:
    """``MESHTRAIN_LOG_DIR`` of the pods: ``<checkpoint.path>/<namespace>/<job>/logs``, in the job's own
    directory, so logs outlive the pods with the claim and jobs sharing a claim keep theirs apart
    (under :func:`volume_dir` when the checkpoints go to a bucket)."""
    return api_job_dir.log_dir(volume_dir(checkpoint_path), namespace, job)


def pod_name(job: str, attempt: int, index: int) -> str:
    """Pod ``index`` of gang attempt ``attempt``: ``<job>-r<attempt>-<index>`` (also its hostname)."""
    return f"{job}-r{attempt}-{index}"


def replacement_pod_name(job: str, attempt: int, index: int, replacement: int) -> str:
    """The ``replacement``-th pod replacing a lost pod ``index`` of gang ``attempt``:
    ``<job>-r<attempt>-<index>-p<replacement>`` (its hostname too).  Pod 0 is replaced only when
    the store runs in a pod of its own, whose name ``MASTER_ADDR`` then holds; otherwise pod 0's
    name in the headless Service, which stays valid since pod 0 is never replaced."""
    return f"{pod_name(job, attempt, index)}-p{replacement}"


def store_pod_name(job: str, attempt: int) -> str:
    """The rendezvous store's pod of gang ``attempt`` (``rendezvousStore: dedicated``):
    ``<job>-r<attempt>-store`` (its hostname too)."""
    return f"{job}-r{attempt}-store"


def spare_pod_name(job: str, attempt: int, number: int) -> str:
    """Spare pod ``number`` of gang ``attempt``: ``<job>-r<attempt>-s<number>``."""
    return f"{job}-r{attempt}-s{number}"


def pod_group_name(job: str, attempt: int, spec_hash: str) -> str:
    """The PodGroup of one gang: a new one per attempt and per spec (its gang size is immutable)."""
    return f"{job}-r{attempt}-{spec_hash[:10]}"


def service_name(job: str) -> str:
    """The headless Service giving pods DNS names (``<pod>.<service>.<ns>.svc``)."""
    return job


def network_policy_name(job: str) -> str:
    """The NetworkPolicy admitting the gang's own pods, and no other pod, to its pods."""
    return f"{job}-gang"


GPU_CLAIM = "gpus"
"""With ``resources.dra``: the pod's claim on its GPUs, and the one request of its template."""
CHANNEL_CLAIM = "channel"
"""With ``resources.dra.computeDomain``: the pod's claim on its ComputeDomain's IMEX channel."""


CLAIM_TEMPLATE_HASH_CHARS = 10
"""Hex digits of its spec's hash in the name of a job's GPU ResourceClaimTemplate."""


def gpu_claim_template_name(job: str, spec_hash: str) -> str:
    """The job's ResourceClaimTemplate (resource.k8s.io) each pod claims its GPUs from:
    ``<job>-gpus-<hash10>``.  A template's spec is immutable, so its name follows its spec: a
    changed ``resources.dra`` is a new template, and kube-controller-manager's claim controller
    never makes a pod's claim from a stale copy of a same-named one."""
    return f"{job}-gpus-{spec_hash[:CLAIM_TEMPLATE_HASH_CHARS]}"


def compute_domain_name(job: str) -> str:
    """The job's ComputeDomain (resource.nvidia.com) shared by its pods."""
    return job


def channel_claim_template_name(job: str) -> str:
    """The ResourceClaimTemplate the ComputeDomain creates for its channel; each pod claims from it."""
    return f"{job}-channel"


def configmap_name(job: str) -> str:
    """The ConfigMap holding the job's spec YAML."""
    return f"{job}-spec"


def master_addr(job: str, namespace: str, attempt: int, *, store_pod: bool = False) -> str:
    """DNS name of the rendezvous store's host through the headless Service (cluster-domain
    independent): the rank-0 pod, or the store pod (``store_pod``)."""
    host = store_pod_name(job, attempt) if store_pod else pod_name(job, attempt, 0)
    return f"{host}.{service_name(job)}.{namespace}.svc"


def int_label(labels: Mapping[str, str] | None, key: str) -> int | None:
    """An integer label value, or None when absent or malformed."""
    value = (labels or {}).get(key)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def progress_port(spec: api_spec.TrainingJobSpec) -> int | None:
    """Where rank 0 serves /progress: the built-in trainer's metrics port, a custom program's
    declared ``trainer.progressPort``; None: a custom program that declares none is not polled."""
    return spec.metrics.port if spec.trainer.type == "builtin" else spec.trainer.progress_port
