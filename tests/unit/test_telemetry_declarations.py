"""The exporter's metric table and the :class:`Metrics` attributes that hold its families agree.

Each row of ``exporter.DECLARATIONS`` names the attribute its family (or the rank's series of it)
is set on, and the class declares that attribute again, typed, for mypy: nothing else joins the
two, so these tests do.
"""

from __future__ import annotations

import typing

import prometheus_client

from meshtrain.api import layout
from meshtrain.trainer.telemetry import context, exporter

KINDS = {
    "counter": prometheus_client.Counter,
    "gauge": prometheus_client.Gauge,
    "histogram": prometheus_client.Histogram,
}


def _metrics() -> exporter.Metrics:
    one_rank = layout.ParallelLayout(data=1, pipeline=1, tensor=1)
    return exporter.Metrics(context.RankIdentity.from_env(one_rank, 0, env={}))


def test_every_row_has_its_typed_attribute_and_every_attribute_its_row():
    hints = typing.get_type_hints(exporter.Metrics)
    attributes = [row.attribute for row in exporter.DECLARATIONS]
    assert len(set(attributes)) == len(attributes)
    assert set(attributes) == set(hints)
    for row in exporter.DECLARATIONS:
        assert hints[row.attribute] is KINDS[row.kind], row.attribute


def test_every_row_is_registered_in_the_order_of_the_scrape():
    families = list(_metrics().registry.collect())
    assert [f.name for f in families] == [row.name for row in exporter.DECLARATIONS]
    for family, row in zip(families, exporter.DECLARATIONS):
        assert family.type == row.kind
        assert family.documentation == row.help
        # the rank's series exists from the start; a lazy or labelled family has none until set
        assert bool(family.samples) == row.series_now, row.name


def test_each_attribute_holds_its_own_rows_family():
    metrics = _metrics()
    for value, row in enumerate(exporter.DECLARATIONS, start=1):
        held = getattr(metrics, row.attribute)
        assert isinstance(held, KINDS[row.kind]), row.attribute
        if not row.series_now:
            held = held.labels(**metrics.base, **dict.fromkeys(row.labels, "x"))
        if row.kind == "counter":
            held.inc(value)
        elif row.kind == "gauge":
            held.set(value)
        else:
            held.observe(value)
    families = {f.name: f for f in metrics.registry.collect()}
    for value, row in enumerate(exporter.DECLARATIONS, start=1):
        wanted = {"counter": "_total", "gauge": "", "histogram": "_sum"}[row.kind]
        samples = [s for s in families[row.name].samples if s.name == row.name + wanted]
        assert [s.value for s in samples] == [value], row.attribute
