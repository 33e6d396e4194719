"""The scaled bench's reader of result and dead-letter records, on a thread of its own.

On the GPU machine, with 12-16 worker processes, the reader as a task in the
bench's event loop got no result record while the paced publisher ran, and
all of them once it stopped: the arrival latency by publish time fell
linearly over the pass, while the records' own timestamps said the workers
had written each within ~0.2 s (docs/benchmarks.md, round 6). Here it has a
thread and an event loop of its own; each record's arrival time is taken
there, and the record is handed to the bench's loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition

# (topic, key, value, arrival perf_counter, the record's timestamp in ms)
Deliver = Callable[[str, bytes | None, bytes, float, int], None]
POLL_MS = 100


@dataclass(slots=True)
class GapWatch:
    """Seek back over offsets the broker let a live consumer skip.

    The offsets of a topic without transactions or compaction are contiguous, so
    a record past the next expected offset means one was skipped: Tansu, with
    several producers on one partition, lets a later batch be read before an
    earlier one is visible (docs/benchmarks.md, "Skipped result records"; the
    skipped records are in the topic when it is read again). ``check`` answers
    where to seek back to; a gap still there after ``patience`` seeks is
    accepted and counted in ``given_up``.
    """

    patience: int = 200  # seeks back to one gap; each waits for a fetch (~10 ms on Tansu)
    expected: dict[Any, int] = field(default_factory=dict)  # partition -> next offset
    tries: Counter[tuple[Any, int]] = field(default_factory=Counter)
    refetched: int = 0
    given_up: int = 0

    def check(self, partition: Any, offset: int) -> int | None:
        """None: take this record. Else the offset to seek back to (drop this record and
        the rest of its batch: they come again)."""
        want = self.expected.get(partition, offset)
        if offset > want:
            self.tries[partition, want] += 1
            if self.tries[partition, want] <= self.patience:
                self.refetched += 1
                return want
            self.given_up += 1
        self.expected[partition] = offset + 1
        return None


class ResultReader:
    """Reads ``topics`` from their start on a thread; ``deliver`` runs on the caller's loop.

    An async context manager: on entry every partition is assigned and
    positioned (so nothing published after it is missed); on exit the thread
    is stopped and joined, and an error it met is raised.
    """

    def __init__(
        self, bootstrap: str, topics: Sequence[str], gaps: GapWatch, deliver: Deliver
    ) -> None:
        self._bootstrap = bootstrap
        self._topics = tuple(topics)
        self._gaps = gaps
        self._deliver = deliver
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="bench-results", daemon=True)

    async def __aenter__(self) -> ResultReader:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        await anyio.to_thread.run_sync(self._ready.wait)
        if self._error is not None:
            await anyio.to_thread.run_sync(self._thread.join)
            raise self._error
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        await anyio.to_thread.run_sync(self._thread.join)
        if self._error is not None and exc is None:
            raise self._error

    def raise_if_failed(self) -> None:
        """Raise what stopped the reader's thread, if it stopped (polled by the passes)."""
        if self._error is not None:
            raise RuntimeError(f"the results reader failed: {self._error!r}") from self._error

    def _main(self) -> None:
        try:
            asyncio.run(self._read())
        except BaseException as exc:  # handed to the bench's loop, raised there
            self._error = exc
        finally:
            self._ready.set()

    async def _read(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
        )
        await consumer.start()
        try:
            await consumer.topics()  # metadata for partitions_for_topic
            parts = [
                TopicPartition(topic, p)
                for topic in self._topics
                for p in sorted(consumer.partitions_for_topic(topic) or {0})
            ]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)  # fresh topics: nothing before this run
            self._gaps.expected = dict.fromkeys(parts, 0)
            self._ready.set()
            while not self._stop.is_set():
                batch = await consumer.getmany(timeout_ms=POLL_MS)
                now = time.perf_counter()
                for tp, records in batch.items():
                    for record in records:
                        back = self._gaps.check(tp, record.offset)
                        if back is not None:  # arrivals are then seen late, never early
                            consumer.seek(tp, back)
                            break
                        self._hand_over(tp.topic, record, now)
        finally:
            await consumer.stop()

    def _hand_over(self, topic: str, record: Any, now: float) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(
            self._deliver, topic, record.key, record.value, now, record.timestamp
        )
