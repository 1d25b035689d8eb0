"""Fluent builders for TrainingJob specs in tests (no YAML copied into every test)."""

from __future__ import annotations

import copy
from typing import Any


class JobBuilder:
    """Builds the raw ``spec`` dict of a TrainingJob, one section at a time."""

    def __init__(self) -> None:
        self._raw: dict[str, Any] = {
            "parallelism": {"data": 1, "pipeline": 1, "tensor": 1},
            "resources": {"gpusPerNode": 1},
            "model": {"preset": "tiny"},
        }

    def _section(self, name: str, **values: Any) -> JobBuilder:
        self._raw.setdefault(name, {}).update(values)
        return self

    def layout(
        self, data: int = 1, pipeline: int = 1, tensor: int = 1, gpus_per_node: int | None = None
    ) -> JobBuilder:
        self._section("parallelism", data=data, pipeline=pipeline, tensor=tensor)
        return self._section("resources", gpusPerNode=gpus_per_node or data * pipeline * tensor)

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

    def trainer(self, **values: Any) -> JobBuilder:
        return self._section("trainer", **values)

    def raw(self) -> dict[str, Any]:
        return copy.deepcopy(self._raw)
