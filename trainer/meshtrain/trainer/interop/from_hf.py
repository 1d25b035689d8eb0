"""A Hugging Face directory a job starts from (``spec.model.init.fromHF``).

:class:`HFWeights` reads each parameter on demand, so each rank reads only its own pieces, and
:func:`check_directory` refuses a directory that disagrees with the spec before any process
starts, naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from meshtrain.api import hf_directory
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.trainer import storage
from meshtrain.trainer.interop import config_json, name_map
from meshtrain.trainer.models import gpt, llama

Range = tuple[int, int]
"""``[start, stop)`` along one dimension."""


class HFWeights:
    """Dense meshtrain parameters read on demand from a Hugging Face directory (``model.initial_weights``)."""

    def __init__(self, directory: str | Path, config: gpt.GPTConfig) -> None:
        self.directory = storage.local_path(directory, config_json.FIELD)
        self.config = config
        self.files = {k: str(v) for k, v in hf_directory.tensor_files(self.directory).items()}
        """Hugging Face tensor name -> safetensors file."""

    def _read(self, key: str) -> torch.Tensor:
        with safe_open(self.files[key], framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(key)
        return tensor

    def __call__(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        parts = name_map.hf_parts(self.config, name)
        pieces = [self._read(p.key).t() if p.transpose else self._read(p.key) for p in parts]
        return torch.cat(pieces, dim=0).float().contiguous().reshape(shape)

    def _block(
        self, part: name_map.Part, rows: Range | None = None, columns: Range | None = None
    ) -> torch.Tensor:
        """Rows and columns ``[start, stop)`` (None: all) of a part as meshtrain holds it; only they are read."""
        with safe_open(self.files[part.key], framework="pt") as handle:
            sliced = handle.get_slice(part.key)
            first, second = (
                (columns, rows) if part.transpose else (rows, columns)
            )  # Conv1D: (in, out)
            if second is None:
                tensor: torch.Tensor = sliced[_cut(first)]
            else:
                tensor = sliced[_cut(first), _cut(second)]
        return tensor.t() if part.transpose else tensor

    def _extent(self, part: name_map.Part) -> int:
        """Rows of a part as meshtrain holds it (the header only)."""
        with safe_open(self.files[part.key], framework="pt") as handle:
            hf_shape = handle.get_slice(part.key).get_shape()
        return int(hf_shape[-1] if part.transpose else hf_shape[0])

    def _rows(
        self, parts: list[name_map.Part], start: int, stop: int
    ) -> Iterator[tuple[name_map.Part, Range]]:
        """Each part that rows ``[start, stop)`` of the parts concatenated along dim 0 overlap, with its own rows of them."""
        spans, offset = [], 0
        for part in parts:
            extent = self._extent(part)
            spans.append((offset, offset + extent))
            offset += extent
        for index, (low, high) in gpt.window(spans, start, stop):
            yield parts[index], (low - spans[index][0], high - spans[index][0])

    def piece(
        self,
        name: str,
        shape: torch.Size | tuple[int, ...],
        dim: int,
        ranges: gpt.Ranges,
        rows: Range | None = None,
    ) -> torch.Tensor:
        """``ranges`` along ``dim`` of parameter ``name`` (:meth:`__call__`'s tensor), reading only them.

        A fused parameter is its parts concatenated along dim 0: a range of
        rows is cut from the parts it overlaps, a range of columns from every
        part.  ``rows`` keeps only those rows of a column cut (``dim`` 1: a
        data-parallel shard of a tensor-parallel piece).  Equal, element for
        element, to the same cut of :meth:`__call__`.
        """
        parts = name_map.hf_parts(self.config, name)
        blocks: list[torch.Tensor] = []
        for start, stop in ranges:
            if dim == 1:
                window = rows if rows is not None else (0, shape[0])
                cut = [self._block(p, r, (start, stop)) for p, r in self._rows(parts, *window)]
                blocks.append(torch.cat(cut, dim=0) if cut else torch.empty(0, stop - start))
                continue
            blocks += [self._block(p, r) for p, r in self._rows(parts, start, stop)]
        if not blocks:
            empty = list(shape)
            empty[dim] = 0
            return torch.empty(empty)
        return torch.cat(blocks, dim=dim).float().contiguous()


def _cut(extent: Range | None) -> slice:
    return slice(None) if extent is None else slice(*extent)


def _hf_shapes(
    directory: Path, files: dict[str, Path]
) -> Iterator[tuple[str, tuple[int, ...], Path]]:
    for key, path in files.items():
        with safe_open(str(path), framework="pt") as handle:
            yield key, tuple(handle.get_slice(key).get_shape()), path


def check_directory(directory: str | Path, config: gpt.GPTConfig) -> None:
    """Refuse, before any process starts, a directory whose config or tensors disagree with the spec:
    the torch-free checks ``meshtrain validate`` makes (:func:`.hf_directory.check`), then every
    tensor's shape against the model built on the meta device."""
    try:
        directory = storage.local_path(directory, config_json.FIELD).expanduser()
    except storage.ObjectStorageError as err:
        raise config_json.HFError(str(err)) from None
    hf_directory.check(directory, config)
    files = hf_directory.tensor_files(directory)
    shapes = {key: (shape, path) for key, shape, path in _hf_shapes(directory, files)}
    with torch.device("meta"):
        expected = name_map.to_hf(config, dict(llama.build(config).named_parameters()))
    for key, tensor in expected.items():
        if key not in shapes:
            if key.endswith(".bias"):
                continue  # an absent GPT-2 bias is a zero one
            raise config_json.ShapeMismatch(
                f"{config_json.FIELD}: {directory}: tensor {key} is missing from the "
                "safetensors files"
            )
        shape, path = shapes[key]
        if shape != tuple(tensor.shape):
            raise config_json.ShapeMismatch(
                f"{config_json.FIELD}: {path}: tensor {key} has shape {list(shape)}, the spec's "
                f"model needs {list(tensor.shape)} (spec.model: {config.family}, "
                f"hidden={config.hidden}, heads={config.heads}, kvHeads={config.key_value_heads}, "
                f"ffnHidden={config.ffn_hidden}, vocab={config.vocab})"
            )
    for key in sorted(set(shapes) - set(expected)):
        if not _ignored_by_transformers(config, key):
            raise config_json.ShapeMismatch(
                f"{config_json.FIELD}: {shapes[key][1]}: tensor {key} has no place in the spec's "
                f"model (spec.model: {config.family}, layers={config.layers}, "
                f"tieEmbeddings={config.tie_embeddings}); loading it would drop it, so this model's "
                "logits cannot be reproduced"
            )
    for key in name_map.zero_biases(config):
        if key in shapes:
            with safe_open(str(shapes[key][1]), framework="pt") as handle:
                if handle.get_tensor(key).abs().max() > 0:
                    raise config_json.HFError(
                        f"{config_json.FIELD}: {shapes[key][1]}: {key} is not zero; meshtrain's "
                        "GPT has no linear biases, so this model cannot be loaded exactly"
                    )


def _ignored_by_transformers(config: gpt.GPTConfig, key: str) -> bool:
    """Tensors transformers itself skips or overwrites on load: RoPE and causal-mask buffers, a tied head."""
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if config.family == "gpt" and key.endswith((".attn.bias", ".attn.masked_bias")):
        return True
    return key == "lm_head.weight" and config.tie_embeddings


def with_config(job: api_spec.TrainingJobSpec) -> api_spec.TrainingJobSpec:
    """``job`` with every ``spec.model`` field it leaves out taken from its ``fromHF`` directory's
    ``config.json`` (:func:`.hf_directory.with_config`); an ``s3://`` directory is read from its
    local copy (:func:`.storage.local_path`).  A job without ``fromHF``, or whose directory cannot
    be had, is returned as is (:func:`check_directory` says what is wrong)."""
    if not job.model.init.from_hf:
        return job
    try:
        directory = storage.local_path(job.model.init.from_hf, config_json.FIELD).expanduser()
    except storage.ObjectStorageError:
        return job
    return hf_directory.with_config(job, directory)


def _check_shapes(directory: Path, shape: api_model.ModelShape) -> None:
    check_directory(directory, gpt.GPTConfig.from_shape(shape))


def check_spec(job: api_spec.TrainingJobSpec) -> api_spec.TrainingJobSpec:
    """The job completed from its Hugging Face directory and checked against it, tensor by tensor
    (:func:`.hf_directory.check_spec` with :func:`check_directory`); a job without ``fromHF`` as it is."""
    if not job.model.init.from_hf:
        return job
    try:
        directory = storage.local_path(job.model.init.from_hf, config_json.FIELD).expanduser()
    except storage.ObjectStorageError as err:
        raise config_json.HFError(str(err)) from None
    return hf_directory.check_spec(job, directory, _check_shapes)
