"""A large object (larger than its first GET): the header's layout from the probe, then
the Pixel Data read in chunks into ring slots, concurrently and taken in order
(``ordered_reads``: started up to twice ``fetch_concurrency`` ahead, read on the
source's ``fetch_concurrency`` GET threads, all objects together), while per-frame
rescale values are parsed. Each chunk goes to the device as soon as it is read
(``device_plan`` says how many in flight), is hashed meanwhile, and its result is
streamed to the output writer in order. Bytes after the Pixel Data are read only
for the hash.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque

import anyio

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.dicom.syntaxes import is_compressed
from ingest.errors import LimitExceeded, MalformedDicom
from ingest.fetch.digest import SourceDigest
from ingest.fetch.ordered_reads import InOrder
from ingest.fetch.planning import ByteRange, PixelChunk, split_range
from ingest.pipeline.decoded import decode_streamed_native
from ingest.pipeline.jobs import (
    Context,
    Done,
    Located,
    Target,
    chunk_job,
    device_plan,
    object_reads,
    output_array,
    pixel_chunks,
    pixels_start,
)
from ingest.pipeline.streamed import decode_streamed
from ingest.settings import Settings
from ingest.sink.output import Writer, output_dtype, writes_zarr
from ingest.sink.records import Timings
from ingest_gpu.thread import ChunkResult

# A header longer than the probe: the prefix grows at least this many times over per
# GET (each is a round trip before the first range; the object is larger than a part).
HEADER_GROWTH = 4


def header_or_more(
    prefix: memoryview | bytes, size: int, max_header_bytes: int
) -> DicomHeader | ByteRange:
    """The header's layout (per-frame values left for later) if ``prefix``, the first
    bytes of an object of ``size`` bytes, holds it; else the bytes to read next, from
    the prefix's end: at least ``HEADER_GROWTH`` times the prefix (each read is a round
    trip before the first range) and as much as the parser asks for, within the object
    and ``max_header_bytes``.

    Raises:
        MalformedDicom: the object ends before its header does.
        LimitExceeded: the header is longer than ``max_header_bytes``.
        DicomError: what the parser finds wrong with the prefix.
    """
    parsed = parse_header(prefix, size, max_header_bytes=max_header_bytes, per_frame=False)
    if isinstance(parsed, DicomHeader):
        return parsed
    length = len(prefix)
    if length >= size:
        raise MalformedDicom("the header does not end inside the object")
    next_length = min(size, max(parsed.at_least, min(length * HEADER_GROWTH, max_header_bytes)))
    if next_length > max_header_bytes:
        raise LimitExceeded(f"DICOM header larger than {max_header_bytes} bytes")
    return ByteRange(length, next_length)


async def read_header(
    ctx: Context, obj: Located, probe: memoryview
) -> tuple[DicomHeader, bytes | None, SourceDigest]:
    """The header's layout from the probe, reading on while it asks for more
    (``header_or_more``), a hasher that has taken the bytes before the Pixel Data, and a
    copy of the prefix when per-frame values are still to be read from it (``read_large``
    does that while the first chunks arrive).

    Raises:
        IngestError: as ``header_or_more``, or a read's.
    """
    size = obj.head.size
    prefix: memoryview | bytearray = probe
    while True:
        parsed = await anyio.to_thread.run_sync(
            header_or_more, memoryview(prefix), size, ctx.settings.max_header_bytes
        )
        if isinstance(parsed, DicomHeader):
            before = memoryview(prefix)[: pixels_start(parsed)]
            hasher = SourceDigest(ctx.settings, size, before)
            return parsed, bytes(prefix) if parsed.per_frame_pending else None, hasher
        grown = bytearray(parsed.end)  # only the bytes not read yet are fetched
        grown[: parsed.start] = prefix
        await ctx.source.read_into(obj.where, obj.head, parsed, memoryview(grown)[parsed.start :])
        prefix = grown


def _parse_in_full(
    prefix: bytes, size: int, settings: Settings, geometry: bool = True
) -> DicomHeader:
    """The header with its per-frame values, from the prefix its layout came from;
    without the frames' plane positions unless ``geometry``."""
    parsed = parse_header(
        prefix, size, max_header_bytes=settings.max_header_bytes, geometry=geometry
    )
    if not isinstance(parsed, DicomHeader):  # the same bytes gave a layout before
        raise MalformedDicom("the header does not end inside the prefix read for it")
    return parsed


