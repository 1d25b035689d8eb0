"""``meshtrain.api.loading``'s YAML reading: numbers as kubectl reads them, and a round trip
through the operator's ConfigMap (``dump_yaml``) that gives the trainer the same spec."""

from __future__ import annotations

import pytest

from meshtrain.api import loading, spec
from tests.builders import JobBuilder


@pytest.mark.parametrize(
    ("text", "value"),
    [("3e-4", 3e-4), ("1E3", 1000.0), ("-2.5e+1", -25.0), ("'3e-4'", "3e-4"), ("3", 3)],
)
def test_numbers_are_read_as_kubectl_reads_them(text, value):
    read = loading.load_yaml(f"x: {text}")["x"]
    assert (read, type(read)) == (value, type(value))


def test_an_integral_float_is_an_integer_and_a_fraction_is_not():
    raw = JobBuilder().layout(data=2).raw()
    assert (
        loading.parse_spec({**raw, "parallelism": {**raw["parallelism"], "data": 2.0}}).world_size
        == 2
    )
    with pytest.raises(
        loading.SpecError, match=r"spec\.parallelism\.data: Input should be a valid integer"
    ):
        loading.parse_spec({**raw, "parallelism": {**raw["parallelism"], "data": 2.5}})


def test_a_spec_survives_the_configmap_round_trip():
    job = loading.parse_spec(JobBuilder.cpu_run().training(dataset="1e5", learningRate=3e-3).raw())
    text = loading.dump_yaml(spec.to_manifest("x", job))
    assert "dataset: '1e5'" in text  # a string that would read as a number is quoted
    assert loading.parse_manifest(loading.load_yaml(text))[1] == job


def test_a_duplicate_key_is_named_with_its_line():
    with pytest.raises(loading.SpecError, match=r"duplicate key 'data' at line 3"):
        loading.load_yaml("parallelism:\n  data: 2\n  data: 4\n")
