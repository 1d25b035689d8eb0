"""The one TrainingJob builder of every test tier, in Kueue's ``wrappers`` style.

``JobBuilder().layout(data=2).raw()`` is a spec dict for the pure tests;
``JobBuilder("a", ns, pool).layout(data=8).gpus(4).manifest()`` a whole object
for the API server; ``JobBuilder.cpu_run().layout(pipeline=2).raw()`` a tiny run
the trainer tests train on the CPU.  No YAML is copied into tests.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

from meshtrain.api import limits
from meshtrain.api import spec as api_spec

POOL_LABEL = "meshtrain.test/pool"
"""Node label that confines a test's jobs to the nodes the test created."""

TINY = {"layers": 4, "hidden": 32, "heads": 4, "vocab": 256, "seqLen": 32, "ffnHidden": 128}
"""The model of :meth:`JobBuilder.cpu_run`: a GPT that trains in seconds on the CPU."""
LLAMA_TINY = {
    "family": "llama",
    "layers": 4,
    "hidden": 32,
    "heads": 4,
    "kvHeads": 2,
    "vocab": 256,
    "seqLen": 32,
    "ffnHidden": 96,
}
"""Grouped-query attention with 2 key/value heads: tp2 splits them, one per rank."""
LLAMA_MQA = {**LLAMA_TINY, "kvHeads": 1}
"""One key/value head: under tp2 both ranks hold it (replicated)."""

CPU_PARALLELISM = {
    "schedule": "1f1b",
    "virtualStages": 1,
    "microBatches": 1,
    "sequenceParallel": False,
    "bucketMb": 25.0,
    "zeroStage": 0,
    "gradientCompression": {"mode": "none"},
    "allReduce": "flat",
}
"""Every parallelism knob of :meth:`JobBuilder.cpu_run` beside the degrees, at its default."""
CPU_TRAINING = {
    "globalBatch": 8,
    "steps": 5,
    "learningRate": 3e-3,
    "minLearningRate": 3e-4,
    "warmupSteps": 2,
    "weightDecay": 0.1,
    "gradClip": 1.0,
    "precision": "fp32",
    "seed": 7,
    "dataset": "stdlib",
}
"""The training section of :meth:`JobBuilder.cpu_run` (``microBatch`` follows from the layout)."""


