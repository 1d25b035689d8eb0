"""A ``model.init.fromHF`` directory checked against the spec without torch: config.json and the
safetensors files' names, as ``meshtrain validate`` and ``meshtrain run`` both check them.

:func:`check_spec` completes the spec from ``config.json`` where it is silent (:func:`with_config`)
and refuses a directory that does not fit it (:func:`check`); the trainer passes a deeper check
(every tensor's shape against the model it builds) that starts with :func:`check`.  The
safetensors headers are read here as the format defines them (an 8-byte length, then JSON), each
bounded, so a file never has to be loaded to name its tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.api import hf_config, limits, loading, presets
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model

FIELD = hf_config.FIELD
HEADER_LENGTH_BYTES = 8
"""A safetensors file opens with its header's length, a little-endian unsigned 64-bit integer."""


def indexed_files(directory: Path) -> dict[str, Path]:
    """The ``weight_map`` of ``model.safetensors.index.json``, as transformers loads a sharded model."""
    index = directory / hf_config.WEIGHTS_INDEX
    document = hf_config.read_json(index)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise hf_config.HFError(
            f"{FIELD}: {index} is not a safetensors index with a weight_map object of tensor "
            "name -> file"
        )
    where = {str(key): directory / str(name) for key, name in weight_map.items()}
    missing = sorted({str(p) for p in where.values() if not p.is_file()})
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise hf_config.HFError(f"{FIELD}: {index} names files that are not there: {shown}")
    return where


def header(path: Path) -> dict[str, Any]:
    """The JSON header of a ``*.safetensors`` file (tensor name -> dtype, shape, offsets), bounded."""
    try:
        with path.open("rb") as file:
            prefix = file.read(HEADER_LENGTH_BYTES)
            if len(prefix) < HEADER_LENGTH_BYTES:
                raise hf_config.HFError(f"{FIELD}: {path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > limits.MAX_SAFETENSORS_HEADER_BYTES:
                raise hf_config.HFError(
                    f"{FIELD}: {path} is not a safetensors file (a header of {length} bytes)"
                )
            data = file.read(length)
    except OSError as err:
        raise hf_config.HFError(f"{FIELD}: {path} cannot be read ({err.strerror})") from None
    try:
        document = json.loads(data) if len(data) == length else None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        document = None
    if not isinstance(document, dict):
        raise hf_config.HFError(
            f"{FIELD}: {path} is not a safetensors file (its header is no JSON object)"
        )
    return {key: value for key, value in document.items() if key != "__metadata__"}


def tensor_files(directory: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (one file or a sharded set).

    With ``model.safetensors.index.json`` its ``weight_map`` decides (other
    ``*.safetensors`` files, e.g. a consolidated copy, are not read); without
    one, every file's header is read and a tensor in two of them is refused.
    """
    if (directory / hf_config.WEIGHTS_INDEX).is_file():
        return indexed_files(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise hf_config.HFError(f"{FIELD}: {directory} has no *.safetensors file")
    if len(files) > limits.MAX_HF_FILES:
        raise hf_config.HFError(
            f"{FIELD}: {directory} holds {len(files)} *.safetensors files, more than "
            f"{limits.MAX_HF_FILES}: add the {hf_config.WEIGHTS_INDEX} that says which to load"
        )
    where: dict[str, Path] = {}
    for path in files:
        for key in header(path):
            if key in where:
                raise hf_config.HFError(
                    f"{FIELD}: tensor {key} is in both {where[key]} and {path}: "
                    f"remove the stale file, or add the {hf_config.WEIGHTS_INDEX} that says "
                    "which to load"
                )
            where[key] = path
    return where


def check(directory: Path, shape: hf_config.Shape) -> None:
    """Refuse a directory that is missing, whose ``config.json`` disagrees with ``shape``, or whose
    safetensors files (or index) do not name the tensors: what can be told without the model."""
    if not directory.is_dir():
        raise hf_config.HFError(f"{FIELD}: {directory} is not a directory")
    hf_config.check_config(directory, shape)
    tensor_files(directory)


def with_config(job: api_spec.TrainingJobSpec, directory: Path) -> api_spec.TrainingJobSpec:
    """``job`` with every ``spec.model`` field it leaves out taken from ``directory``'s ``config.json``.

    What the spec states wins, and :func:`check` then refuses a stated value
    that differs from the file's, naming both; a named preset states its
    values too (the operator plans memory for them); what the spec leaves
    out is the file's (:func:`.hf_config.stated`).  A directory without a
    readable config leaves the job as it is (:func:`check` says what is wrong).
    """
    try:
        stated = hf_config.stated(directory)
    except hf_config.HFError:
        return job
    raw = job.model_dump(by_alias=True, exclude_none=True)
    given = set(raw["model"]) | _preset_fields(job.model)
    taken = {key: value for key, value in stated.items() if key not in given}
    if not taken:
        return job
    raw["model"] = {**raw["model"], **taken}
    return loading.parse_spec(raw, f"spec.model with {directory / hf_config.CONFIG}'s values")


def _preset_fields(model: api_model.ModelSpec) -> set[str]:
    """The ``spec.model`` fields (camelCase) the job's named preset states."""
    if not model.preset:
        return set()
    fields = api_model.ModelSpec.model_fields
    return {fields[name].alias or name for name in presets.PRESETS[model.preset]}


DirectoryCheck = Callable[[Path, api_model.ModelShape], None]
"""A check of a directory against the job's resolved model shape; raises :class:`.hf_config.HFError`."""


def check_spec(
    job: api_spec.TrainingJobSpec, directory: Path, check_directory: DirectoryCheck = check
) -> api_spec.TrainingJobSpec:
    """The job completed from ``directory`` (:func:`with_config`) and checked against it
    (``check_directory``: :func:`check` here, the trainer's tensor-by-tensor one for a run).

    A preset's values that the file contradicts (a :class:`.hf_config.ShapeMismatch`) are named as
    the preset's, with the fix; other errors (a missing directory, a bad file) are not the preset's."""
    job = with_config(job, directory)
    try:
        check_directory(directory, job.model.shape())
    except hf_config.ShapeMismatch as err:
        if not job.model.preset:
            raise
        raise hf_config.HFError(
            f"{err} (spec.model.preset={job.model.preset} states the fields the spec does not set: "
            "set the field, or drop the preset to take config.json's)"
        ) from None
    return job
