"""The committed fuzz corpus (``tests/data/fuzz``, issue #32 item 8) and the valid jobs at the
bounds, shared by the unit tier (``meshtrain validate`` and ``plan``) and the integration tier
(the real API server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtrain.api import limits
from tests.builders import JobBuilder

CASES = Path(__file__).parent / "data" / "fuzz" / "cases"
"""One malformed manifest per file (written by ``tests/data/fuzz/make_corpus.py``)."""
INDEX: dict[str, dict[str, Any]] = json.loads((CASES.parent / "index.json").read_text())
"""File name -> ``names`` (what its error must say), ``yaml`` (UTF-8 YAML text) and, where
``kubectl apply`` cannot name the same field, ``kubectl``: what it says and why."""

_WIDEST = {
    "layers": limits.MAX_LAYERS,
    "hidden": limits.MAX_HIDDEN,
    "heads": limits.MAX_HEADS,
    "kvHeads": limits.MAX_HEADS,
    "vocab": limits.MAX_VOCAB,
    "seqLen": limits.MAX_SEQ_LEN,
    "ffnHidden": limits.MAX_FFN_HIDDEN,
}


def _image(manifest: dict[str, Any], image: str) -> dict[str, Any]:
    manifest["spec"]["image"] = image
    return manifest


def _job(name: str) -> JobBuilder:
    return JobBuilder(name, None).parallelism(data=2).gpus(1).model(preset="tiny")


VALID_AT_BOUNDS: dict[str, dict[str, Any]] = {
    "data": _job("at-data").parallelism(data=limits.MAX_DATA).manifest(),
    "world": _job("at-world")
    .parallelism(data=128, pipeline=8, tensor=limits.MAX_TENSOR)
    .gpus(limits.MAX_GPUS_PER_NODE)
    .model(_WIDEST)
    .manifest(),
    "pipeline": _job("at-pipeline")
    .parallelism(data=1, pipeline=limits.MAX_PIPELINE, microBatches=limits.MAX_MICRO_BATCHES)
    .model(layers=limits.MAX_LAYERS)
    .manifest(),
    "interleaved": _job("at-interleaved")
    .parallelism(
        data=1,
        pipeline=16,
        schedule="interleaved-1f1b",
        virtualStages=limits.MAX_VIRTUAL_STAGES,
        microBatches=16,
    )
    .model(layers=limits.MAX_LAYERS)
    .manifest(),
    "integral-floats": _job("at-integral-floats")
    .parallelism(data=2.0, microBatches=4.0)
    .training(steps=1e3, learningRate=1)
    .manifest(),
    "steps": _job("at-steps")
    .training(
        steps=limits.MAX_STEPS,
        warmupSteps=limits.MAX_STEPS,
        seed=limits.MAX_SEED,
        microBatch=limits.MAX_GLOBAL_BATCH // 2,
    )
    .checkpoint(path="/checkpoints/run-1/", claimName="team.checkpoints-1", keep=limits.MAX_COUNT)
    .run_policy(backoffLimit=limits.MAX_COUNT, activeDeadlineSeconds=limits.MAX_SECONDS)
    .manifest(),
    "strings": _image(
        _job("at-strings")
        .resources(shmSize="1Ki", memory="64Gi", nodeSelector={"example.com/pool": "h100_a.1"})
        .pod(labels={"example.com/" + "t" * 63: "v" * 63}, annotations={"note": "n" * 4096})
        .manifest(),
        "registry.example.com:5000/team/trainer@sha256:" + "0" * 64,
    ),
}
"""Valid jobs at (not above) the bounds, so the bounds are not too tight; and integral floats
where integers go, which the API server reads as integers (JSON has one number type)."""
