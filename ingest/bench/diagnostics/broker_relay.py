"""Do records relayed by many producers reach one consumer while a paced publisher runs?

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.broker_relay [RATE] [SECONDS] [W ...]

The scaled bench's topology without DICOM: in one event loop a publisher
writes RATE records a second (default 1000) for SECONDS (default 5), round
robin over a source topic of 4 x W partitions, and one consumer reads a
results topic of as many partitions with ``fetch_max_wait_ms=10``; W relay
processes (default 8 12 16, as the workers are processes), each with a
consumer (4 source partitions, ``fetch_max_wait_ms=50``) and a producer,
write every record they read to the results topic under its key. It prints the latency from publish
to the consumer, overall and by publish time in 0.5 s windows: a consumer that
gets nothing until the publisher stops shows as latencies that fall from about
SECONDS with publish time; a flat series means this topology alone does not
hold records back.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import sys
import threading
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ingest.bench.measure import percentile
from ingest.embedded.stack import create_topics, start_tansu

PER = 4
SOURCE, RESULTS = "relay-source", "relay-results"


def relay(bootstrap: str, index: int, stop: Any) -> None:
    """One relay process (``stop``: a ``multiprocessing.Event``)."""

    async def run() -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50
        )
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
        await consumer.start()
        await producer.start()
        try:
            consumer.assign(
                [TopicPartition(SOURCE, p) for p in range(index * PER, (index + 1) * PER)]
            )
            while not stop.is_set():
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    for record in records:
                        await producer.send(RESULTS, record.value, key=record.key)
        finally:
            await producer.stop()
            await consumer.stop()

    asyncio.run(run())


async def read(
    bootstrap: str,
    partitions: int,
    arrivals: dict[bytes, float],
    stop: threading.Event,
    expected: int,
    complete: asyncio.Event,
) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(RESULTS, p) for p in range(partitions)])
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batch.values():
                arrivals.update((r.key, now) for r in records if r.key is not None)
            if len(arrivals) >= expected:
                complete.set()
    finally:
        await consumer.stop()


async def one_run(bootstrap: str, rate: float, seconds: float, relays: int) -> str:
    partitions = PER * relays
    stop = threading.Event()
    arrivals: dict[bytes, float] = {}
    sent: dict[bytes, float] = {}
    count = int(rate * seconds)
    complete = asyncio.Event()
    spawn = multiprocessing.get_context("spawn")
    stop_relays = spawn.Event()
    processes = [
        spawn.Process(target=relay, args=(bootstrap, i, stop_relays)) for i in range(relays)
    ]
    for process in processes:
        process.start()
    reader = asyncio.create_task(read(bootstrap, partitions, arrivals, stop, count, complete))
    await asyncio.sleep(5.0)  # every consumer is polling
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1)
    await producer.start()
    try:
        start = time.perf_counter()
        deliveries = []
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            key = f"k{i}".encode()
            sent[key] = time.perf_counter()
            deliveries.append(await producer.send(SOURCE, b"x", key=key, partition=i % partitions))
        for delivery in deliveries:
            await delivery
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(complete.wait(), 20.0)
    finally:
        stop.set()
        stop_relays.set()
        await producer.stop()
        await reader
        for process in processes:
            process.join()
    first = min(sent.values())
    windows: dict[int, list[float]] = {}
    for key, at in sent.items():
        if key in arrivals:
            windows.setdefault(int((at - first) / 0.5), []).append((arrivals[key] - at) * 1e3)
    ms = sorted(v for values in windows.values() for v in values)
    if not ms:
        return f"W={relays:2}: nothing received of {count}"
    p99 = percentile(ms, 99)
    series = ", ".join(
        f"{w * 0.5:.1f}s {statistics.median(v):.0f}" for w, v in sorted(windows.items())
    )
    return (
        f"W={relays:2}: {len(ms)}/{count} received; p50 {statistics.median(ms):.1f} ms, "
        f"p99 {p99:.1f} ms; p50 by publish time: {series}"
    )


def main() -> None:
    args = sys.argv[1:]
    rate = float(args[0]) if args else 1000.0
    seconds = float(args[1]) if len(args) > 1 else 5.0
    counts = [int(a) for a in args[2:]] or [8, 12, 16]
    print(f"{rate:.0f} records/s for {seconds:.0f} s")
    for relays in counts:
        with start_tansu() as kafka:
            create_topics(kafka.bootstrap, [SOURCE, RESULTS], partitions=PER * relays)
            print(asyncio.run(one_run(kafka.bootstrap, rate, seconds, relays)), flush=True)


if __name__ == "__main__":
    main()
