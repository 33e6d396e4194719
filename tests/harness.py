"""Helpers for tests that run the real worker against the real broker and S3 server."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import resource
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import anyio
import numpy as np
from aiobotocore.session import get_session
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from awscrt import checksums

from ingest.embedded.samples import (
    example_bytes,
    synthetic_ct_series,
    synthetic_multiframe,
    synthetic_rgb,
)
from ingest.embedded.stack import Stack, create_topics
from ingest.fetch.ring import RingStats
from ingest.settings import Settings, load_settings
from ingest.source.kafka import read_topic
from ingest.worker import Outcome, Worker

AUDIT_KEY = bytes(range(32))


@dataclass(frozen=True, slots=True)
class Names:
    source_bucket: str
    output_bucket: str
    source_topic: str
    results_topic: str
    dlq_topic: str
    audit_topic: str
    group: str


def make_names(token: str) -> Names:
    return Names(
        source_bucket=f"b-{token}-src",
        output_bucket=f"b-{token}-out",
        source_topic=f"t-{token}-events",
        results_topic=f"t-{token}-results",
        dlq_topic=f"t-{token}-dlq",
        audit_topic=f"t-{token}-audit",
        group=f"g-{token}",
    )


def prepare(stack: Stack, names: Names, partitions: int = 1) -> None:
    stack.s3.create_bucket(names.source_bucket)
    stack.s3.create_bucket(names.output_bucket)
    create_topics(stack.kafka.bootstrap, [names.source_topic], partitions=partitions)
    create_topics(stack.kafka.bootstrap, [names.results_topic, names.dlq_topic, names.audit_topic])


def worker_environment(stack: Stack, names: Names, **overrides: str) -> dict[str, str]:
    """The environment of a test worker: this stack, these names, small parts, fast retries."""
    env = {
        **stack.endpoints.environment(),
        "DICOM_INGEST_OUTPUT_URL": f"s3://{names.output_bucket}/out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(AUDIT_KEY).decode(),
        "DICOM_INGEST_SOURCE_TOPIC": names.source_topic,
        "DICOM_INGEST_RESULTS_TOPIC": names.results_topic,
        "DICOM_INGEST_DLQ_TOPIC": names.dlq_topic,
        "DICOM_INGEST_AUDIT_TOPIC": names.audit_topic,
        "DICOM_INGEST_GROUP_ID": names.group,
        "DICOM_INGEST_DEVICE": "cpu",
        "DICOM_INGEST_SESSION_TIMEOUT_MS": "2000",
        "DICOM_INGEST_HEARTBEAT_INTERVAL_MS": "200",
        "DICOM_INGEST_PART_SIZE": str(64 * 1024),
        "DICOM_INGEST_RING_SLOTS": "16",
        "DICOM_INGEST_MAX_ATTEMPTS": "3",
        "DICOM_INGEST_RETRY_MAX_WAIT_S": "0.2",
    }
    env.update({f"DICOM_INGEST_{k.upper()}": v for k, v in overrides.items()})
    return env


def make_settings(stack: Stack, names: Names, **overrides: str) -> Settings:
    return load_settings(worker_environment(stack, names, **overrides))


async def committed_offset(stack: Stack, group: str, topic: str) -> int:
    """The group's committed offset on partition 0 of ``topic`` (0 when none)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.kafka.bootstrap, group_id=group)
    await consumer.start()
    try:
        return int(await consumer.committed(TopicPartition(topic, 0)) or 0)
    finally:
        await consumer.stop()


async def settled_committed_offset(stack: Stack, group: str, topic: str) -> int:
    """The committed offset once two reads half a second apart agree.

    A worker stopped by cancellation (a crash in the tests' terms) may leave a
    commit request on the wire that the broker applies after the worker is
    gone; reading once right away can see the offset before it.
    """
    last = await committed_offset(stack, group, topic)
    while True:
        await anyio.sleep(0.5)
        now = await committed_offset(stack, group, topic)
        if now == last:
            return now
        last = now


def s3_client(stack: Stack) -> Any:
    creds = stack.endpoints.credentials
    return get_session().create_client(
        "s3",
        endpoint_url=stack.s3.endpoint_url,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        region_name=creds.region,
    )


async def upload(stack: Stack, bucket: str, objects: Iterable[tuple[str, bytes]]) -> None:
    async with s3_client(stack) as s3:
        for key, body in objects:
            await s3.put_object(Bucket=bucket, Key=key, Body=body)


async def get_object(stack: Stack, bucket: str, key: str) -> bytes:
    async with s3_client(stack) as s3:
        resp = await s3.get_object(Bucket=bucket, Key=key)
        async with resp["Body"] as body:
            data: bytes = await body.read()
            return data


def load_npy(data: bytes) -> np.ndarray:
    array: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
    return array


