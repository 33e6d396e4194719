"""Byte ranges of one object read concurrently into ring slots, handed out in order.

``ordered_reads`` starts a read for each range as soon as a slot is free, up
to ``ahead`` ranges ahead of the consumer, and yields ``(slot, view)`` in range
order: the device stage and the hash need the chunks in order, the network
does not deliver them so. A read's error is raised when the consumer reaches
that range, not before, so the ranges before it are still processed in order.

Slots are acquired in range order, so the earliest unfinished range of every
object always holds a slot: objects cannot deadlock each other on the ring.
Each yielded slot belongs to the consumer, who must ``release`` it; slots of
reads never handed out (an error, a cancellation) are released here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ingest.fetch.planning import ByteRange
from ingest.fetch.ring import PinnedRing, Slot

ReadInto = Callable[[ByteRange, memoryview], Awaitable[None]]


@dataclass(slots=True)
class _PendingRead:
    slot: Slot
    range: ByteRange
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None
    taken: bool = False

    async def fill(self, read: ReadInto) -> None:
        try:
            await read(self.range, self.slot.view)
        except Exception as exc:  # handed to the consumer, in order, not to the task group
            self.error = exc
        finally:
            self.done.set()


class InOrder:
    """Async iterator over finished reads, in order; raises a read's error when reached."""

    def __init__(self, receive: MemoryObjectReceiveStream[_PendingRead]) -> None:
        self._receive = receive

    def __aiter__(self) -> InOrder:
        return self

    async def __anext__(self) -> tuple[Slot, memoryview]:
        try:
            read = await self._receive.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        await read.done.wait()
        if read.error is not None:
            raise read.error
        read.taken = True
        return read.slot, read.slot.view[: read.range.length]


@asynccontextmanager
async def ordered_reads(
    ring: PinnedRing, ranges: Sequence[ByteRange], read: ReadInto, ahead: int
) -> AsyncIterator[InOrder]:
    """Read ``ranges`` concurrently into slots of ``ring`` with ``read``; yield them in order.

    Reads are started up to ``ahead`` ranges ahead of the consumer (the caller
    bounds how many run at once), so one slow range at the head does not idle
    the others (``python -m ingest.bench.diagnostics.trace_large 512 cpu --zero-cost-device``
    prints the ranges in flight on average).
    """
    send, receive = anyio.create_memory_object_stream[_PendingRead](max(0, ahead - 1))
    reads: list[_PendingRead] = []

    async def start_reads() -> None:
        async with send:
            for byte_range in ranges:
                pending = _PendingRead(await ring.acquire(), byte_range)
                reads.append(pending)
                group.start_soon(pending.fill, read)
                await send.send(pending)

    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(start_reads)
            try:
                yield InOrder(receive)
            except Exception as exc:  # the consumer's error leaves as it is, not grouped
                failure = exc
            finally:
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        send.close()
        receive.close()
        for pending in reads:
            if not pending.taken:
                pending.slot.release()
