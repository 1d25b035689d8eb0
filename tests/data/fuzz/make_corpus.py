"""Writes the fuzz corpus of malformed TrainingJob manifests (issue #32 item 8) beside itself.

``python tests/data/fuzz/make_corpus.py`` rewrites ``cases/`` and ``index.json``; both are
committed, so the tests read fixed files and a change to this script shows in the diff.
Each case is a valid job (``tests/builders.JobBuilder``) with one thing wrong, or a file
that is not a TrainingJob at all; ``index.json`` says what each error must name, whether
the file is UTF-8 YAML text, and, where ``kubectl apply`` cannot name the same field, what
it says instead and why (``KUBECTL``).  Every bound of the CRD is also tried just
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
"""File name, contents, what the error names, whether it is UTF-8 YAML text."""


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
    _field(
        "node-selector-bad-value",
        "spec.resources.nodeSelector",
        {"pool": "bad value!"},
        names="spec.resources.nodeSelector.pool",
    ),
    _field(
        "node-selector-int-value",
        "spec.resources.nodeSelector",
        {"pool": 1},
        names="spec.resources.nodeSelector.pool",
    ),
    _field("label-bad-key", "spec.pod.labels", {"bad key!": "x"}),
    _field("label-unicode-key", "spec.pod.labels", {"\u00e9quipe": "x"}),
    _field("label-long-value", "spec.pod.labels", {"team": "x" * 64}, names="spec.pod.labels.team"),
    _field("annotation-bad-key", "spec.pod.annotations", {"a/b/c": "x"}),
    _field(
        "fabric-label-bad",
        "spec.topology.levels",
        [{"label": "bad label!"}],
        names="spec.topology.levels[0].label",
    ),
    _field("nvlink-label-bad", "spec.topology.nvlinkDomainLabel", "a b"),
    _field(
        "env-name-bad",
        "spec.pod.env",
        [{"name": "1BAD", "value": "x"}],
        names="spec.pod.env[0].name",
    ),
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
        "spec.parallelism.d\u200bata",
    ),
    _text(
        "snake-case-key",
        _replaced("gpusPerNode: 1", "gpus_per_node: 1"),
        "spec.resources.gpus_per_node",
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


_INF = "kubectl converts YAML to JSON before it sends it, and JSON has no {}: its own parse error names no field"
_PARSE = "kubectl's YAML reader refuses the file before the API server sees it; its error names the line, not a field"
_NOTHING = "kubectl reads no object from the file and sends nothing"
_DECODE = (
    "the API server's strict decoder refuses an unknown field before the schema is checked, "
    "and names that field: {}"
)
_COLLAPSED = (
    "kubectl's YAML reader keeps the last of duplicate keys silently; the API server judges "
    "what is left"
)
_GO_YAML = "kubectl's YAML reader (go-yaml) {}; the API server refuses the result by its type"
KUBECTL: dict[str, tuple[str, str]] = {
    "bucket-inf.yaml": ("unsupported value: +Inf", _INF.format("infinity")),
    "bucket-nan.yaml": ("unsupported value: NaN", _INF.format("NaN")),
    "learning-rate-inf.yaml": ("unsupported value: +Inf", _INF.format("infinity")),
    "learning-rate-minus-inf.yaml": ("unsupported value: -Inf", _INF.format("infinity")),
    "learning-rate-nan.yaml": ("unsupported value: NaN", _INF.format("NaN")),
    "rope-theta-inf.yaml": ("unsupported value: +Inf", _INF.format("infinity")),
    "float-inf-literal.yaml": ("unsupported value: +Inf", _INF.format("infinity")),
    "alias-bomb.yaml": ("yaml: document contains excessive aliasing", _PARSE),
    "alias-bomb-top.yaml": ("yaml: document contains excessive aliasing", _PARSE),
    "tabs.yaml": ("yaml: line 7: found character that cannot start any token", _PARSE),
    "unclosed-quote.yaml": ("yaml: line 14: found unexpected end of stream", _PARSE),
    "bad-indent.yaml": ("yaml: line 7: did not find expected key", _PARSE),
    "empty.yaml": ("no objects passed to apply", _NOTHING),
    "only-comment.yaml": ("no objects passed to apply", _NOTHING),
    "top-list.yaml": (
        "invalid object to validate",
        "kubectl's client-side check refuses a file that is not one object",
    ),
    "top-scalar.yaml": (
        "invalid object to validate",
        "kubectl's client-side check refuses a file that is not one object",
    ),
    "api-version-wrong.yaml": (
        'no matches for kind "TrainingJob" in version "meshtrain.io/v1"',
        "kubectl maps apiVersion and kind to a resource before it sends anything; no CRD serves "
        "meshtrain.io/v1, so it names the version, not the field",
    ),
    "duplicate-kind.yaml": (
        'no matches for kind "Pod" in version "meshtrain.io/v1alpha1"',
        _COLLAPSED + " (kind: Pod, which no CRD of the group serves)",
    ),
    "duplicate-data.yaml": (
        "spec.parallelism.data: Invalid value: 65537",
        _COLLAPSED + " (data: 65537)",
    ),
    "duplicate-spec.yaml": (
        "spec.parallelism: Invalid value: world size data x pipeline x context x tensor must be a multiple of resources.gpusPerNode",
        _COLLAPSED + " (the second spec, without resources)",
    ),
    "data-null-map.yaml": (
        'unknown field "spec.parallelism.data.value"',
        _DECODE.format("the key inside the mapping"),
    ),
    "alias-bomb-in-data.yaml": (
        'unknown field "lol"',
        _DECODE.format(
            "the anchor's top-level key, which kubectl's reader expands within its alias limit"
        ),
    ),
    "deep-nesting-block.yaml": (
        'unknown field "spec.k0"',
        _DECODE.format("the outermost nested key"),
    ),
    "deep-nesting-flow.yaml": (
        'spec.parallelism.data: Invalid value: "array"',
        _GO_YAML.format("reads all 2000 levels of nesting"),
    ),
    "huge-integer-digits.yaml": (
        'spec.parallelism.data: Invalid value: "string"',
        _GO_YAML.format("reads a 5000-digit integer as a string"),
    ),
    "python-tag.yaml": (
        'spec.parallelism.data: Invalid value: "array"',
        _GO_YAML.format("ignores the python tag and reads its list"),
    ),
    "binary-random.yaml": ("yaml: control characters are not allowed", _PARSE),
    "binary-png.yaml": ("yaml: control characters are not allowed", _PARSE),
    "utf16.yaml": (
        "spec.parallelism.data: Invalid value: 1.1805916207174113e+21",
        "kubectl decodes UTF-16 (the file has a byte-order mark) and the API server refuses "
        "data: 2^70 by its bound; meshtrain reads UTF-8 only and refuses the encoding",
    ),
    "latin1.yaml": (
        'spec.model.preset: Unsupported value: "t\ufffdny"',
        "kubectl replaces the byte that is not UTF-8 and the API server refuses the preset it "
        "does not know; meshtrain refuses the encoding",
    ),
    "two-documents.yaml": (
        "spec.parallelism.data: Invalid value: 0",
        "kubectl applies each document on its own: the first, the valid base job, is accepted "
        "(created by a real apply); the second is refused naming its field",
    ),
}
"""File name -> (what ``kubectl apply``'s error says, why it cannot name the field ``meshtrain
validate`` names) for the files the API server does not judge as validate does; kubectl's
error names validate's field for every other file."""


def main() -> int:
    cases = FIELD_CASES + TEXT_CASES + bound_cases()
    names = [c[0] for c in cases]
    assert len(set(names)) == len(names), "case names repeat"
    out = HERE / "cases"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    index = {}
    assert set(KUBECTL) <= set(names), "KUBECTL names a file that is not a case"
    for name, data, names_, readable in cases:
        (out / name).write_bytes(data)
        index[name] = {"names": names_, "yaml": readable}
        if name in KUBECTL:
            says, why = KUBECTL[name]
            index[name]["kubectl"] = {"says": says, "why": why}
    (HERE / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
