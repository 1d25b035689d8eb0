"""The per-rank Prometheus exporter and rank 0's /progress, fed by a synthetic pipeline."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import parser

from meshtrain.api import layout as layout_mod
from meshtrain.api import loading
from meshtrain.trainer.parallel import state_bytes
from meshtrain.trainer.telemetry import context, exporter, progress, stepstats
from meshtrain.trainer.telemetry.recorder import TelemetryRecorder, make_recorder
from tests.builders import JobBuilder
from tests.telemetry import promserver
from tests.unit import telemetry_feed

DESIGN_NAMES = {
    "meshtrain_tokens",
    "meshtrain_step_seconds",
    "meshtrain_allreduce_seconds",
    "meshtrain_allreduce_bytes",
    "meshtrain_pipeline_bubble_ratio",
    "meshtrain_pipeline_bubble_ratio_theoretical",
    "meshtrain_loss",
    "meshtrain_model_flops_utilization_ratio",
}
LABELS = {"trainingjob", "namespace", "pod", "rank", "dp", "pp", "tp"}


def free_base(count: int) -> int:
    return promserver.free_port_block(count, start=23000, stop=30000)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


@pytest.fixture()
def pipeline(tmp_path, monkeypatch):
    """Two stages x two replicas (dp2·pp2) of recorders serving on free ports, fed two steps."""
    monkeypatch.setenv("MESHTRAIN_JOB_NAME", "demo")
    monkeypatch.setenv("MESHTRAIN_NAMESPACE", "team-a")
    monkeypatch.setenv("MESHTRAIN_POD_NAME", "demo-0")
    base = free_base(4)
    job = loading.parse_spec(
        JobBuilder()
        .layout(data=2, pipeline=2)
        .parallelism(microBatches=4)
        .metrics(port=base, peakFlops=1e12)
        .raw()
    )
    layout = job.parallelism.layout
    recorders = [make_recorder(job, layout, rank, tmp_path, local_rank=rank) for rank in range(4)]
    events, seconds = telemetry_feed.simulate_step(
        "1f1b", 2, 4, fwd=0.01, bwd=0.02, buckets=3, bucket_seconds=0.002
    )
    for step in (1, 2):
        for rank, rec in enumerate(recorders):
            telemetry_feed.feed(
                rec, step, events[layout.coords(rank).pp], seconds, origin=10.0 * step, tokens=4096
            )
    yield base, recorders
    for rec in recorders:
        rec.close()


def families(base: int, rank: int) -> dict[str, parser.Metric]:
    status, body = get(f"http://127.0.0.1:{base + rank}/metrics")
    assert status == 200
    return {f.name: f for f in parser.text_string_to_metric_families(body.decode())}


def test_every_design_metric_is_served_with_the_rank_labels(pipeline):
    base, _ = pipeline
    fams = families(base, 2)  # rank 2 = pp 1, dp 0
    assert set(fams) >= DESIGN_NAMES
    for name in DESIGN_NAMES:
        for sample in fams[name].samples:
            assert set(sample.labels) >= LABELS, (name, sample.labels)
            assert (
                sample.labels["trainingjob"],
                sample.labels["namespace"],
                sample.labels["pod"],
            ) == (
                "demo",
                "team-a",
                "demo-0",
            )
            assert (
                sample.labels["rank"],
                sample.labels["pp"],
                sample.labels["dp"],
                sample.labels["tp"],
            ) == ("2", "1", "0", "0")


def test_no_series_sets_prometheus_job_label_and_none_duplicates_a_rate(pipeline):
    """``job`` is the scrape job's (Prometheus sets it); throughput is rate(meshtrain_tokens_total)."""
    base, _ = pipeline
    for rank in range(4):
        fams = families(base, rank)
        samples = [s for f in fams.values() for s in f.samples]
        assert samples
        assert all("job" not in s.labels for s in samples), rank
        assert all(s.labels["trainingjob"] == "demo" for s in samples)
        assert all(s.labels["namespace"] == "team-a" for s in samples)
        # A gauge of <unit>/s beside a counter of <unit> is that counter's rate (the peak FLOP/s is
        # the device's, no counter's).
        units = {f.name.rsplit("_", 1)[-1] for f in fams.values() if f.type == "counter"}
        rates = {
            f.name
            for f in fams.values()
            if f.type == "gauge"
            and f.name.endswith("_per_second")
            and f.name.removesuffix("_per_second").rsplit("_", 1)[-1] in units
        }
        assert {"tokens", "bytes", "seconds"} <= units and rates == set(), rates


