"""Does a live consumer of the embedded Tansu skip records that several producers wrote?

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.broker_skip [PRODUCERS] [RECORDS] [RUNS] [raw]

Each run starts Tansu, has PRODUCERS processes (default 16) write RECORDS
records each (default 200, ``acks=all``) to one partition at once, while one
consumer reads the partition live; then a fresh consumer reads it from the
start. It prints how many distinct records each saw, and the gaps in the
offsets the live one got. With ``raw``, Tansu runs alone, without the stack's
``ingest.embedded.broker_proxy`` (one produce in at a time), which is what lets
the live consumer skip; whether it does on a given machine depends on how many
producers write at once (docs/reliability.md has the figures of a worker run).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ingest.embedded.stack import create_topics, start_tansu

TOPIC = "skip"


def produce(bootstrap: str, who: int, records: int) -> None:
    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1)
        await producer.start()
        try:
            deliveries = []
            for n in range(records):
                key = f"{who}-{n}".encode()
                deliveries.append(await producer.send(TOPIC, key * 20, key=key, partition=0))
                if n % 3 == 0:
                    await asyncio.sleep(0.0005)
            for delivery in deliveries:
                await delivery
        finally:
            await producer.stop()

    asyncio.run(run())


async def read(bootstrap: str, expected: int, within_s: float) -> tuple[set[bytes], list[int]]:
    """Keys and offsets a consumer positioned at the start sees within ``within_s``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
    )
    await consumer.start()
    keys: set[bytes] = set()
    offsets: list[int] = []
    try:
        partition = TopicPartition(TOPIC, 0)
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        deadline = time.monotonic() + within_s
        while len(keys) < expected and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                keys.update(r.key for r in records if r.key)
                offsets.extend(r.offset for r in records)
    finally:
        await consumer.stop()
    return keys, offsets


async def one_run(bootstrap: str, producers: int, records: int) -> str:
    expected = producers * records
    workers = [
        multiprocessing.Process(target=produce, args=(bootstrap, who, records))
        for who in range(producers)
    ]
    live = asyncio.create_task(read(bootstrap, expected, 30.0))
    await asyncio.sleep(0.5)  # the live consumer is positioned first
    for worker in workers:
        worker.start()
    for worker in workers:
        await asyncio.to_thread(worker.join)
    live_keys, offsets = await live
    fresh_keys, _ = await read(bootstrap, expected, 10.0)
    gaps = sorted(set(range(max(offsets, default=-1) + 1)) - set(offsets))
    return (
        f"expected {expected}: live {len(live_keys)}, from the start {len(fresh_keys)}, "
        f"live offset gaps {gaps[:10]}{' ...' if len(gaps) > 10 else ''}"
    )


def main() -> None:
    raw = "raw" in sys.argv[1:]
    given = [int(a) for a in sys.argv[1:4] if a != "raw"]
    producers, records, runs = given + [16, 200, 3][len(given) :]
    for run in range(runs):
        with start_tansu(proxied=not raw) as broker:
            create_topics(broker.bootstrap, [TOPIC])
            print(f"run {run + 1}: {asyncio.run(one_run(broker.bootstrap, producers, records))}")


if __name__ == "__main__":
    main()
