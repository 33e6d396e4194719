"""``/metrics`` of a running worker: counts and histogram sums after a known set of objects.

The worker runs against the real broker and S3 server and serves ``/metrics``
on its health port. The test scrapes once before it publishes anything and
once after every object is finished and committed, and compares the
difference (the instruments are per process, and other tests in this process
count too) with what it sent and with the timings in the result records.
"""

from __future__ import annotations

import base64
import math
import socket
import uuid

import anyio
import pytest
from aiohttp import ClientSession
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ingest import metrics
from ingest.embedded.samples import (
    example_bytes,
    not_dicom,
    synthetic_ct_series,
    synthetic_multiframe,
)
from ingest.embedded.stack import Stack
from ingest.errors import SourceUnavailable
from ingest.logs import package_version
from ingest.retry import with_retries
from ingest.settings import load_settings
from ingest.worker import Outcome, Worker
from ingest_gpu.thread import cuda_unavailable_reason
from tests import harness

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def scrape(port: int) -> Samples:
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_metrics_count_objects_bytes_stages_and_offsets(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, env_value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, env_value)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = dict(synthetic_ct_series(3, 64, 64))  # one GET each (64 KiB parts)
    objects["mf.dcm"] = synthetic_multiframe(8, 128, 96)  # 196 KiB: a probe, then ranges
    objects["CT_small.dcm"] = example_bytes("CT_small.dcm")
    bad_key, bad_body = not_dicom()
    await harness.upload(stack, names.source_bucket, [*objects.items(), (bad_key, bad_body)])
    messages = [harness.aws_notification(names.source_bucket, [k]) for k in objects]
    messages += [harness.aws_notification(names.source_bucket, [bad_key]), b"{not json"]
    port = free_port()
    settings = harness.make_settings(stack, names, health_port=str(port), health_host="127.0.0.1")
    outcomes: list[Outcome] = []
    all_done = anyio.Event()

    def on_outcome(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == len(messages):
            all_done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        await group.start(worker.run)
        before = await scrape(port)
        await harness.publish(stack, names.source_topic, messages)
        with anyio.fail_after(60):
            await all_done.wait()
            partition = {"topic": names.source_topic, "partition": "0"}
            while True:  # the commit loop acknowledges the last offsets shortly after
                after = await scrape(port)
                lag = after.get(("dicom_ingest_consumer_lag", frozenset(partition.items())))
                age = value(after, "dicom_ingest_commit_age_seconds", **partition)
                if lag == 0 and age == 0:
                    break
                await anyio.sleep(0.1)
        worker.stop()

    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    assert sorted(results) == sorted(objects)
    processed = len(objects)

    by_syntax: dict[str, int] = {}
    bytes_by_syntax: dict[str, int] = {}
    for key, result in results.items():
        label = metrics.syntax_label(result["transfer_syntax_uid"])
        by_syntax[label] = by_syntax.get(label, 0) + 1
        bytes_by_syntax[label] = bytes_by_syntax.get(label, 0) + len(objects[key])
    assert by_syntax  # every object has a known syntax: no "other"
    assert "other" not in by_syntax
    for label, count in by_syntax.items():
        outcome = {"outcome": "processed", "transfer_syntax": label}
        assert delta(before, after, "dicom_ingest_objects_total", **outcome) == count
        assert (
            delta(before, after, "dicom_ingest_source_bytes_total", **outcome)
            == (bytes_by_syntax[label])
        )
    failed = {"outcome": "dead_lettered", "transfer_syntax": "unknown"}
    assert delta(before, after, "dicom_ingest_objects_total", **failed) == 1
    assert delta(before, after, "dicom_ingest_dead_letters_total", reason="not_dicom") == 1
    assert delta(before, after, "dicom_ingest_dead_letters_total", reason="bad_notification") == 1

    # per-object stages: one observation per processed object, summing to the sidecars' timings
    for stage, field in (
        ("first_get", "first_get_s"),
        ("parse", "parse_s"),
        ("pixels", "device_s"),
        ("object", "total_s"),
    ):
        observed = delta(before, after, "dicom_ingest_stage_seconds_count", stage=stage)
        total = delta(before, after, "dicom_ingest_stage_seconds_sum", stage=stage)
        expected = sum(r["timings"][field] for r in results.values())
        assert observed == processed, stage
        assert math.isclose(total, expected, abs_tol=1e-6 * processed + 1e-9), stage
    e2e = delta(before, after, "dicom_ingest_stage_seconds_sum", stage="end_to_end")
    assert delta(before, after, "dicom_ingest_stage_seconds_count", stage="end_to_end") == processed
    assert e2e >= sum(r["timings"]["total_s"] for r in results.values())  # includes the wait
    # per-call stages: every object was fetched, the multi-frame one in several ranges
    gets = delta(before, after, "dicom_ingest_stage_seconds_count", stage="fetch")
    assert gets >= len(objects) + 1 + 2  # + the bad object + the multi-frame's ranges
    puts = delta(before, after, "dicom_ingest_stage_seconds_count", stage="sink")
    assert puts >= 2 * processed  # an array and a sidecar each
    assert delta(before, after, "dicom_ingest_stage_seconds_count", stage="device") >= 1
    bucket_le_inf = delta(
        before, after, "dicom_ingest_stage_seconds_bucket", stage="fetch", le="+Inf"
    )
    assert bucket_le_inf == gets
    assert value(after, "dicom_ingest_ranges_in_flight") == 0

    # the worker's live state, read at the scrape; no family has a worker label (one
    # process, one target): the worker id is on build_info
    assert value(after, "dicom_ingest_records_total") == len(messages)
    assert value(after, "dicom_ingest_ring_slots") == 16
    assert value(after, "dicom_ingest_ring_slot_bytes") == 64 * 1024
    assert value(after, "dicom_ingest_ring_slots_in_use") == 0
    assert value(after, "dicom_ingest_ring_acquired_total") >= len(objects) + 1
    assert value(after, "dicom_ingest_commits_total") >= 1
    assert value(after, "dicom_ingest_records_in_flight", **partition) == 0
    assert value(after, "dicom_ingest_device_jobs_total") >= processed
    assert value(after, "dicom_ingest_device_batches_total") >= 1
    assert value(after, "dicom_ingest_device_failed_jobs_total") == 0
    assert value(after, "dicom_ingest_device_busy_seconds") >= 0
    assert after[("dicom_ingest_ready", frozenset())] in (0.0, 1.0)  # what /readyz says
    assert value(after, "process_cpu_seconds_total") > 0  # CPU utilisation, per process
    (build,) = [labels for name, labels in after if name == "dicom_ingest_build_info"]
    assert dict(build)["worker"] == settings.worker_id
    assert dict(build)["version"] == package_version()
    worker_labelled = {name for name, labels in after if any(k == "worker" for k, _ in labels)}
    assert worker_labelled == {"dicom_ingest_build_info"}

    # labelled counters have their series before their first event (rate() needs it)
    for reason in ("not_found", "access_denied", "processing", "limit_exceeded"):
        assert ("dicom_ingest_dead_letters_total", frozenset({("reason", reason)})) in before
    assert ("dicom_ingest_retries_total", frozenset({("reason", "sink")})) in before
    explicit = frozenset({("outcome", "processed"), ("transfer_syntax", "ExplicitVRLittleEndian")})
    assert ("dicom_ingest_objects_total", explicit) in before


@pytest.mark.anyio
async def test_retries_are_counted_by_reason() -> None:
    """The retry policy counts each backoff with the reason of the error it retries."""
    settings = load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
            "DICOM_INGEST_MAX_ATTEMPTS": "4",
            "DICOM_INGEST_RETRY_MAX_WAIT_S": "0.01",
        }
    )

    def retries() -> float:
        found = REGISTRY.get_sample_value(
            "dicom_ingest_retries_total", {"reason": "source_unavailable"}
        )
        return found or 0.0

    start = retries()
    failures = iter([SourceUnavailable("503"), SourceUnavailable("503")])

    async def call() -> str:
        for failure in failures:
            raise failure
        return "ok"

    assert await with_retries(settings, call) == "ok"
    assert retries() - start == 2