class _InFull:
    """A large object's header read in full from the prefix its layout came from, in two
    steps: the per-frame rescale values, which its frames' processing needs
    (``rescaled``), then the frames' plane positions, which only its records need and
    which take several times as long for thousands of frames, read on a thread of their
    own from then on while the frames go through (``result``).
    """

    def __init__(self, prefix: bytes, size: int, settings: Settings) -> None:
        self._parse = functools.partial(_parse_in_full, prefix, size, settings)
        self._full: asyncio.Future[DicomHeader] | None = None

    async def rescaled(self) -> DicomHeader:
        """The header without the plane positions; starts reading them."""
        header = await anyio.to_thread.run_sync(self._parse, False)
        self._full = asyncio.get_running_loop().run_in_executor(None, self._parse)
        return header

    async def result(self) -> DicomHeader:
        """The header in full."""
        if self._full is None:  # the rescale values were never asked for
            return await anyio.to_thread.run_sync(self._parse)
        return await self._full

    def abandon(self) -> None:
        """Nobody waits for the plane positions any more (a failure, a cancellation):
        their thread's work, which cannot be cancelled, is dropped when it ends."""
        if self._full is not None and not self._full.done():
            self._full.add_done_callback(_ignored)


def _ignored(future: asyncio.Future[DicomHeader]) -> None:
    """Take a parse's outcome that nobody awaits."""
    if not future.cancelled():
        future.exception()


async def read_large(
    ctx: Context,
    obj: Located,
    layout: DicomHeader,
    prefix: bytes | None,
    hasher: SourceDigest,
    npy_key: str,
) -> Done:
    """Read the Pixel Data in chunks (and the trailer, for the hash) after the header.

    The reads start from the header's layout; per-frame values, when the object has
    them, are parsed from ``prefix`` meanwhile (``_InFull``), so they do not delay the
    first range, and the frames' plane positions do not delay the first chunk.
    """
    timings = Timings()
    compressed = is_compressed(layout.transfer_syntax_uid)
    if prefix is not None and (
        writes_zarr(ctx.settings, layout)
        or (layout.codec is not None and (not compressed or ctx.settings.output_dtype == "exact"))
    ):
        # a slide's image needs each frame's place (TILED_SPARSE's per-frame values) and
        # its pixel spacing before its first tile; an exact output's type, the per-frame
        # rescale values
        layout = await anyio.to_thread.run_sync(_parse_in_full, prefix, obj.head.size, ctx.settings)
        prefix = None
    if layout.codec is not None:  # encapsulated frames, decoded as their ranges arrive
        t = time.perf_counter()
        dtype = output_dtype(ctx.settings, layout)
        header = layout
        async with output_array(ctx, obj, npy_key, layout, dtype) as out:
            if not compressed:
                await decode_streamed_native(ctx, obj, layout, hasher, out.write)
            elif prefix is None:
                await decode_streamed(ctx, obj, layout, hasher, out.write)
            else:
                parse = _InFull(prefix, obj.head.size, ctx.settings)
                try:
                    await decode_streamed(ctx, obj, layout, hasher, out.write, parse.rescaled)
                    header = await parse.result()
                finally:
                    parse.abandon()
        timings.device_s = time.perf_counter() - t
        return header, hasher.digests(), ctx.device.backend, timings
    plan = device_plan(ctx.settings, ctx.device.backend)
    chunks = pixel_chunks(layout, plan.chunk_bytes)
    target = obj.target
    trailer = split_range(chunks[-1].range.end, obj.head.size, ctx.settings.part_size)
    t = time.perf_counter()
    header = layout
    if prefix is not None and ctx.settings.output_dtype == "exact":
        # the output's type depends on the per-frame rescale values: read them first
        header = await anyio.to_thread.run_sync(_parse_in_full, prefix, obj.head.size, ctx.settings)
        prefix = None
    in_full = _InFull(prefix, obj.head.size, ctx.settings) if prefix is not None else None
    try:
        async with (
            output_array(ctx, obj, npy_key, header, output_dtype(ctx.settings, header)) as out,
            object_reads(ctx, obj, [c.range for c in chunks], hasher) as reads,
        ):
            if in_full is not None:  # counted in device_s: the first ranges arrive meanwhile
                header = await in_full.rescaled()
            await _pipelined_chunks(ctx, target, header, hasher, out, chunks, reads)
        if hasher.enabled:  # the bytes after the Pixel Data matter only to the hash
            async with object_reads(ctx, obj, trailer, hasher) as reads:
                index = 0
                async for slot, view in reads:
                    try:
                        if hasher.in_order:
                            start = trailer[index].start
                            await anyio.to_thread.run_sync(hasher.update, start, view)
                    finally:
                        slot.release()
                    index += 1
        if in_full is not None:
            header = await in_full.result()
    finally:
        if in_full is not None:
            in_full.abandon()
    timings.device_s = time.perf_counter() - t
    return header, hasher.digests(), ctx.device.backend, timings


async def _pipelined_chunks(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    hasher: SourceDigest,
    out: Writer,
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
                job = chunk_job(ctx, target, header, slot, view, chunks[index])
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
