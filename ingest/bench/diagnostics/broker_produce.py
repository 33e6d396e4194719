"""What does the embedded broker's proxy cost producers? Records a second through it and
through Tansu alone.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.broker_produce [PROCESSES] [IN_FLIGHT] \
        [SECONDS] [PARTITIONS]

PROCESSES producer processes (default 8, as worker processes are), each keeping
IN_FLIGHT sends waiting (default 4; ``acks=all``, ``linger_ms=2``, as the worker's
producer) of 400-byte records, keyed at random over a topic of PARTITIONS (default 32),
for SECONDS (default 5); first through the proxy (``ingest.embedded.broker_proxy``:
one produce request in flight at a time, from all connections), then against Tansu
alone. It prints the records a second of all processes together and each process's
median and 99th percentile time for a send. A worker process sends about one result
record and one audit record an object, so the proxy's records a second bound the
objects a second of every process on the embedded stack together.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.queues import Queue

from aiokafka import AIOKafkaProducer

from ingest.bench.measure import percentile
from ingest.embedded.stack import create_topics, start_tansu

TOPIC = "produce-rate"
RECORD = b"x" * 400

Result = tuple[int, float, float]  # records sent, p50 and p99 of a send (ms)


def produce(bootstrap: str, in_flight: int, seconds: float, out: Queue[Result]) -> None:
    """One process's producer, ``in_flight`` sends waiting, for ``seconds``."""

    async def run() -> Result:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
        await producer.start()
        waits: list[float] = []
        stop = time.perf_counter() + seconds

        async def sender() -> None:
            while time.perf_counter() < stop:
                start = time.perf_counter()
                await producer.send_and_wait(TOPIC, RECORD, key=os.urandom(8))
                waits.append((time.perf_counter() - start) * 1e3)

        try:
            await asyncio.gather(*(sender() for _ in range(in_flight)))
        finally:
            await producer.stop()
        return len(waits), statistics.median(waits), percentile(waits, 99)

    out.put(asyncio.run(run()))


def one_run(proxied: bool, processes: int, in_flight: int, seconds: float, partitions: int) -> str:
    with start_tansu(proxied=proxied) as broker:
        create_topics(broker.bootstrap, [TOPIC], partitions=partitions)
        out: Queue[Result] = multiprocessing.Queue()
        workers = [
            multiprocessing.Process(
                target=produce, args=(broker.bootstrap, in_flight, seconds, out)
            )
            for _ in range(processes)
        ]
        for worker in workers:
            worker.start()
        results = [out.get() for _ in workers]
        for worker in workers:
            worker.join()
    sent = sum(r[0] for r in results)
    p50 = statistics.median(r[1] for r in results)
    p99 = max(r[2] for r in results)
    name = "through the proxy" if proxied else "Tansu alone"
    return (
        f"{name}: {processes} processes x {in_flight} in flight: {sent / seconds:,.0f} records/s;"
        f" a send p50 {p50:.1f} ms, p99 (worst process) {p99:.1f} ms"
    )


def main() -> None:
    given = [int(a) for a in sys.argv[1:5]]
    processes, in_flight, seconds, partitions = given + [8, 4, 5, 32][len(given) :]
    for proxied in (True, False):
        print(one_run(proxied, processes, in_flight, seconds, partitions), flush=True)


if __name__ == "__main__":
    main()