def test_labels_are_bounded() -> None:
    """Transfer syntaxes become pydicom's keywords; a UID it does not know is ``other``."""
    assert metrics.syntax_label("1.2.840.10008.1.2.1") == "ExplicitVRLittleEndian"
    assert metrics.syntax_label("1.2.840.10008.1.2.4.50") == "JPEGBaseline8Bit"
    assert metrics.syntax_label("1.2.3.4.5.6.7") == "other"
    assert metrics.syntax_label(None) == "unknown"
    assert set(metrics.STAGES) >= {"first_get", "parse", "fetch", "decode", "device", "sink"}


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(cuda_unavailable_reason() is not None, reason="no CUDA")
async def test_a_cuda_worker_reports_its_gpu_from_nvml(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's gauges for the worker's GPU appear once it has run on the device."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the cuda extra) is not installed")
    for name, env_value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, env_value)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = dict(synthetic_ct_series(2, 64, 64))
    await harness.upload(stack, names.source_bucket, list(objects.items()))
    port = free_port()
    settings = harness.make_settings(
        stack, names, health_port=str(port), health_host="127.0.0.1", device="cuda"
    )
    outcomes: list[Outcome] = []
    all_done = anyio.Event()

    def on_outcome(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == len(objects):
            all_done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        await group.start(worker.run)
        await harness.publish(
            stack,
            names.source_topic,
            [harness.aws_notification(names.source_bucket, [k]) for k in objects],
        )
        with anyio.fail_after(60):
            await all_done.wait()
        samples = await scrape(port)
        worker.stop()
    assert all(o.processed for o in outcomes)
    gpus = {dict(labels)["gpu"] for name, labels in samples if name.startswith("dicom_ingest_gpu_")}
    assert len(gpus) == 1
    [gpu] = gpus
    assert gpu.startswith("GPU-")  # NVML's UUID
    total = value(samples, "dicom_ingest_gpu_memory_total_bytes", gpu=gpu)
    used = value(samples, "dicom_ingest_gpu_memory_used_bytes", gpu=gpu)
    assert total > 1 << 30
    assert 0 < used <= total  # our own context and ring at least
    assert 0 <= value(samples, "dicom_ingest_gpu_utilization_ratio", gpu=gpu) <= 1
    assert value(samples, "dicom_ingest_gpu_pcie_rx_bytes_per_second", gpu=gpu) >= 0
