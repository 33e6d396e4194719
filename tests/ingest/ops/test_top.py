"""``dicom-ingest top``: rates and quantiles over a tick, from two scrapes of exposition text."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from rich.console import Console

from ingest.metrics import LATENCY_BUCKETS
from ingest.ops.top import parse, quantile, render, stage_only


def test_top_shows_rates_quantiles_ring_and_lag_of_one_tick() -> None:
    registry = CollectorRegistry()
    objects = Counter("dicom_ingest_objects", "", ["outcome", "transfer_syntax"], registry=registry)
    source = Counter(
        "dicom_ingest_source_bytes", "", ["outcome", "transfer_syntax"], registry=registry
    )
    stages = Histogram(
        "dicom_ingest_stage_seconds", "", ["stage"], buckets=LATENCY_BUCKETS, registry=registry
    )
    slots = Gauge("dicom_ingest_ring_slots", "", ["worker"], registry=registry)
    in_use = Gauge("dicom_ingest_ring_slots_in_use", "", ["worker"], registry=registry)
    lag = Gauge(
        "dicom_ingest_consumer_lag", "", ["worker", "topic", "partition"], registry=registry
    )
    slots.labels("w").set(24)
    stages.labels("first_get").observe(50.0)  # another stage: must not move end to end
    before = parse(generate_latest(registry).decode(), at=10.0)

    for _ in range(90):
        stages.labels("end_to_end").observe(0.02)  # in (0.01, 0.025]
    for _ in range(10):
        stages.labels("end_to_end").observe(0.4)  # in (0.25, 0.5]
    objects.labels("processed", "ExplicitVRLittleEndian").inc(100)
    source.labels("processed", "ExplicitVRLittleEndian").inc(50e6)
    in_use.labels("w").set(6)
    lag.labels("w", "s3-events", "0").set(7)
    after = parse(generate_latest(registry).decode(), at=20.0)

    e2e = stage_only(before, "end_to_end"), stage_only(after, "end_to_end")
    p50 = quantile(0.5, *e2e)
    assert 0.01 < p50 <= 0.025
    assert math.isclose(p50, 0.01 + 0.015 * (50 / 90))  # linear in the bucket, as Prometheus
    assert 0.25 < quantile(0.99, *e2e) <= 0.5
    assert math.isnan(quantile(0.5, before, before))  # nothing observed in the tick

    console = Console(record=True, width=100)
    console.print(render("http://w:8080/metrics", before, after))
    text = console.export_text()
    assert "processed /s" in text
    assert "10.0" in text  # 100 objects in 10 s
    assert "5.0" in text  # 50 MB in 10 s
    assert "25%" in text  # 6 of 24 slots
    assert "lag s3-events/0" in text
    assert "7 (0 s)" in text
    idle = Console(record=True, width=100)  # a tick with nothing finished shows dashes
    idle.print(render("http://w:8080/metrics", after, after))
    assert "end to end p99" in idle.export_text()
