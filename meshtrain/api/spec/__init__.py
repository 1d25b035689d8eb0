"""The TrainingJob spec: one typed model shared by the operator, the trainer and the CLI.

Here is the spec itself (:class:`TrainingJobSpec` and the API's names); each section is a
module beside it with its models and the rules on that section alone, ``cross_section``
holds the rules that read several sections and ``status`` the status.  YAML is camelCase
(``microBatches``), Python snake_case; the models are frozen (``model_copy(update=...)``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from meshtrain.api import limits
from meshtrain.api.spec import base, kube_names, pod_template

# The sections' classes by name: each field of the spec is named like its section's module.
from meshtrain.api.spec.checkpoint import Checkpoint
from meshtrain.api.spec.metrics import Metrics
from meshtrain.api.spec.model import ModelSpec
from meshtrain.api.spec.object_storage import ObjectStorage
from meshtrain.api.spec.parallelism import Parallelism
from meshtrain.api.spec.pod import PodSettings
from meshtrain.api.spec.pod_template import PodTemplateOverride
from meshtrain.api.spec.resources import Resources
from meshtrain.api.spec.run_policy import RunPolicy
from meshtrain.api.spec.topology import Topology
from meshtrain.api.spec.tracking import Tracking
from meshtrain.api.spec.trainer import TrainerProgram
from meshtrain.api.spec.training import Training

API_GROUP = "meshtrain.io"
API_VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SHORT_NAME = "tj"


class TrainingJobSpec(base.SpecModel):
    """The spec of a TrainingJob."""

    image: str = Field(
        "",
        max_length=limits.MAX_IMAGE_LENGTH,
        pattern=kube_names.IMAGE_REFERENCE,
        description="Trainer image; it must contain the meshtrain package. Empty: the cluster's "
        "default trainer image (the operator's --trainer-image, set by the Helm chart).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the trainer image."
    )
    parallelism: Parallelism = Field(
        default_factory=Parallelism, description="Data x pipeline x tensor layout and schedule."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Per-pod GPUs and other resources."
    )
    model: ModelSpec = Field(
        default_factory=lambda: ModelSpec(preset="tiny"), description="GPT decoder shape."
    )
    training: Training = Field(
        default_factory=Training, description="Batch, steps, schedule, precision and data."
    )
    checkpoint: Checkpoint = Field(
        default_factory=Checkpoint, description="Checkpoint location and frequency."
    )
    topology: Topology = Field(
        default_factory=Topology, description="NVLink domain and fabric labels."
    )
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Restarts, deadlines, TTL and suspend."
    )
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus exporter settings.")
    tracking: Tracking = Field(
        default_factory=Tracking,
        description="Experiment trackers rank 0 logs every step to: TensorBoard, MLflow, Weights & Biases.",
    )
    trainer: TrainerProgram = Field(
        default_factory=TrainerProgram,
        description="The program the pods run: the built-in trainer, or a custom PyTorch program.",
    )
    pod: PodSettings = Field(
        default_factory=PodSettings,
        description="Pod settings: env, image pull secrets, ServiceAccount, priority, labels, annotations.",
    )
    object_storage: ObjectStorage | None = Field(
        None,
        description="The S3-compatible store that s3:// URLs of the dataset, fromHF and checkpoint.path "
        "name: endpoint, region and the Secret of its credentials.",
    )
    pod_template_override: PodTemplateOverride = Field(
        default_factory=PodTemplateOverride,
        description="A partial pod (metadata.labels and annotations, a partial PodSpec) merged into "
        "every pod of the gang: volumes, mounts, affinity, init and sidecar containers, security.",
    )

    @model_validator(mode="after")
    def _override_leaves_the_gpus(self) -> TrainingJobSpec:
        problem = (
            pod_template.gpu_problem(self.pod_template_override, self.resources.gpu_resource_name)
            or pod_template.storage_env_problem(
                self.pod_template_override,
                [v.name for v in self.pod.env],
                bool(self.object_storage),
            )
            or pod_template.annotations_problem(self.pod_template_override, self.pod.annotations)
        )
        if problem:
            raise ValueError(problem)
        return self

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.parallelism.world_size

    @property
    def pods(self) -> int:
        """Pods in the gang: one per node slot of gpusPerNode ranks."""
        return self.parallelism.layout.pods(self.resources.gpus_per_node)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.training.effective_global_batch(self.parallelism)


def to_manifest(name: str, spec: TrainingJobSpec, namespace: str | None = None) -> dict[str, Any]:
    """A TrainingJob object for the API server (defaults included, nulls dropped)."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }
