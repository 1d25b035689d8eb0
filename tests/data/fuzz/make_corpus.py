"""Writes the fuzz corpus of malformed TrainingJob manifests (issue #32 item 8) beside itself.

``python tests/data/fuzz/make_corpus.py`` rewrites ``cases/`` and ``index.json``; both are
committed, so the tests read fixed files and a change to this script shows in the diff.
Each case is a valid job (``tests/builders.JobBuilder``) with one thing wrong, or a file
that is not a TrainingJob at all; ``index.json`` says what each error must name and whether
the file is YAML text ``kubectl apply`` can read.  Every bound of the CRD is also tried just
above its limit (walked from the generated schema, so a new bound gets its case).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from meshtrain.api import crd  # noqa: E402 - after the repository is on the path
from tests.builders import JobBuilder  # noqa: E402

BASE: dict[str, Any] = JobBuilder("fuzz", None).parallelism(data=2).manifest()
"""The valid job every field case changes one thing of."""

Case = tuple[str, bytes, str, bool]
"""File name, contents, what the error names, whether kubectl can read it as YAML."""


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE with the field at dotted ``path`` (under the object) set to ``value``."""
    body = copy.deepcopy(BASE)
    node = body
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return body


def _dump(body: Any) -> bytes:
    return yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=4096).encode()


def _field(name: str, path: str, value: Any, names: str | None = None) -> Case:
    return (f"{name}.yaml", _dump(_with(path, value)), names or path, True)


def _text(name: str, text: str, names: str, readable: bool = True) -> Case:
    return (f"{name}.yaml", text.encode(), names, readable)


FIELD_CASES: list[Case] = [
    _field("data-2-pow-70", "spec.parallelism.data", 2**70),
    _field("data-zero", "spec.parallelism.data", 0),
    _field("data-negative", "spec.parallelism.data", -1),
    _field("data-bool", "spec.parallelism.data", True),
    _field("data-fraction", "spec.parallelism.data", 2.5),
    _field("data-string", "spec.parallelism.data", "2"),
    _field("data-list", "spec.parallelism.data", [2]),
    _field("data-null-map", "spec.parallelism.data", {"value": 2}),
    _field("tensor-true", "spec.parallelism.tensor", True),
    _field("tensor-fraction", "spec.parallelism.tensor", 2.5),
    _field("pipeline-huge", "spec.parallelism.pipeline", 10**30),
    _field("micro-batches-1e30", "spec.parallelism.microBatches", 10**30),
    _field("bucket-inf", "spec.parallelism.bucketMb", float("inf")),
    _field("bucket-nan", "spec.parallelism.bucketMb", float("nan")),
    _field("bucket-negative", "spec.parallelism.bucketMb", -1.0),
    _field("schedule-unknown", "spec.parallelism.schedule", "zero-bubble"),
    _field("zero-stage-four", "spec.parallelism.zeroStage", 4),
    _field("zero-stage-string", "spec.parallelism.zeroStage", "1"),
    _field("steps-1e30", "spec.training.steps", 10**30),
    _field("steps-zero", "spec.training.steps", 0),
    _field("steps-string", "spec.training.steps", "100"),
    _field("steps-fraction", "spec.training.steps", 100.5),
    _field("learning-rate-inf", "spec.training.learningRate", float("inf")),
    _field("learning-rate-minus-inf", "spec.training.learningRate", float("-inf")),
    _field("learning-rate-nan", "spec.training.learningRate", float("nan")),
    _field("learning-rate-string", "spec.training.learningRate", "0.0003"),
    _field("learning-rate-bool", "spec.training.learningRate", True),
    _field("seed-2-pow-64", "spec.training.seed", 2**64),
    _field("seed-negative", "spec.training.seed", -1),
    _field("precision-unknown", "spec.training.precision", "fp8"),
    _field("compile-string", "spec.training.compile", "true"),
    _field("compile-int", "spec.training.compile", 1),
    _field("suspend-string", "spec.runPolicy.suspend", "yes"),
    _field("ttl-negative", "spec.runPolicy.ttlSecondsAfterFinished", -1),
    _field("deadline-1e12", "spec.runPolicy.activeDeadlineSeconds", 10**12),
    _field("checkpoint-root", "spec.checkpoint.path", "/"),
    _field("checkpoint-relative", "spec.checkpoint.path", "relative/dir"),
    _field("checkpoint-traversal", "spec.checkpoint.path", "/checkpoints/../../etc"),
    _field("checkpoint-dot", "spec.checkpoint.path", "/checkpoints/./run"),
    _field("checkpoint-double-slash", "spec.checkpoint.path", "/checkpoints//run"),
    _field("checkpoint-home", "spec.checkpoint.path", "~/checkpoints"),
    _field("checkpoint-nul", "spec.checkpoint.path", "/checkpoints\x00/x"),
    _field("checkpoint-newline", "spec.checkpoint.path", "/checkpoints\n/etc"),
    _field("checkpoint-empty", "spec.checkpoint.path", ""),
    _field("claim-bad", "spec.checkpoint.claimName", "Bad_Claim!!"),
    _field("claim-upper", "spec.checkpoint.claimName", "Checkpoints"),
    _field("claim-leading-dash", "spec.checkpoint.claimName", "-claim"),
    _field("claim-traversal", "spec.checkpoint.claimName", "../etc"),
    _field("image-shell", "spec.image", "evil image; rm -rf /"),
    _field("image-subshell", "spec.image", "$(reboot)"),
    _field("image-newline", "spec.image", "trainer\nlatest"),
    _field("image-fullwidth", "spec.image", "trainer:\uff56\uff11"),
    _field("shm-negative", "spec.resources.shmSize", "-1Gi"),
    _field("shm-zero", "spec.resources.shmSize", "0"),
    _field("shm-suffix-only", "spec.resources.shmSize", "Gi"),
    _field("shm-space", "spec.resources.shmSize", "1 Gi"),
    _field("shm-int", "spec.resources.shmSize", 16),
    _field("memory-negative", "spec.resources.memory", "-64Mi"),
    _field("memory-gb", "spec.resources.memory", "64GB"),
    _field("cpu-zero", "spec.resources.cpu", "0m"),
    _field("extra-resource-negative", "spec.resources.extraResources", {"rdma/ib": "-1"}),
    _field("gpus-per-node-zero", "spec.resources.gpusPerNode", 0),
    _field("gpu-resource-space", "spec.resources.gpuResourceName", "nvidia gpu"),
    _field("node-selector-bad-key", "spec.resources.nodeSelector", {"bad key!": "x"}),
    _field("node-selector-bad-value", "spec.resources.nodeSelector", {"pool": "bad value!"}),
    _field("node-selector-int-value", "spec.resources.nodeSelector", {"pool": 1}),
    _field("label-bad-key", "spec.pod.labels", {"bad key!": "x"}),
    _field("label-unicode-key", "spec.pod.labels", {"\u00e9quipe": "x"}),
    _field("label-long-value", "spec.pod.labels", {"team": "x" * 64}),
    _field("annotation-bad-key", "spec.pod.annotations", {"a/b/c": "x"}),
    _field("fabric-label-bad", "spec.topology.levels", [{"label": "bad label!"}]),
    _field("nvlink-label-bad", "spec.topology.nvlinkDomainLabel", "a b"),
    _field("env-name-bad", "spec.pod.env", [{"name": "1BAD", "value": "x"}]),
    _field("unknown-field", "spec.parallelism.dataa", 2),
    _field("unknown-section", "spec.everything", {"a": 1}),
    _field("unknown-long-key", "spec." + "k" * 5000, 1, names="spec.'kkkkkkkk"),
    _field("spec-list", "spec", [1, 2], names="spec"),
    _field("spec-string", "spec", "parallelism", names="spec"),
    _field("model-preset-unknown", "spec.model.preset", "gpt-5"),
    _field("model-hidden-string", "spec.model.hidden", "4096"),
    _field("rope-theta-inf", "spec.model.ropeTheta", float("inf")),
    _field(
        "world-131072",
        "spec.parallelism",
        {"data": 8192, "pipeline": 16, "tensor": 1},
        names="spec.parallelism.data",
    ),
    _field(
        "world-2-pow-40",
        "spec.parallelism",
        {"data": 65536, "pipeline": 512, "tensor": 64},
        names="spec.parallelism.data",
    ),
    _field("name-upper", "metadata.name", "Bad_Name", names="metadata.name"),
    _field("name-int", "metadata.name", 123, names="metadata.name"),
    _field("name-unicode", "metadata.name", "\u00fcnic\u00f6de", names="metadata.name"),
    _field("metadata-list", "metadata", ["fuzz"], names="metadata"),
    _field("kind-wrong", "kind", "Job", names="kind"),
    _field("api-version-wrong", "apiVersion", "meshtrain.io/v1", names="apiVersion"),
    _field("dataset-long", "spec.training.dataset", "d" * 5000),
    _field("from-hf-long", "spec.model.init.fromHF", "/m" * 3000),
]


