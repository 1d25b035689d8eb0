"""Fluent TrainingJob builders shared by every test tier, in Kueue's ``wrappers`` style.

``JobBuilder().layout(data=2).raw()`` is a spec dict for the pure tests;
``JobBuilder("a", ns, pool).layout(data=8).gpus(4).manifest()`` a whole object
for the API server.  No YAML is copied into tests.
"""

from __future__ import annotations

import copy
from typing import Any

from meshtrain.api import spec as api_spec

POOL_LABEL = "meshtrain.test/pool"
"""Node label that confines a test's jobs to the nodes the test created."""


class JobBuilder:
    """A TrainingJob, one section at a time (the tiny preset on one GPU unless told otherwise)."""

    def __init__(self, name: str = "job", namespace: str = "default", pool: str | None = None):
        self._name, self._namespace = name, namespace
        self._raw: dict[str, Any] = {
            "parallelism": {"data": 1, "pipeline": 1, "tensor": 1},
            "resources": {"gpusPerNode": 1},
            "model": {"preset": "tiny"},
        }
        if pool:
            self._section("resources", nodeSelector={POOL_LABEL: pool})

    def _section(self, name: str, **values: Any) -> JobBuilder:
        self._raw.setdefault(name, {}).update(values)
        return self

    def layout(
        self, data: int = 1, pipeline: int = 1, tensor: int = 1, gpus_per_node: int | None = None
    ) -> JobBuilder:
        """The degrees; one pod holds the whole world unless ``gpus_per_node`` (or :meth:`gpus`) says otherwise."""
        self._section("parallelism", data=data, pipeline=pipeline, tensor=tensor)
        return self._section("resources", gpusPerNode=gpus_per_node or data * pipeline * tensor)

    def gpus(self, per_node: int) -> JobBuilder:
        return self._section("resources", gpusPerNode=per_node)

    def parallelism(self, **values: Any) -> JobBuilder:
        return self._section("parallelism", **values)

    def model(self, **values: Any) -> JobBuilder:
        return self._section("model", **values)

    def training(self, **values: Any) -> JobBuilder:
        return self._section("training", **values)

    def resources(self, **values: Any) -> JobBuilder:
        return self._section("resources", **values)

    def run_policy(self, **values: Any) -> JobBuilder:
        return self._section("runPolicy", **values)

    def metrics(self, **values: Any) -> JobBuilder:
        return self._section("metrics", **values)

    def pod(self, **values: Any) -> JobBuilder:
        return self._section("pod", **values)

    def topology(self, **values: Any) -> JobBuilder:
        return self._section("topology", **values)

    def checkpoint(self, **values: Any) -> JobBuilder:
        return self._section("checkpoint", **values)

    def trainer(self, **values: Any) -> JobBuilder:
        return self._section("trainer", **values)

    def raw(self) -> dict[str, Any]:
        """The ``spec`` dict."""
        return copy.deepcopy(self._raw)

    def manifest(self) -> dict[str, Any]:
        """The whole TrainingJob object."""
        return {
            "apiVersion": f"{api_spec.API_GROUP}/{api_spec.API_VERSION}",
            "kind": api_spec.KIND,
            "metadata": {"name": self._name, "namespace": self._namespace},
            "spec": self.raw(),
        }
