"""``dicom-ingest top``: rates and quantiles over a tick, from two scrapes of exposition text."""

from __future__ import annotations

import math
from pathlib import Path

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


def test_top_says_what_it_could_not_reach_and_exits_1(tmp_path: Path) -> None:
    """A target with nothing listening, one that answers 404, and one that is not a
    metrics endpoint: each is named on stderr with its reason, and ``--once`` exits 1."""
    import subprocess
    import sys

    from ingest.embedded.server_process import free_ports

    closed, web = free_ports(2)
    (tmp_path / "metrics").write_text("<html>not metrics</html>\\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(web), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import socket
        import time

        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", web), timeout=1.0):
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        urls = [
            f"http://127.0.0.1:{closed}/metrics",
            f"http://127.0.0.1:{web}/missing",
            f"http://127.0.0.1:{web}/metrics",
        ]
        done = subprocess.run(
            [sys.executable, "-m", "ingest.cli", "top", "--once", "--interval", "0.1", *urls],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert done.returncode == 1, done
    said = done.stderr.splitlines()
    assert f"dicom-ingest top: {urls[0]}: cannot connect: Connect call failed" in said[0]
    assert said[1] == f"dicom-ingest top: {urls[1]}: HTTP 404 File not found"
    assert said[2].startswith(f"dicom-ingest top: {urls[2]}: not Prometheus text")
    assert len(said) == 3  # each said once
    assert done.stdout.count("no answer") == 3