def test_values_follow_the_steps(pipeline):
    base, recorders = pipeline
    fams = families(base, 0)

    def value(name: str, suffix: str = "", **labels: str) -> float:
        return next(
            s.value
            for s in fams[name].samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("meshtrain_tokens", "_total") == 2 * 4096
    assert value("meshtrain_step_seconds", "_count") == 2
    assert (
        value("meshtrain_allreduce_seconds", "_count", group="dp", op="all_reduce") == 6
    )  # 3 buckets x 2 steps
    assert value("meshtrain_allreduce_bytes", "_total", group="dp") == 6 * (1 << 20)
    assert value("meshtrain_pipeline_bubble_ratio_theoretical") == pytest.approx(0.2)
    assert value("meshtrain_pipeline_bubble_ratio") == pytest.approx(recorders[0].last.bubble_ratio)
    assert value("meshtrain_loss") == 2.0
    assert value("meshtrain_model_flops_utilization_ratio") == pytest.approx(recorders[0].last.mfu)
    busy = value("meshtrain_collective_busy_seconds", "_total", group="dp", op="all_reduce")
    bus_bytes = value("meshtrain_collective_bus_bytes", "_total", group="dp", op="all_reduce")
    payload = value("meshtrain_allreduce_bytes", "_total", group="dp", op="all_reduce")
    assert busy > 0
    assert bus_bytes == pytest.approx(payload)  # 2(n-1)/n = 1 of the payload: an all-reduce of 2
    assert value("meshtrain_exposed_comm_seconds", "_sum") == pytest.approx(2 * 3 * 0.002)
    assert value("meshtrain_memory_peak_bytes") > 0
    assert value("meshtrain_step") == 2


def test_progress_only_on_global_rank_zero(pipeline):
    base, recorders = pipeline
    status, body = get(f"http://127.0.0.1:{base}/progress")
    doc = json.loads(body)
    assert status == 200 and set(doc) == set(progress.FIELDS)
    assert (doc["step"], doc["loss"], doc["last_checkpoint_step"]) == (2, 2.0, None)
    assert (doc["eval_loss"], doc["skipped_updates"], doc["gradient_noise_scale"]) == (
        None,
        0,
        None,
    )
    assert doc["updated_at"].endswith("Z")
    recorders[0].checkpoint_saved(2)
    assert json.loads(get(f"http://127.0.0.1:{base}/progress")[1])["last_checkpoint_step"] == 2
    assert get(f"http://127.0.0.1:{base + 1}/progress")[0] == 404
    assert get(f"http://127.0.0.1:{base + 1}/healthz")[0] == 200


def test_noise_scale_is_exported_once_measured(pipeline):
    base, recorders = pipeline

    def noise() -> float:
        [sample] = families(base, 0)["meshtrain_gradient_noise_scale"].samples
        return sample.value

    assert math.isnan(noise())  # not measured yet: no ratio against the global batch
    [batch] = families(base, 0)["meshtrain_global_batch_sequences"].samples
    assert batch.value > 0
    recorders[0].health(3, eval_loss=None, skipped="", noise_scale=123.0)
    assert noise() == 123.0
    doc = json.loads(get(f"http://127.0.0.1:{base}/progress")[1])
    assert doc["gradient_noise_scale"] == 123.0


def test_memory_of_the_watched_state_is_exported_by_component(tmp_path):
    layout = layout_mod.ParallelLayout(1, 1, 1)
    identity = context.RankIdentity.from_env(layout, 0, 0, env={})
    base = free_base(1)
    exp = exporter.Exporter(
        identity, telemetry_feed_facts(), port=base, progress=None, host="127.0.0.1"
    )
    rec = TelemetryRecorder(identity, telemetry_feed_facts(), [exp])
    weight = torch.nn.Parameter(torch.zeros(10, 10))
    view = torch.nn.Parameter(
        weight.detach().view(100)[:50]
    )  # shares weight's storage: counted once
    opt = torch.optim.AdamW([weight])
    weight.grad = torch.ones(10, 10)
    opt.step()
    rec.watch(state_bytes.meter([weight, view], opt, None))
    sample = rec.memory()
    assert (sample.parameters, sample.gradients) == (400, 400)
    assert sample.optimizer == 2 * 400 + 4  # exp_avg + exp_avg_sq + the step counter
    assert sample.peak_allocated > 0
    events, seconds = telemetry_feed.simulate_step("1f1b", 1, 1)
    telemetry_feed.feed(rec, 1, events[0], seconds)
    try:
        fams = families(base, 0)
    finally:
        rec.close()
    by_component = {s.labels["component"]: s.value for s in fams["meshtrain_memory_bytes"].samples}
    assert by_component == {"parameters": 400, "gradients": 400, "optimizer": 804}
    assert set(fams["meshtrain_memory_peak_bytes"].samples[0].labels) >= LABELS
    assert fams["meshtrain_memory_peak_bytes"].samples[0].value == pytest.approx(
        sample.peak_allocated, rel=0.5
    )
    assert (identity.job, identity.namespace) == ("local", "local")


def telemetry_feed_facts() -> stepstats.JobFacts:
    return stepstats.JobFacts(1, 1, 1, 1, {"dp": 1, "tp": 1, "pp": 1}, 1.0, 1.0)


def test_a_busy_port_does_not_stop_training(tmp_path):
    with socket.create_server(("0.0.0.0", 0)) as busy:
        port = busy.getsockname()[1]
        identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
        exp = exporter.Exporter(
            identity, telemetry_feed_facts(), port=port, progress=progress.Progress()
        )
        assert not exp.serving
        exp.close()


def test_final_progress_goes_to_the_termination_log(tmp_path, monkeypatch):
    doc = progress.Progress()
    doc.update(step=7, loss=2.5, tokens_per_second=100.0)
    doc.checkpoint_saved(6)
    target = tmp_path / "termination-log"
    monkeypatch.setenv(progress.TERMINATION_LOG_ENV, str(target))
    assert progress.write_termination_log(doc.document()) == target
    written = json.loads(target.read_text())
    assert written == doc.document()
    assert (written["step"], written["last_checkpoint_step"], written["loss"]) == (7, 6, 2.5)
    assert (
        len(target.read_bytes()) < 4096
    )  # the kubelet keeps at most 4096 bytes of a termination message


def test_no_termination_log_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(progress.TERMINATION_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert progress.write_termination_log(progress.Progress().document()) is None
    assert list(tmp_path.iterdir()) == []


def test_termination_log_write_error_is_a_warning(tmp_path, monkeypatch, caplog):
    target = tmp_path / "missing-dir" / "termination-log"
    monkeypatch.setenv(progress.TERMINATION_LOG_ENV, str(target))
    with caplog.at_level("WARNING"):
        assert progress.write_termination_log(progress.Progress().document()) is None
    assert str(target) in caplog.text and not target.exists()


def test_a_loaded_checkpoint_counts_as_done_steps():
    doc = progress.Progress()
    doc.checkpoint_saved(40)  # a resumed run: nothing trained yet, checkpoint 40 loaded
    assert (doc.document()["step"], doc.document()["last_checkpoint_step"]) == (40, 40)


def test_exporters_bind_the_configured_host(monkeypatch):
    monkeypatch.setenv(
        exporter.HOST_ENV, "127.0.0.2"
    )  # a loopback address of its own, as a sandbox pod has
    base = free_base(1)
    job = loading.parse_spec(JobBuilder().metrics(port=base, peakFlops=1e12).raw())
    rec = make_recorder(job, job.parallelism.layout, 0, None, local_rank=0)
    try:
        assert get(f"http://127.0.0.2:{base}/healthz")[0] == 200
        with pytest.raises(urllib.error.URLError):  # not on every interface
            urllib.request.urlopen(f"http://127.0.0.1:{base}/healthz", timeout=5)
    finally:
        rec.close()


def test_exporters_bind_every_interface_by_default(monkeypatch):
    monkeypatch.delenv(exporter.HOST_ENV, raising=False)
    assert exporter.bind_host() == "0.0.0.0"


def test_checkpoint_age_and_target_step_are_exported():
    identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
    facts = stepstats.JobFacts(
        1,
        1,
        1,
        1,
        {"dp": 1, "tp": 1, "pp": 1},
        1.0,
        1.0,
        training_steps=500,
        checkpoint_interval_steps=50,
    )
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    exp = exporter.Exporter(identity, facts, port=port, progress=None, host="127.0.0.1")
    try:

        def scrape() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            return {
                f.name: f.samples[0].value
                for f in parser.text_string_to_metric_families(text)
                if f.name.startswith(("meshtrain_checkpoint", "meshtrain_training"))
            }

        started = scrape()
        assert started["meshtrain_training_steps"] == 500
        assert started["meshtrain_checkpoint_interval_steps"] == 50
        assert started["meshtrain_checkpoint_last_step"] == 0
        assert started["meshtrain_checkpoint_last_timestamp_seconds"] > 0  # training start
        exp.checkpoint_saved(50)
        saved = scrape()
        assert saved["meshtrain_checkpoint_last_step"] == 50
        assert (
            saved["meshtrain_checkpoint_last_timestamp_seconds"]
            >= started["meshtrain_checkpoint_last_timestamp_seconds"]
        )
    finally:
        exp.close()


def test_before_the_first_step_the_last_step_time_is_the_start_of_training():
    """A 0 would read as a step 56 years ago: MeshtrainJobStalled would page during every start-up."""
    identity = context.RankIdentity(
        job="j",
        namespace="ns",
        pod="j-0",
        rank=0,
        local_rank=0,
        coords=layout_mod.RankCoords(0, 0, 0),
    )
    facts = stepstats.JobFacts(
        stages=1,
        micro_batches=1,
        virtual_stages=1,
        world_size=1,
        group_sizes={"dp": 1, "tp": 1, "pp": 1},
        flops_per_token=1.0,
        peak_flops=1.0,
    )
    before = time.time()
    sink = exporter.Exporter(identity, facts, port=free_base(1), progress=None)
    try:
        value = sink.metrics.registry.get_sample_value(
            "meshtrain_last_step_timestamp_seconds", identity.labels()
        )
        assert value is not None and before <= value <= time.time()
    finally:
        sink.close()


def test_the_epoch_is_exported_once_given(pipeline):
    base, recorders = pipeline
    recorders[0].health(4, eval_loss=None, skipped="", epoch=2)
    [sample] = families(base, 0)["meshtrain_epoch"].samples
    assert sample.value == 2


def test_in_a_pod_the_exporter_leaves_namespace_and_pod_to_service_discovery():
    """Prometheus' Kubernetes discovery labels every target with its namespace and pod: an
    exporter in a pod the operator built (``KUBERNETES_SERVICE_HOST`` and ``MESHTRAIN_NODE_NAME``
    set) serves neither; a local run, scraped without discovery, serves both (tests run in a
    Kubernetes pod of a CI count as local)."""
    env = {"MESHTRAIN_JOB_NAME": "j", "MESHTRAIN_NAMESPACE": "ns", "MESHTRAIN_POD_NAME": "j-0"}
    layout = layout_mod.ParallelLayout(1, 1, 1)
    local = context.RankIdentity.from_env(layout, 0, 0, env=env)
    assert {"namespace": "ns", "pod": "j-0"}.items() <= local.labels().items()
    ci_pod = context.RankIdentity.from_env(
        layout, 0, 0, env={**env, "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    )
    assert not ci_pod.in_cluster and "namespace" in ci_pod.labels()
    in_pod = context.RankIdentity.from_env(
        layout,
        0,
        0,
        env={**env, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "MESHTRAIN_NODE_NAME": "gpu-7"},
    )
    assert in_pod.in_cluster and not {"namespace", "pod"} & set(in_pod.labels())
    sink = exporter.Exporter(in_pod, telemetry_feed_facts(), port=free_base(1), progress=None)
    try:
        samples = [s for family in sink.metrics.registry.collect() for s in family.samples]
        assert samples
        assert all(s.labels.get("trainingjob") == "j" for s in samples)
        assert not [s for s in samples if {"namespace", "pod"} & set(s.labels)], samples[:3]
    finally:
        sink.close()