class JobBuilder:
    """A TrainingJob, one section at a time (the tiny preset on one GPU unless told otherwise)."""

    def __init__(
        self, name: str = "job", namespace: str | None = "default", pool: str | None = None
    ):
        """``namespace`` None leaves it out of the manifest: the one ``kubectl -n`` names."""
        self._name, self._namespace = name, namespace
        self._raw: dict[str, Any] = {
            "parallelism": {"data": 1, "pipeline": 1, "tensor": 1},
            "resources": {"gpusPerNode": 1},
            "model": {"preset": "tiny"},
        }
        self._split_global_batch = False
        if pool:
            self._section("resources", nodeSelector={POOL_LABEL: pool})

    @classmethod
    def cpu_run(cls) -> JobBuilder:
        """A tiny run to train on the CPU: :data:`TINY` in fp32 on the stdlib dataset, 5 steps of
        global batch 8, every parallelism knob written out at its default (:data:`CPU_PARALLELISM`).

        ``training.microBatch``, unless set, splits the global batch evenly over the data-parallel
        replicas and the micro-batches, so that every layout trains on the same batches.
        """
        builder = cls().model(TINY).parallelism(**CPU_PARALLELISM).training(**CPU_TRAINING)
        builder._split_global_batch = True
        return builder

    @classmethod
    def largest_world(
        cls,
        name: str = "job",
        namespace: str | None = "default",
        pool: str | None = None,
        *,
        elastic_down_to: int | None = None,
    ) -> JobBuilder:
        """The largest world the CRD admits (``limits.MAX_WORLD_SIZE``): dp·tp8 of the 1.3b preset on
        8-GPU pods; ``elastic_down_to``: any data-parallel degree down to it (with a claim)."""
        data = limits.MAX_WORLD_SIZE // 8
        builder = (
            cls(name, namespace, pool).model(preset="1.3b").layout(data=data, tensor=8).gpus(8)
        )
        if elastic_down_to is not None:
            builder.checkpoint(claimName="ckpt").run_policy(
                elastic={"minData": elastic_down_to, "maxData": data}
            )
        return builder

    @classmethod
    def from_manifest(cls, document: dict[str, Any], *, name: str | None = None) -> JobBuilder:
        """A TrainingJob written elsewhere (an example users apply): its name (or ``name``),
        namespace and spec, to change section by section."""
        metadata = document["metadata"]
        builder = cls(name or metadata["name"], metadata.get("namespace"))
        builder._raw = copy.deepcopy(document["spec"])
        return builder

    def clone(self) -> JobBuilder:
        """A copy to build on, this builder unchanged."""
        return copy.deepcopy(self)

    def _section(self, name: str, **values: Any) -> JobBuilder:
        self._raw.setdefault(name, {}).update(values)
        return self

    def layout(
        self,
        data: int = 1,
        pipeline: int = 1,
        tensor: int = 1,
        gpus_per_node: int | None = None,
        context: int = 1,
    ) -> JobBuilder:
        """The degrees; one pod holds the whole world unless ``gpus_per_node`` (or :meth:`gpus`)
        says otherwise.  ``context`` is written only when above 1 (specs without it stay as they were)."""
        degrees = dict(data=data, pipeline=pipeline, tensor=tensor)
        if context > 1:
            degrees["context"] = context
        self._section("parallelism", **degrees)
        world = data * pipeline * context * tensor
        return self._section("resources", gpusPerNode=gpus_per_node or world)

    def gpus(self, per_node: int) -> JobBuilder:
        return self._section("resources", gpusPerNode=per_node)

    def parallelism(self, **values: Any) -> JobBuilder:
        return self._section("parallelism", **values)

    def model(self, base: dict[str, Any] | None = None, /, **values: Any) -> JobBuilder:
        """``base``, when given, replaces the model section; ``values`` update it."""
        if base is not None:
            self._raw["model"] = copy.deepcopy(base)
        return self._section("model", **values)

    def training(self, **values: Any) -> JobBuilder:
        return self._section("training", **values)

    def resources(self, **values: Any) -> JobBuilder:
        return self._section("resources", **values)

    def dra(
        self,
        device_class: str = "gpu.sim.meshtrain.io",
        *selectors: str,
        match_attribute: str | None = None,
        compute_domain: bool = False,
    ) -> JobBuilder:
        """``resources.dra``: the GPUs as DRA claims of ``device_class`` devices matching ``selectors``."""
        claims: dict[str, Any] = {"deviceClassName": device_class, "selectors": list(selectors)}
        if match_attribute is not None:
            claims["matchAttribute"] = match_attribute
        if compute_domain:
            claims["computeDomain"] = True
        return self._section("resources", dra=claims)

    def image(self, image: str, pull_policy: str | None = None) -> JobBuilder:
        """``spec.image`` and, when given, ``spec.imagePullPolicy``."""
        self._raw["image"] = image
        if pull_policy is not None:
            self._raw["imagePullPolicy"] = pull_policy
        return self

    def run_policy(self, **values: Any) -> JobBuilder:
        return self._section("runPolicy", **values)

    def metrics(self, **values: Any) -> JobBuilder:
        return self._section("metrics", **values)

    def pod(self, **values: Any) -> JobBuilder:
        return self._section("pod", **values)

    def pod_template(
        self,
        spec: dict[str, Any] | None = None,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> JobBuilder:
        """``spec.podTemplateOverride``: a partial PodSpec and the pods' extra labels and annotations."""
        override = self._raw.setdefault("podTemplateOverride", {})
        if spec is not None:
            override["spec"] = copy.deepcopy(spec)
        metadata = {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}
        if metadata:
            override["metadata"] = metadata
        return self

    def topology(self, **values: Any) -> JobBuilder:
        return self._section("topology", **values)

    def checkpoint(self, **values: Any) -> JobBuilder:
        return self._section("checkpoint", **values)

    def trainer(self, **values: Any) -> JobBuilder:
        return self._section("trainer", **values)

    def tracking(self, **values: Any) -> JobBuilder:
        return self._section("tracking", **values)

    def object_storage(self, **values: Any) -> JobBuilder:
        return self._section("objectStorage", **values)

    def raw(self) -> dict[str, Any]:
        """The ``spec`` dict."""
        raw = copy.deepcopy(self._raw)
        if self._split_global_batch:
            training, parallelism = raw["training"], raw["parallelism"]
            split = parallelism["data"] * parallelism["microBatches"]
            training.setdefault("microBatch", training["globalBatch"] // split)
        return raw

    def manifest(self) -> dict[str, Any]:
        """The whole TrainingJob object."""
        metadata = {"name": self._name}
        if self._namespace is not None:
            metadata["namespace"] = self._namespace
        return {
            "apiVersion": f"{api_spec.API_GROUP}/{api_spec.API_VERSION}",
            "kind": api_spec.KIND,
            "metadata": metadata,
            "spec": self.raw(),
        }

    def write(self, directory: pathlib.Path, name: str = "job.yaml") -> pathlib.Path:
        """The manifest as a YAML file ``directory/name``, as a user hands one to the CLI."""
        path = directory / name
        path.write_text(yaml.safe_dump(self.manifest()))
        return path