def aws_notification(bucket: str, keys: Iterable[str], sizes: Mapping[str, int] = {}) -> bytes:
    """An S3 event with a record per key; ``size`` only for the keys in ``sizes``."""
    records = [
        {
            "eventVersion": "2.1",
            "eventSource": "aws:s3",
            "eventName": "ObjectCreated:Put",
            "eventTime": "2026-11-21T00:00:00.000Z",
            "s3": {
                "bucket": {"name": bucket},
                "object": {"key": quote_plus(key)} | ({"size": sizes[key]} if key in sizes else {}),
            },
        }
        for key in keys
    ]
    return json.dumps({"Records": records}).encode()


async def publish(stack: Stack, topic: str, messages: Iterable[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        for message in messages:
            await producer.send_and_wait(topic, message)
    finally:
        await producer.stop()


async def read_json_topic(stack: Stack, topic: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in await read_topic(stack.kafka.bootstrap, topic)]


@dataclass(slots=True)
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    ring: RingStats | None = None  # the ring's counters when the last outcome came
    device: dict[str, int | float] | None = None  # the device thread's, at the same time


async def run_worker(settings: Settings, stop_after: int, *, graceful: bool = True) -> Run:
    """Run a worker until ``stop_after`` outcomes, then stop it (gracefully, or by cancelling).

    The caller bounds the time (the tests' per-test timeout, or ``anyio.fail_after``).
    """
    run = Run()
    worker: Worker
    done = anyio.Event()

    def on_outcome(outcome: Outcome) -> None:
        run.outcomes.append(outcome)
        if len(run.outcomes) >= stop_after:
            run.ring = worker._ctx.ring.stats() if worker._ctx else None
            run.device = worker._ctx.device.thread.stats() if worker._ctx else None
            done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await done.wait()
        if graceful:
            worker.stop()
        else:
            group.cancel_scope.cancel()  # a crash: no drain, no final commit
    return run


def keys_of(outcomes: Iterable[Outcome]) -> list[str]:
    return [o.ref.key for o in outcomes if o.ref is not None]


def by_key(documents: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {d["source"]["key"]: d for d in documents}


def load_json(data: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(data)
    return document


def md5(data: bytes) -> str:
    """The ETag S3 gives an object uploaded in one PUT."""
    return hashlib.md5(data).hexdigest()


def accepts_tcp(address: str) -> bool:
    """Whether ``host:port`` accepts a TCP connection (a server up, whatever it speaks)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crc64nvme(data: bytes) -> str:
    """The whole object's CRC64NVME in one call, as S3 shows it (base64, big-endian)."""
    return base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode()


async def read_topic_raw(stack: Stack, topic: str) -> list[bytes]:
    return await read_topic(stack.kafka.bootstrap, topic)


RSS_HEADROOM = 200 * 1024 * 1024  # what a worker may hold beyond its ring on bad input


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise LookupError(name)


class PeakRss:
    """Peak RSS growth of this process (the worker runs in it) over a block, in bytes.

    Resets the kernel's high-water mark (``/proc/self/clear_refs``) when it may,
    else compares ``ru_maxrss`` before and after (a lower bound then).
    """

    def __init__(self) -> None:
        self.growth = 0
        self._base = 0
        self._reset = False

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset = True
            self._base = _status_kib("VmRSS") * 1024
        except OSError:
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._reset:
            peak = _status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.growth = max(0, peak - self._base)


def corpus() -> dict[str, bytes]:
    """Objects covering both read paths (one GET; header + chunked Pixel Data at 64 KiB parts)."""
    objects = {
        "pydicom/CT_small.dcm": example_bytes("CT_small.dcm"),
        "pydicom/MR_small.dcm": example_bytes("MR_small.dcm"),
        "pydicom/rtdose.dcm": example_bytes("rtdose.dcm"),  # multi-frame, 32-bit
        "pydicom/SC_rgb_small_odd.dcm": example_bytes("SC_rgb_small_odd.dcm"),
        "pydicom/examples_rgb_color.dcm": example_bytes("examples_rgb_color.dcm"),
        "dir with space/multi+frame é.dcm": synthetic_multiframe(12, 128, 96),
        "signed/mf.dcm": synthetic_multiframe(5, 64, 64, bits_allocated=16, signed=True),
        "rgb/planar.dcm": synthetic_rgb(3, 64, 80, planar=True),
        "rgb/interleaved.dcm": synthetic_rgb(2, 33, 17, planar=False),
        # Encapsulated Uncompressed (a frame a fragment): ranged whole frames, a frame
        # larger than a part (split inside its fragment), and one GET with odd frames
        "slide/tiles.dcm": synthetic_rgb(12, 48, 40, encapsulated="basic"),
        "slide/extended-table.dcm": synthetic_multiframe(9, 96, 80, encapsulated="extended"),
        "slide/frames-over-a-part.dcm": synthetic_multiframe(3, 200, 180, encapsulated="none"),
        "slide/odd-8-bit.dcm": synthetic_multiframe(
            5, 15, 13, bits_allocated=8, encapsulated="basic"
        ),
    }
    for key, data in synthetic_ct_series(3, rows=128, columns=128):
        objects[f"ct/{key}"] = data
    return objects
