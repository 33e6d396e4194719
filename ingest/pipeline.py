"""One object, end to end: ranged reads into the ring, header, device, outputs.

``process_object`` is what an object task runs; it returns a ``Processed`` or
raises an ``IngestError``. There is no HEAD: the first GET reads into a slot
either the whole object (when the notification's size, or nothing known,
says it fits one part) or a header probe, and its answer gives the object's
true size and ETag. Then one of two paths:

* small (the first GET held it all): header parse and SHA-256 run together
  in a worker thread; the Pixel Data is handed to the device straight from
  the slot.
* large: the header's layout is parsed from the probe (grown while the
  parser asks for more), then the Pixel Data chunks are read concurrently
  into slots and taken in order (``ordered_reads``: started up to twice
  ``fetch_concurrency`` ahead, ``fetch_concurrency`` at once across all
  objects), while per-frame rescale values are parsed; each chunk goes to the
  device as soon as it is read (``device_plan`` says how many in flight), is
  hashed in order meanwhile, and its result is streamed to the output writer
  in order. Bytes after the Pixel Data are read only for the hash.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import anyio

from gpu.thread import ChunkJob, ChunkResult
from ingest.device import DeviceStage
from ingest.dicom import DicomHeader, NeedMoreBytes, parse_header
from ingest.errors import LimitExceeded, MalformedDicom, NotDicom, ObjectChanged
from ingest.fetch import ObjectHead, Presigned, S3Source
from ingest.hooks import Hook, HookChunk
from ingest.notifications import ObjectRef
from ingest.ordered_reads import InOrder, ordered_reads
from ingest.planning import ByteRange, PixelChunk, chunk_pixels, first_read, split_range
from ingest.ring import PinnedRing, Slot
from ingest.settings import Settings
from ingest.sink import ArrayWriter, DiscardWriter, OutputSink, output_keys
from ingest.source_digest import Digests, SourceDigest

MAX_VERSION_RETRIES = 3
# How a large object's Pixel Data goes to the device: chunks of how many source bytes,
# and how many of them in flight (submitted, results not yet taken). When the results
# stay on the GPU (a hook, no sink) a chunk is a whole part, and 128 MiB in flight kept
# the H200 busy (``python -m tests.trace_large``). When they come back to host memory
# (the sink, or the CPU twin) each chunk's float32 result (twice its int16 source) waits
# there for the writer or the hook, so chunks are at most 16 MiB, two in flight: on the
# CPU machine, 32 MiB chunks put the sink-mode worker process at ring + 418 MB (two in
# flight) or + 320 MB (one); 16 MiB chunks keep it within ring + 300 MB.
DEVICE_WINDOW_BYTES = 128 * 1024 * 1024
HOST_CHUNK_BYTES = 16 * 1024 * 1024
HOST_WINDOW_BYTES = 32 * 1024 * 1024
# A header longer than the probe: the prefix grows at least this many times over per
# GET (each is a round trip before the first range; the object is larger than a part).
HEADER_GROWTH = 4


@dataclass(frozen=True, slots=True)
class DevicePlan:
    chunk_bytes: int  # source bytes per chunk: one range, one slot, one device job
    window: int  # chunks of one object in flight on the device


def device_plan(settings: Settings, backend: str) -> DevicePlan:
    """Chunk size and window for this backend and sink (two chunks at least while the
    results stay on the GPU, so one chunk's copy overlaps the previous one's kernel)."""
    if settings.sink == "none" and backend == "cuda":
        return DevicePlan(settings.part_size, max(2, DEVICE_WINDOW_BYTES // settings.part_size))
    chunk = min(settings.part_size, HOST_CHUNK_BYTES)
    return DevicePlan(chunk, max(1, HOST_WINDOW_BYTES // chunk))


@dataclass(slots=True)
class Timings:
    first_get_s: float = 0.0  # the first GET (it also tells size and ETag: no HEAD)
    parse_s: float = 0.0  # until the reads can start (a large object's layout)
    device_s: float = 0.0  # the Pixel Data's reads, device work and outputs
    total_s: float = 0.0


@dataclass(slots=True)
class Processed:
    """What the worker needs to write the sidecar, the result event and the audit record."""

    ref: ObjectRef
    head: ObjectHead
    header: DicomHeader
    digests: Digests  # of the source bytes, under ``source_hash``
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
    where = await ctx.source.locate(ref.bucket, ref.key, ref.version_id)
    expected = ref.size if ref.size else ctx.settings.part_size  # a hint; the answer decides
    first = first_read(expected, ctx.settings.part_size, ctx.settings.max_header_bytes)
    npy_key, json_key = output_keys(ctx.settings, ref.bucket, ref.key)
    slot = await ctx.ring.acquire(first.length)  # a small slot when it fits one
    parse = functools.partial(_parse_and_hash, settings=ctx.settings)
    try:
        async with ctx.fetch_limit:  # a whole object is parsed in the GET's thread
            head, filled, parsed = await ctx.source.read_first_then(
                where, slot.view[: first.length], parse
            )
        first_s = time.perf_counter() - started - (parsed.seconds if parsed else 0.0)
        if head.size == 0:
            raise NotDicom("the object is empty (0 bytes)")
        obj = Located(where, ref, head)
        small = parsed is not None  # the first GET held it all (filled == head.size)
        if parsed is not None:
            done = await _small(ctx, obj, slot, npy_key, parsed)
        else:  # the probe's slot goes back before the chunks take theirs (no deadlock)
            t = time.perf_counter()
            layout, prefix, hasher = await _read_header(ctx, obj, slot.view[:filled])
            parse_s = time.perf_counter() - t
    finally:
        slot.release()
    if not small:
        done = await _large(ctx, obj, layout, prefix, hasher, npy_key)
        done[3].parse_s = parse_s
    header, digests, backend, timings = done
    timings.first_get_s = first_s
    timings.total_s = time.perf_counter() - started
    return Processed(ref, head, header, digests, backend, npy_key, json_key, timings)


@dataclass(frozen=True, slots=True)
class Located:
    """The object version being read: its presigned URL, and what the first GET told."""

    where: Presigned
    ref: ObjectRef
    head: ObjectHead

    @property
    def target(self) -> Target:
        return Target(self.ref, self.head)


_Done = tuple[DicomHeader, Digests, str, Timings]


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A whole object's header and source digest, and the seconds they took (in a thread)."""

    header: DicomHeader
    digests: Digests
    seconds: float


def _parse_and_hash(data: memoryview, settings: Settings) -> _Parsed:
    """Parse and hash a whole object (``data`` is all of it)."""
    started = time.perf_counter()
    header = parse_header(data, len(data), max_header_bytes=settings.max_header_bytes)
    if isinstance(header, NeedMoreBytes):
        raise MalformedDicom("the header does not end inside the object")
    digests = SourceDigest(settings, len(data), data).digests()
    return _Parsed(header, digests, time.perf_counter() - started)


async def _small(ctx: Context, obj: Located, slot: Slot, npy_key: str, parsed: _Parsed) -> _Done:
    """The whole object is in ``slot`` (the caller releases it), parsed."""
    timings = Timings(parse_s=parsed.seconds)
    header, digests = parsed.header, parsed.digests
    data = slot.view[: obj.head.size]
    pixels = data[header.pixel_offset : header.pixel_offset + header.pixel_length]
    t = time.perf_counter()
    async with ctx.sink.array(npy_key, header.pixel.shape, ctx.settings.output_dtype) as out:
        result = await ctx.device.process(_job(ctx, obj.target, header, slot, pixels, 0))
        timings.device_s = time.perf_counter() - t
        await out.write(result.host)  # None when the sink is off: a hook has the values
    return header, digests, ctx.device.backend, timings


def _job(
    ctx: Context,
    ref: Target,
    header: DicomHeader,
    slot: Slot,
    pixels: memoryview,
    first_element: int,
) -> ChunkJob:
    """The device job for ``pixels``; it holds its own reference to ``slot`` until copied.

    Its result has the host values, or None when the sink is off (a hook has them).
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

    return ChunkJob(
        data=pixels,
        fmt=header.pixel,
        transform=transform,
        first_element=first_element,
        on_consumed=slot.release_threadsafe,
        keep_on_device=ctx.hook is not None,
        want_host=ctx.settings.sink != "none",
        on_result=on_result,
    )


async def _read_header(
    ctx: Context, obj: Located, probe: memoryview
) -> tuple[DicomHeader, bytes | None, SourceDigest]:
    """The header's layout from the probe (reading on, at least ``HEADER_GROWTH`` times
    the prefix per GET, while the parser asks for more), a hasher that has taken the
    bytes before the Pixel Data, and a copy of the prefix when per-frame values are
    still to be read from it (``_large`` does that while the first chunks arrive)."""
    size = obj.head.size
    prefix: memoryview | bytearray = probe
    while True:
        parsed = await anyio.to_thread.run_sync(
            functools.partial(
                parse_header, memoryview(prefix), size,
                max_header_bytes=ctx.settings.max_header_bytes, per_frame=False,
            )
        )  # fmt: skip
        if isinstance(parsed, DicomHeader):
            hasher = SourceDigest(ctx.settings, size, memoryview(prefix)[: parsed.pixel_offset])
            return parsed, bytes(prefix) if parsed.per_frame_pending else None, hasher
        length = len(prefix)
        if length >= size:
            raise MalformedDicom("the header does not end inside the object")
        limit = ctx.settings.max_header_bytes
        next_length = min(size, max(parsed.at_least, min(length * HEADER_GROWTH, limit)))
        if next_length > limit:
            raise LimitExceeded(f"DICOM header larger than {ctx.settings.max_header_bytes} bytes")
        grown = bytearray(next_length)  # only the bytes not read yet are fetched
        grown[:length] = prefix
        async with ctx.fetch_limit:
            await ctx.source.read_into(
                obj.where, obj.head, ByteRange(length, next_length), memoryview(grown)[length:]
            )
        prefix = grown


def _parse_in_full(prefix: bytes, size: int, settings: Settings) -> DicomHeader:
    """The header with its per-frame values, from the prefix its layout came from."""
    parsed = parse_header(prefix, size, max_header_bytes=settings.max_header_bytes)
    if not isinstance(parsed, DicomHeader):  # the same bytes gave a layout before
        raise MalformedDicom("the header does not end inside the prefix read for it")
    return parsed


async def _large(
    ctx: Context,
    obj: Located,
    layout: DicomHeader,
    prefix: bytes | None,
    hasher: SourceDigest,
    npy_key: str,
) -> _Done:
    """Read the Pixel Data in chunks (and the trailer, for the hash) after the header.

    The reads start from the header's layout; per-frame rescale values, when the
    object has them, are parsed from ``prefix`` meanwhile (2,048 frames: ~13 ms that
    no longer delay the first range).
    """
    timings = Timings()
    plan = device_plan(ctx.settings, ctx.device.backend)
    chunks = chunk_pixels(layout.pixel_offset, layout.pixel, plan.chunk_bytes)
    target = obj.target
    pixel_end = layout.pixel_offset + layout.pixel_length
    trailer = split_range(pixel_end, obj.head.size, ctx.settings.part_size)
    t = time.perf_counter()
    async with (
        ctx.sink.array(npy_key, layout.pixel.shape, ctx.settings.output_dtype) as out,
        _ordered_reads(ctx, obj, [c.range for c in chunks], hasher) as reads,
    ):
        header = layout
        if prefix is not None:  # counted in device_s: the first ranges arrive meanwhile
            header = await anyio.to_thread.run_sync(
                _parse_in_full, prefix, obj.head.size, ctx.settings
            )
        await _pipelined_chunks(ctx, target, header, hasher, out, chunks, reads)
    if hasher.enabled:  # the bytes after the Pixel Data matter only to the hash
        async with _ordered_reads(ctx, obj, trailer, hasher) as reads:
            index = 0
            async for slot, view in reads:
                try:
                    if hasher.in_order:
                        start = trailer[index].start
                        await anyio.to_thread.run_sync(hasher.update, start, view)
                finally:
                    slot.release()
                index += 1
    timings.device_s = time.perf_counter() - t
    return header, hasher.digests(), ctx.device.backend, timings


async def _pipelined_chunks(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    hasher: SourceDigest,
    out: ArrayWriter | DiscardWriter,
    chunks: list[PixelChunk],
    reads: InOrder,
) -> None:
    """Each chunk goes to the device as soon as it is read, up to ``device_plan``'s window
    of this object in flight, so copies and kernels of one object overlap (one chunk at a
    time left the device idle between round trips). The plain SHA-256 takes the chunks in
    order while the device works (the tree hash took them as they were read), and
    results are written in order.

    A slot is shared: the device's reference goes when its copy is done, ours when the
    chunk is hashed (``to_thread.run_sync`` is not abandoned on cancellation, so the
    hasher has finished reading it by then).
    """
    in_flight: deque[asyncio.Future[ChunkResult]] = deque()
    window = device_plan(ctx.settings, ctx.device.backend).window
    try:
        index = 0
        async for slot, view in reads:
            try:
                job = _job(ctx, target, header, slot, view, chunks[index].first_element)
                in_flight.append(await ctx.device.submit(job))
                if hasher.in_order:
                    start = chunks[index].range.start
                    await anyio.to_thread.run_sync(hasher.update, start, view)
            finally:
                slot.release()
            index += 1
            if len(in_flight) >= window:
                await out.write((await in_flight.popleft()).host)
        while in_flight:
            await out.write((await in_flight.popleft()).host)
    finally:
        for future in in_flight:  # an error or a cancellation: nobody takes these results
            future.cancel()


def _ordered_reads(
    ctx: Context, obj: Located, ranges: list[ByteRange], hasher: SourceDigest
) -> AbstractAsyncContextManager[InOrder]:
    """``ordered_reads`` of this object's ``ranges``, at most ``fetch_concurrency`` at once
    across all objects, started up to twice that ahead (three quarters of the ring at most).

    A hash that takes ranges in any order (the tree hash) takes each one in a worker
    thread right after its GET (outside the fetch permit), so the ranges in flight are
    hashed on as many cores; the consumer gets the range once it is hashed.
    """

    async def read(byte_range: ByteRange, into: memoryview) -> None:
        async with ctx.fetch_limit:
            await ctx.source.read_into(obj.where, obj.head, byte_range, into)
        if hasher.any_order:
            data = into[: byte_range.length]
            await anyio.to_thread.run_sync(hasher.update, byte_range.start, data)

    ahead = max(1, min(2 * ctx.settings.fetch_concurrency, ctx.ring.stats().slots * 3 // 4))
    return ordered_reads(ctx.ring, ranges, read, ahead)
