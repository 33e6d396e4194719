"""The embedded broker's proxy: what it reads of the Kafka protocol, and what it fixes.

The parsers are checked against frames that aiokafka's own protocol classes
encode (every classic version), and against flexible-version frames written
here field by field from the protocol's published schemas. The integration
tests run several producer processes into one partition of the real Tansu
behind the proxy, with a consumer reading live, and a worker whose source
topic several producers write.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
import time
import uuid
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.protocol import offset as offset_api
from aiokafka.protocol import produce as produce_api
from aiokafka.protocol.api import RequestHeader_v1
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from ingest.embedded import broker_proxy as proxy
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack, create_topics
from tests import harness

pytestmark = pytest.mark.anyio


def _batch(records: int, base_offset: int = 0) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for n in range(records):
        builder.append(n, timestamp=None, key=None, value=b"v%d" % n, headers=[])
    data = bytearray(builder.build())
    struct.pack_into(">q", data, 0, base_offset)
    return bytes(data)


def _versioned(module: object, name: str, version: int) -> Any:
    """aiokafka's schema class of one version, e.g. ``ProduceRequest_v3``."""
    return getattr(module, f"{name}_v{version}")


def _request(struct_class: type, correlation: int, *fields: object) -> bytes:
    request = struct_class(*fields)
    return bytes(RequestHeader_v1(request, correlation, "t").encode() + request.encode())


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _compact(data: bytes | None) -> bytes:
    return b"\x00" if data is None else _uvarint(len(data) + 1) + data


@pytest.mark.parametrize("version", range(3, 9))
def test_produce_requests_of_every_classic_version(version: int) -> None:
    records = _batch(3) + _batch(2)
    frame = _request(
        _versioned(produce_api, "ProduceRequest", version),
        7,
        None,
        -1,
        1000,
        [("a", [(0, records), (3, _batch(1))])],
    )
    api_key, got_version, correlation, body = proxy.request_body(frame)
    assert (api_key, got_version, correlation) == (proxy.PRODUCE, version, 7)
    produce = proxy.read_produce(version, body)
    assert produce.acks == -1
    assert produce.counts == {("a", 0): 5, ("a", 3): 1}


def test_flexible_produce_request() -> None:
    header = struct.pack(">hhih", proxy.PRODUCE, 9, 11, 1) + b"c" + b"\x00"  # no tags
    records = _batch(4)
    body = (
        _compact(b"txn")
        + struct.pack(">hi", 1, 500)
        + _uvarint(2)  # one topic
        + _compact(b"results")
        + _uvarint(2)  # one partition
        + struct.pack(">i", 2)
        + _compact(records)
        + b"\x00"  # partition tags
        + b"\x00"  # topic tags
        + b"\x00"  # body tags
    )
    api_key, version, correlation, reader = proxy.request_body(header + body)
    assert (api_key, version, correlation) == (proxy.PRODUCE, 9, 11)
    assert proxy.read_produce(version, reader) == proxy.Produce(9, 1, {("results", 2): 4})


@pytest.mark.parametrize("version", [2, 5, 8])
def test_produce_responses_give_base_offsets(version: int) -> None:
    partition: tuple[object, ...] = (0, 0, 40)
    if version >= 2:
        partition += (-1,)
    if version >= 5:
        partition += (0,)
    failed: tuple[object, ...] = (1, 6, -1, *partition[3:])
    if version >= 8:
        partition += ([], None)
        failed += ([], "not leader")
    response = _versioned(produce_api, "ProduceResponse", version)([("a", [partition, failed])], 0)
    frame = struct.pack(">i", 5) + response.encode()
    assert proxy.produce_bases(version, frame) == {("a", 0): 40}


@pytest.mark.parametrize("version", range(1, 4))  # aiokafka encodes v4's leader epoch as int64
def test_latest_is_raised_to_the_end_written(version: int) -> None:
    partitions: list[tuple[object, ...]] = [(0, -1), (1, -2), (2, -1)]
    if version >= 4:
        partitions = [(p, 0, t) for p, t in partitions]
    leading: tuple[object, ...] = (-1,) if version < 2 else (-1, 0)
    frame = _request(
        _versioned(offset_api, "OffsetRequest", version), 3, *leading, [("a", partitions)]
    )
    api_key, _, _, body = proxy.request_body(frame)
    assert api_key == proxy.LIST_OFFSETS
    asked = proxy.latest_asked(version, body)
    assert asked == {("a", 0), ("a", 2)}

    def entry(partition: int, offset: int) -> tuple[object, ...]:
        return (partition, 0, -1, offset, 0) if version >= 4 else (partition, 0, -1, offset)

    fields: tuple[object, ...] = ([("a", [entry(0, 6), entry(1, 0), entry(2, 9)])],)
    if version >= 2:
        fields = (0, *fields)
    answer = (
        struct.pack(">i", 3) + _versioned(offset_api, "OffsetResponse", version)(*fields).encode()
    )
    ends = {("a", 0): 10, ("a", 1): 50, ("a", 2): 4}
    fixed = _versioned(offset_api, "OffsetResponse", version).decode(
        proxy.correct_latest(version, answer, asked, ends)[4:]
    )
    offsets = {p[0]: p[3] for p in fixed.topics[0][1]}
    assert offsets == {0: 10, 1: 0, 2: 9}  # raised where short; never lowered; only if asked


