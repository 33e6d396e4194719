"""How long does a record wait in the embedded Tansu for consumers that poll with a fetch wait?

A diagnostic, not a test (pytest does not collect it)::

    python -m ingest.bench.diagnostics.broker_fetch_wait [RATE] [SECONDS] [WAIT_MS] [PER] [N ...]

For each N (default 1 4 8 16) it starts Tansu, creates a topic of N x PER
partitions (PER default 4, as the scaled bench's source topics), and runs N
consumers (PER partitions each, each with its own connection and
``fetch_max_wait_ms=WAIT_MS``, default 50: the worker's default) while one
producer writes RATE records a second (default 400), round robin over the
partitions, for SECONDS (default 5). It prints the records' latency from
send to receipt. Were the broker to serve waiting fetches one at a time, the
latency would grow with N.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ingest.bench.measure import percentile
from ingest.embedded.stack import create_topics, start_tansu

TOPIC = "fetch-wait"


async def consume(
    bootstrap: str, partitions: range, wait_ms: int, latencies: list[float], stop: asyncio.Event
) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=wait_ms
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(TOPIC, p) for p in partitions])
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            now = time.time()
            for records in batches.values():
                latencies.extend(now - float(r.value or b"0") for r in records)
    finally:
        await consumer.stop()


async def one_run(
    bootstrap: str, n: int, per: int, rate: float, seconds: float, wait_ms: int
) -> str:
    latencies: list[float] = []
    stop = asyncio.Event()
    consumers = [
        asyncio.create_task(
            consume(bootstrap, range(c * per, (c + 1) * per), wait_ms, latencies, stop)
        )
        for c in range(n)
    ]
    await asyncio.sleep(2.0)  # every consumer is polling
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    sent = 0
    try:
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            due = int(elapsed * rate)
            while sent < due:
                await producer.send(TOPIC, str(time.time()).encode(), partition=sent % (n * per))
                sent += 1
            await asyncio.sleep(0.001)
        await producer.flush()
    finally:
        await producer.stop()
    await asyncio.sleep(2.0)  # the last records arrive
    stop.set()
    await asyncio.gather(*consumers)
    if not latencies:
        return f"N={n:2}: nothing received of {sent}"
    ms = sorted(x * 1000 for x in latencies)
    p99 = percentile(ms, 99)
    return (
        f"N={n:2}: {len(ms)}/{sent} received; latency p50 {statistics.median(ms):7.1f} ms, "
        f"p99 {p99:7.1f} ms, max {ms[-1]:7.1f} ms"
    )


def main() -> None:
    args = sys.argv[1:]
    rate = float(args[0]) if args else 400.0
    seconds = float(args[1]) if len(args) > 1 else 5.0
    wait_ms = int(args[2]) if len(args) > 2 else 50
    per = int(args[3]) if len(args) > 3 else 4
    counts = [int(a) for a in args[4:]] or [1, 4, 8, 16]
    print(
        f"{rate:.0f} records/s for {seconds:.0f} s, fetch_max_wait_ms={wait_ms}, {per} per consumer"
    )
    for n in counts:
        with start_tansu() as kafka:
            create_topics(kafka.bootstrap, [TOPIC], partitions=n * per)
            result = asyncio.run(one_run(kafka.bootstrap, n, per, rate, seconds, wait_ms))
            print(result, flush=True)


if __name__ == "__main__":
    main()