def _bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines)


def _replaced(old: str, new: str) -> str:
    """BASE as text with ``old`` replaced by ``new``."""
    return _dump(BASE).decode().replace(old, new, 1)


def _under_spec(extra: str) -> str:
    """BASE as text, with ``extra`` lines inserted under ``spec:`` (two spaces in)."""
    text = _dump(BASE).decode()
    indented = "\n".join("  " + line for line in extra.splitlines())
    return text.replace("spec:\n", f"spec:\n{indented}\n", 1)


TEXT_CASES: list[Case] = [
    _text(
        "alias-bomb",
        _under_spec("x-bomb:\n" + "\n".join("  " + line for line in _bomb(9).splitlines())),
        "aliases",
    ),
    _text(
        "alias-bomb-in-data",
        "lol: &l ["
        + ",".join(["1"] * 16)
        + "]\n"
        + _replaced("data: 2", "data: &b [" + ",".join(["*l"] * 16) + "]"),
        "spec.parallelism.data",
    ),
    _text("alias-bomb-top", _bomb(12), "aliases"),
    _text(
        "duplicate-data",
        # kubectl keeps the last of duplicate keys (its YAML reader, before the API server sees
        # them), so the last is the bad one here: the file is refused there too
        _replaced("data: 2\n", "data: 2\n    data: 65537\n"),
        "duplicate key 'data'",
    ),
    _text(
        "duplicate-spec",
        _dump(BASE).decode() + "spec:\n  parallelism:\n    data: 4\n",
        "duplicate key 'spec'",
    ),
    _text("duplicate-kind", _dump(BASE).decode() + "kind: Pod\n", "duplicate key 'kind'"),
    _text(
        "deep-nesting-flow",
        _replaced("data: 2", "data: " + "[" * 2000 + "]" * 2000),
        "nested deeper",
    ),
    _text(
        "deep-nesting-block",
        _under_spec("".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v: 1"),
        "nested deeper",
    ),
    _text(
        "huge-integer-digits",
        _replaced("data: 2", "data: " + "9" * 5000),
        "digits",
    ),
    _text(
        "huge-integer-literal",
        _replaced("data: 2", "data: 1180591620717411303424"),
        "spec.parallelism.data",
    ),
    _text(
        "python-tag",
        _replaced("data: 2", 'data: !!python/object/apply:os.system ["id"]'),
        "python/object",
    ),
    _text("timestamp-steps", _under_spec("training:\n  steps: 2024-01-01"), "spec.training.steps"),
    _text(
        "yaml11-bool-tensor",
        _replaced("tensor: 1", "tensor: yes"),
        "spec.parallelism.tensor",
    ),
    _text(
        "float-inf-literal",
        _under_spec("training:\n  learningRate: .inf"),
        "spec.training.learningRate",
    ),
    _text(
        "two-documents",
        _dump(BASE).decode() + "---\n" + _dump(_with("spec.parallelism.data", 0)).decode(),
        "single document",
    ),
    _text("empty", "", "expected a YAML mapping"),
    _text("only-comment", "# nothing here\n", "expected a YAML mapping"),
    _text(
        "top-list",
        "- apiVersion: meshtrain.io/v1alpha1\n- kind: TrainingJob\n",
        "expected a YAML mapping",
    ),
    _text("top-scalar", "TrainingJob\n", "expected a YAML mapping"),
    _text("tabs", _replaced("  data: 2", "\tdata: 2"), "not valid YAML"),
    _text(
        "unclosed-quote",
        _replaced("preset: tiny", 'preset: "tiny'),
        "not valid YAML",
    ),
    _text(
        "bad-indent",
        _replaced("    pipeline: 1", "   pipeline: 1"),
        "not valid YAML",
    ),
    _text(
        "unicode-rtl",
        _replaced("preset: tiny", "preset: \u202etiny"),
        "spec.model.preset",
    ),
    _text(
        "zero-width-key",
        _replaced("    data: 2", "    d\u200bata: 2"),
        "spec.parallelism",
    ),
    _text(
        "bom-and-control",
        "\ufeff" + _replaced("preset: tiny", 'preset: "ti\\x07ny"'),
        "spec.model.preset",
    ),
    _text(
        "oversized",
        _replaced("spec:\n", "spec:\n  image: " + "a" * 1_100_000 + "\n"),
        "bytes",
    ),
    ("binary-random.yaml", random.Random(32).randbytes(4096), "UTF-8", False),
    ("binary-png.yaml", b"\x89PNG\r\n\x1a\n" + random.Random(7).randbytes(512), "UTF-8", False),
    (
        "utf16.yaml",
        _dump(_with("spec.parallelism.data", 2**70)).decode().encode("utf-16"),
        "UTF-8",
        False,
    ),
    (
        "latin1.yaml",
        _dump(_with("spec.model.preset", "t\u00e9ny")).decode().encode("latin-1"),
        "UTF-8",
        False,
    ),
]


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """(dotted path, schema node) of every bounded leaf of the spec schema (lists' items skipped)."""
    found = []
    if "maximum" in node or "maxLength" in node or "maxItems" in node or "maxProperties" in node:
        found.append((path, node))
    for name, sub in node.get("properties", {}).items():
        found.extend(_walk(sub, f"{path}.{name}"))
    return found


ITEMS: dict[str, Any] = {
    "spec.resources.tolerations": {"operator": "Exists"},
    "spec.training.datasets": {"path": "/data/a.bin"},
    "spec.training.selectiveRecompute": "mlp",
    "spec.topology.levels": {"label": "rack"},
    "spec.trainer.command": "python",
    "spec.trainer.args": "--x",
    "spec.pod.env": {"name": "A", "value": "1"},
    "spec.pod.imagePullSecrets": "pull",
}
"""One valid item of each bounded list, repeated past its maxItems."""


def _above(path: str, node: dict[str, Any]) -> Any:
    """A value just above the bound of the schema node at ``path``."""
    if "maximum" in node:
        top = node["maximum"]
        return top + 1 if node.get("type") == "integer" else top * 2
    if "maxLength" in node:
        return "a" * (node["maxLength"] + 1)
    if "maxItems" in node:
        return [ITEMS[path]] * (node["maxItems"] + 1)
    return {f"k{i}": "1" for i in range(node["maxProperties"] + 1)}


def bound_cases() -> list[Case]:
    """Every bound of the CRD's spec schema, just above its limit."""
    cases = []
    for path, node in _walk(crd.spec_schema(), "spec"):
        if "maximum" in node and node["maximum"] == 65535:  # metrics.port: a port, not a size
            continue
        name = "above-" + path.removeprefix("spec.").replace(".", "-")
        cases.append(_field(name, path, _above(path, node)))
    return cases


def main() -> int:
    cases = FIELD_CASES + TEXT_CASES + bound_cases()
    names = [c[0] for c in cases]
    assert len(set(names)) == len(names), "case names repeat"
    out = HERE / "cases"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    index = {}
    for name, data, names_, readable in cases:
        (out / name).write_bytes(data)
        index[name] = {"names": names_, "yaml": readable}
    (HERE / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