def test_records_of_old_formats_are_not_counted() -> None:
    old = bytearray(_batch(2))
    old[16] = 1
    assert proxy.records_count(old, 0, len(old)) is None
    assert proxy.records_count(_batch(7, 100), 0, len(_batch(7))) == 7


def test_short_frames_are_protocol_errors() -> None:
    with pytest.raises(proxy.ProtocolError):
        proxy.request_body(b"\x00\x00")
    frame = _request(
        _versioned(produce_api, "ProduceRequest", 3), 1, None, 1, 1000, [("a", [(0, _batch(1))])]
    )
    _, version, _, body = proxy.request_body(frame[:20])
    with pytest.raises(proxy.ProtocolError):
        proxy.read_produce(version, body)


# ---------------------------------------------------------------------------------------
# Against the real broker


def _produce(bootstrap: str, topic: str, who: int, records: int, partition: int = 0) -> None:
    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1)
        await producer.start()
        try:
            sent = []
            for n in range(records):
                key = f"{who}-{n}".encode()
                sent.append(await producer.send(topic, key, key=key, partition=partition))
                if n % 4 == 0:
                    await asyncio.sleep(0.001)
            for delivery in sent:
                await delivery
        finally:
            await producer.stop()

    asyncio.run(run())


@pytest.fixture
def producers() -> Iterator[list[BaseProcess]]:
    started: list[BaseProcess] = []
    yield started
    for process in started:
        process.kill()
        process.join()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_live_consumer_sees_every_record_of_many_producers(
    stack: Stack, producers: list[BaseProcess]
) -> None:
    topic = f"proxy-{uuid.uuid4().hex[:8]}"
    shared = 3  # partitions, each written by two producers at once while the others are
    create_topics(stack.kafka.bootstrap, [topic], partitions=shared)
    writers, each = 6, 150
    consumer = AIOKafkaConsumer(
        bootstrap_servers=stack.kafka.bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(shared)]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        context = multiprocessing.get_context("spawn")
        for who in range(writers):
            args = (stack.kafka.bootstrap, topic, who, each, who % shared)
            producers.append(context.Process(target=_produce, args=args))
            producers[-1].start()
        seen: dict[int, list[int]] = {p: [] for p in range(shared)}
        deadline = time.monotonic() + 90
        while sum(map(len, seen.values())) < writers * each and time.monotonic() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                seen[tp.partition] += [r.offset for r in records]
        ends = await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()
    per = writers // shared * each
    for p in range(shared):
        assert sorted(seen[p]) == list(range(per)), f"the live consumer skipped records of {p}"
    # ListOffsets "latest": the end, not inside the last batch
    assert [ends[tp] for tp in partitions] == [per] * shared


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_intake_skips_no_notification_written_by_many_producers(
    stack: Stack, producers: list[BaseProcess]
) -> None:
    names = harness.make_names(f"proxy{uuid.uuid4().hex[:8]}")
    harness.prepare(stack, names, partitions=1)
    keys = [f"ct/{n:04d}.dcm" for n in range(240)]
    series = synthetic_ct_series(len(keys), rows=32, columns=32, seed=3)
    await harness.upload(stack, names.source_bucket, zip(keys, (d for _, d in series), strict=True))
    settings = harness.make_settings(stack, names)
    context = multiprocessing.get_context("spawn")
    for who in range(4):
        mine = keys[who::4]
        producers.append(
            context.Process(
                target=_publish_notifications,
                args=(stack.kafka.bootstrap, names.source_topic, names.source_bucket, mine),
            )
        )
        producers[-1].start()
    with anyio.fail_after(90):  # a skipped notification would never be processed
        run = await harness.run_worker(settings, stop_after=len(keys))
    assert sorted(harness.keys_of(run.outcomes)) == sorted(keys)


def _publish_notifications(bootstrap: str, topic: str, bucket: str, keys: list[str]) -> None:
    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1)
        await producer.start()
        try:
            for key in keys:
                await producer.send(topic, harness.aws_notification(bucket, [key]), partition=0)
                await asyncio.sleep(0.002)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(run())
