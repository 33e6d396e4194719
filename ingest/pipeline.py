"""One object, end to end: HEAD, ranged reads into the ring, header, device, outputs.

``process_object`` is what an object task runs; it returns a ``Processed`` or
raises an ``IngestError``. Two paths, chosen by ``planning.first_read``:

* small (fits one part): one GET into one slot; header parse and SHA-256 run
  together in a worker thread; the Pixel Data is handed to the device straight
  from the slot.
* large: a header prefix is read (grown while the parser asks for more), then
  the Pixel Data chunks are read concurrently into slots (a window of
  ``fetch_concurrency`` per object, a global limit across objects) and consumed
  strictly in order: hashed and preprocessed at the same time, then streamed
  to the output writer. Bytes after the Pixel Data are read only for the hash.

Slots are acquired in chunk order, so the earliest unfinished chunk of every
object always holds a slot: objects cannot deadlock each other on the ring.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream

from gpu.thread import ChunkJob, ChunkResult
from ingest.device import DeviceStage
from ingest.dicom import DicomHeader, NeedMoreBytes, parse_header
from ingest.errors import LimitExceeded, MalformedDicom, NotDicom, ObjectChanged
from ingest.fetch import ObjectHead, S3Source
from ingest.hooks import Hook, HookChunk
from ingest.notifications import ObjectRef
from ingest.planning import ByteRange, PixelChunk, chunk_pixels, first_read, split_range
from ingest.ring import PinnedRing, Slot
from ingest.settings import Settings
from ingest.sink import ArrayWriter, DiscardWriter, OutputSink, output_keys

MAX_VERSION_RETRIES = 3


@dataclass(slots=True)
class Timings:
    head_s: float = 0.0
    fetch_s: float = 0.0
    parse_s: float = 0.0
    device_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class Processed:
    """What the worker needs to write the sidecar, the result event and the audit record."""

    ref: ObjectRef
    head: ObjectHead
    header: DicomHeader
    sha256: str
    backend: str
    output_key: str
    sidecar_key: str
    timings: Timings = field(default_factory=Timings)


@dataclass(slots=True)
class Context:
    """The shared services an object task uses."""

    settings: Settings
    source: S3Source
    sink: OutputSink
    ring: PinnedRing
    device: DeviceStage
    fetch_limit: anyio.CapacityLimiter
    hook: Hook | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """The object version a chunk belongs to (what a hook is told)."""

    ref: ObjectRef
    head: ObjectHead

    @property
    def bucket(self) -> str:
        return self.ref.bucket

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def etag(self) -> str:
        return self.head.etag


async def process_object(ctx: Context, ref: ObjectRef) -> Processed:
    """Process the current version of ``ref``; re-reads it if it changes under us.

    Raises:
        IngestError: any failure; ``retriable`` ones have been retried already.
    """
    for attempt in range(1, MAX_VERSION_RETRIES + 1):
        try:
            return await _process_version(ctx, ref)
        except ObjectChanged as exc:
            if ref.version_id or attempt == MAX_VERSION_RETRIES:
                exc.attempts = attempt
                raise
    raise AssertionError("unreachable")


async def _process_version(ctx: Context, ref: ObjectRef) -> Processed:
    started = time.perf_counter()
    head = await ctx.source.head(ref.bucket, ref.key, ref.version_id)
    head_s = time.perf_counter() - started
    if head.size == 0:
        raise NotDicom("the object is empty (0 bytes)")
    npy_key, json_key = output_keys(ctx.settings, ref.bucket, ref.key)
    first = first_read(head.size, ctx.settings.part_size)
    if first.length == head.size:
        done = await _small(ctx, ref, head, npy_key)
    else:
        done = await _large(ctx, ref, head, first, npy_key)
    header, digest, backend, timings = done
    timings.head_s = head_s
    timings.total_s = time.perf_counter() - started
    return Processed(ref, head, header, digest, backend, npy_key, json_key, timings)


_Done = tuple[DicomHeader, str, str, Timings]


def _parse_and_hash(data: memoryview, size: int, max_header: int) -> tuple[DicomHeader, str]:
    header = parse_header(data, size, max_header_bytes=max_header)
    if isinstance(header, NeedMoreBytes):
        raise MalformedDicom("the header does not end inside the object")
    return header, hashlib.sha256(data).hexdigest()


async def _small(ctx: Context, ref: ObjectRef, head: ObjectHead, npy_key: str) -> _Done:
    timings = Timings()
    slot = await ctx.ring.acquire()
    try:
        t = time.perf_counter()
        async with ctx.fetch_limit:
            await ctx.source.read_into(
                ref.bucket, ref.key, head, ByteRange(0, head.size), slot.view
            )
        timings.fetch_s = time.perf_counter() - t
        data = slot.view[: head.size]
        t = time.perf_counter()
        header, digest = await anyio.to_thread.run_sync(
            _parse_and_hash, data, head.size, ctx.settings.max_header_bytes
        )
        timings.parse_s = time.perf_counter() - t
        pixels = data[header.pixel_offset : header.pixel_offset + header.pixel_length]
        t = time.perf_counter()
        async with ctx.sink.array(npy_key, header.pixel.shape, ctx.settings.output_dtype) as out:
            values = await _device(ctx, Target(ref, head), header, slot, pixels, 0)
            timings.device_s = time.perf_counter() - t
            await out.write(values)
    finally:
        slot.release()
    return header, digest, ctx.device.backend, timings


async def _device(
    ctx: Context,
    ref: Target,
    header: DicomHeader,
    slot: Slot,
    pixels: memoryview,
    first_element: int,
) -> np.ndarray | None:
    """Preprocess the samples in ``pixels``; the device gets its own reference to the slot.

    Returns the host values, or None when the sink is off (a hook has the values).
    """
    slot.retain()
    transform = header.transform(ctx.settings.window, ctx.settings.output_dtype)
    on_result = None
    if ctx.hook is not None:
        hook, shape, dtype = ctx.hook, header.pixel.shape, ctx.settings.output_dtype
        elements = len(pixels) // header.pixel.itemsize

        def on_result(result: ChunkResult) -> None:  # on the device thread
            array = result.device if result.device is not None else result.host
            hook(
                HookChunk(
                    ref.bucket, ref.key, ref.etag, header.sop_instance_uid, shape, dtype,
                    first_element, elements, result.backend, array,
                )
            )  # fmt: skip

    job = ChunkJob(
        data=pixels,
        fmt=header.pixel,
        transform=transform,
        first_element=first_element,
        on_consumed=slot.release_threadsafe,
        keep_on_device=ctx.hook is not None,
        want_host=ctx.settings.sink != "none",
        on_result=on_result,
    )
    result = await ctx.device.process(job)
    return result.host


async def _read_header(
    ctx: Context, ref: ObjectRef, head: ObjectHead, first: ByteRange
) -> tuple[DicomHeader, bytearray]:
    """Read a growing prefix until the parser finds the Pixel Data element."""
    length = first.length
    while True:
        prefix = bytearray(length)
        async with ctx.fetch_limit:
            await ctx.source.read_into(
                ref.bucket, ref.key, head, ByteRange(0, length), memoryview(prefix)
            )
        parsed = await anyio.to_thread.run_sync(
            functools.partial(
                parse_header,
                memoryview(prefix),
                head.size,
                max_header_bytes=ctx.settings.max_header_bytes,
            )
        )
        if isinstance(parsed, DicomHeader):
            return parsed, prefix
        if length >= head.size:
            raise MalformedDicom("the header does not end inside the object")
        limit = ctx.settings.max_header_bytes
        next_length = min(head.size, max(parsed.at_least, min(length * 2, limit)))
        if next_length > limit:
            raise LimitExceeded(f"DICOM header larger than {ctx.settings.max_header_bytes} bytes")
        length = next_length


async def _large(
    ctx: Context, ref: ObjectRef, head: ObjectHead, first: ByteRange, npy_key: str
) -> _Done:
    timings = Timings()
    t = time.perf_counter()
    header, prefix = await _read_header(ctx, ref, head, first)
    timings.parse_s = time.perf_counter() - t
    hasher = hashlib.sha256(memoryview(prefix)[: header.pixel_offset])
    del prefix
    chunks = chunk_pixels(header.pixel_offset, header.pixel, ctx.settings.part_size)
    target = Target(ref, head)
    pixel_end = header.pixel_offset + header.pixel_length
    trailer = split_range(pixel_end, head.size, ctx.settings.part_size)
    t = time.perf_counter()
    async with (
        ctx.sink.array(npy_key, header.pixel.shape, ctx.settings.output_dtype) as out,
        _ordered_reads(ctx, ref, head, [c.range for c in chunks]) as reads,
    ):
        index = 0
        async for slot, view in reads:
            await _consume_chunk(ctx, target, header, hasher, out, chunks[index], slot, view)
            index += 1
    async with _ordered_reads(ctx, ref, head, trailer) as reads:
        async for slot, view in reads:
            try:
                await anyio.to_thread.run_sync(hasher.update, view)
            finally:
                slot.release()
    timings.device_s = time.perf_counter() - t
    return header, hasher.hexdigest(), ctx.device.backend, timings


async def _consume_chunk(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    hasher: hashlib._Hash,
    out: ArrayWriter | DiscardWriter,
    chunk: PixelChunk,
    slot: Slot,
    view: memoryview,
) -> None:
    """Hash and preprocess one chunk at the same time (both only read the slot), then write.

    ``to_thread.run_sync`` is not abandoned on cancellation, so the slot is
    released only after the hasher has finished reading it.
    """
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, hasher.update, view)
            try:
                values = await _device(ctx, target, header, slot, view, chunk.first_element)
            except Exception as exc:  # raised below as it is, not wrapped in a group
                failure = exc
    finally:
        slot.release()
    if failure is not None:
        raise failure
    await out.write(values)


@dataclass(slots=True)
class _PendingRead:
    slot: Slot
    range: ByteRange
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None
    taken: bool = False

    async def fill(self, ctx: Context, ref: ObjectRef, head: ObjectHead) -> None:
        try:
            async with ctx.fetch_limit:
                await ctx.source.read_into(ref.bucket, ref.key, head, self.range, self.slot.view)
        except Exception as exc:  # handed to the consumer, in order, not to the task group
            self.error = exc
        finally:
            self.done.set()


class _InOrder:
    """Async iterator over finished reads, in order; raises a read's error when reached."""

    def __init__(self, receive: MemoryObjectReceiveStream[_PendingRead]) -> None:
        self._receive = receive

    def __aiter__(self) -> _InOrder:
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
async def _ordered_reads(
    ctx: Context, ref: ObjectRef, head: ObjectHead, ranges: list[ByteRange]
) -> AsyncIterator[_InOrder]:
    """Read ``ranges`` concurrently into slots; yield ``(slot, view)`` in range order.

    Each yielded slot belongs to the consumer, who must ``release`` it. Slots
    of reads never handed out (an error, a cancellation) are released here.
    """
    window = max(1, min(ctx.settings.fetch_concurrency, ctx.ring.stats().slots // 2))
    send, receive = anyio.create_memory_object_stream[_PendingRead](window - 1)
    reads: list[_PendingRead] = []

    async def start_reads() -> None:
        async with send:
            for byte_range in ranges:
                read = _PendingRead(await ctx.ring.acquire(), byte_range)
                reads.append(read)
                group.start_soon(read.fill, ctx, ref, head)
                await send.send(read)

    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(start_reads)
            try:
                yield _InOrder(receive)
            except Exception as exc:  # the consumer's error leaves as it is, not grouped
                failure = exc
            finally:
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        send.close()
        receive.close()
        for read in reads:
            if not read.taken:
                read.slot.release()
