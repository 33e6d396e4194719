"""How long does one notification take through the embedded Tansu when it follows the last?

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.broker_pingpong [WAIT_MS] [DELAY_MS ...]

One consumer (4 partitions, ``fetch_max_wait_ms=WAIT_MS``, default 50: the
worker's default) and one producer (``acks=all``) play ping-pong: the producer
sends a record, waits until the consumer has it, waits DELAY_MS (default 0 10
25 40 60 100 150 215: an object's processing), and sends the next; 12 records
per delay. It prints the send-to-receipt time per delay. A broker that answers a
waiting fetch as soon as a record arrives (Kafka) gives a few ms at every delay;
one that answers at the fetch's deadline gives a time that depends on where the
record falls in the consumer's fetch cycle (Tansu): the "delivery" part of a
large object's fixed cost.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ingest.embedded.stack import create_topics, start_tansu

TOPIC = "pingpong"
PARTITIONS = 4
ROUNDS = 12
DEFAULT_DELAYS = (0, 10, 25, 40, 60, 100, 150, 215)


async def play(bootstrap: str, wait_ms: int, delays: list[int]) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=wait_ms
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await consumer.start()
    await producer.start()
    consumer.assign([TopicPartition(TOPIC, p) for p in range(PARTITIONS)])
    received: asyncio.Queue[float] = asyncio.Queue()

    async def consume() -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=500)
            now = time.perf_counter()
            for records in batches.values():
                for _ in records:
                    received.put_nowait(now)

    task = asyncio.create_task(consume())
    try:
        await asyncio.sleep(1.0)  # the consumer is polling
        for delay in delays:
            ms = []
            for _ in range(ROUNDS):
                sent = time.perf_counter()
                await producer.send_and_wait(TOPIC, b"x", partition=0)
                ms.append((await received.get() - sent) * 1000.0)
                await asyncio.sleep(delay / 1000.0)
            print(
                f"delay {delay:4} ms: send to receipt p50 {statistics.median(ms):6.1f} ms, "
                f"min {min(ms):6.1f}, max {max(ms):6.1f}",
                flush=True,
            )
    finally:
        task.cancel()
        await producer.stop()
        await consumer.stop()


def main() -> None:
    args = sys.argv[1:]
    wait_ms = int(args[0]) if args else 50
    delays = [int(a) for a in args[1:]] or list(DEFAULT_DELAYS)
    print(f"fetch_max_wait_ms={wait_ms}, {ROUNDS} records per delay")
    with start_tansu() as kafka:
        create_topics(kafka.bootstrap, [TOPIC], partitions=PARTITIONS)
        asyncio.run(play(kafka.bootstrap, wait_ms, delays))


if __name__ == "__main__":
    main()
