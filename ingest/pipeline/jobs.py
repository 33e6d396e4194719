"""What an object task shares between its two read paths: the services it uses
(``Context``), the object version being read (``Located``, ``Target``), how a large
object's Pixel Data goes to the device (``device_plan``, ``pixel_chunks``), the device
job for a chunk of pixels (``chunk_job``: it also hands the result to a user hook), the
timings, and the step an error of the Pixel Data belongs to (``decoding``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from ingest.device.stage import DeviceStage
from ingest.dicom.decoders import DecodePool
from ingest.dicom.device_codecs import device_colour, device_format
from ingest.dicom.fragments import ITEM_HEADER, check_items, chunk_fragments
from ingest.dicom.parse import DicomHeader
from ingest.errors import DicomError, LimitExceeded
from ingest.fetch.digest import Digests, SourceDigest
from ingest.fetch.ordered_reads import InOrder, ordered_reads
from ingest.fetch.planning import ByteRange, PixelChunk, chunk_pixels
from ingest.fetch.ring import PinnedRing, Slot
from ingest.fetch.s3 import ObjectHead
from ingest.fetch.sources import Location, Sources
from ingest.hooks import Hook, HookChunk
from ingest.settings import Settings
from ingest.sink.ngff import Origin
from ingest.sink.output import MIN_PART, OutputSink, Writer, output_dtype
from ingest.sink.records import Timings
from ingest.source.notifications import ObjectRef
from ingest_gpu.decode import EncodedFrames
from ingest_gpu.thread import ChunkJob, ChunkResult

# How a large object's Pixel Data goes to the device: chunks of how many source bytes,
# and how many of them in flight (submitted, results not yet taken). When the results
# stay on the GPU (a hook, no sink) a chunk is a whole part, and 128 MiB in flight keeps
# the GPU busy (``python -m ingest.bench.diagnostics.trace_large`` shows the waits). When
# they come back to host memory each chunk's result waits there, so chunks are smaller,
# two in flight, to keep a worker process within ring + 300 MB:
# - with the S3 sink, chunks of its 8 MiB parts, so the writer frees each result as
#   soon as its part is sent;
# - with the CPU twin and no sink, 16 MiB (float32 results are twice their int16 source).
DEVICE_WINDOW_BYTES = 128 * 1024 * 1024
HOST_CHUNK_BYTES = 16 * 1024 * 1024
HOST_WINDOW_BYTES = 32 * 1024 * 1024
SINK_CHUNK_BYTES = MIN_PART


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Inside: the Pixel Data, once its header is parsed. A DICOM error or a limit met here
    (a fragment that lies, a frame that does not decode or is too large) is the
    ``decode`` step's in the dead-letter record, not the header's (``parse``: their
    class's step); errors of other steps (a GET, the sink) keep theirs."""
    try:
        yield
    except (DicomError, LimitExceeded) as exc:
        exc.step = "decode"
        raise


@dataclass(frozen=True, slots=True)
class DevicePlan:
    chunk_bytes: int  # source bytes per chunk: one range, one slot, one device job
    window: int  # chunks of one object in flight on the device


def device_plan(settings: Settings, backend: str) -> DevicePlan:
    """Chunk size and window for this backend and sink (two chunks at least while the
    results stay on the GPU, so one chunk's copy overlaps the previous one's kernel)."""
    if settings.sink == "none" and backend == "cuda":
        return DevicePlan(settings.part_size, max(2, DEVICE_WINDOW_BYTES // settings.part_size))
    if settings.sink == "s3":
        return DevicePlan(min(settings.part_size, SINK_CHUNK_BYTES), 2)
    chunk = min(settings.part_size, HOST_CHUNK_BYTES)
    return DevicePlan(chunk, max(1, HOST_WINDOW_BYTES // chunk))


def pixel_chunks(header: DicomHeader, chunk_bytes: int) -> list[PixelChunk]:
    """The reads of ``header``'s Pixel Data in ranges of at most ``chunk_bytes``; they
    tile the object from ``pixels_start(header)`` on (the Sequence Delimiter of
    Encapsulated Uncompressed included)."""
    if header.frame_pitch:
        return chunk_fragments(header.pixel_offset - ITEM_HEADER, header.pixel, chunk_bytes)
    return chunk_pixels(header.pixel_offset, header.pixel, chunk_bytes)


def pixels_start(header: DicomHeader) -> int:
    """Where the first chunk's range starts (the bytes before it are the header's)."""
    return header.pixel_offset - (ITEM_HEADER if header.frame_pitch else 0)


@dataclass(slots=True)
class Context:
    """The shared services an object task uses."""

    settings: Settings
    source: Sources  # S3, and files under ``file_roots``
    sink: OutputSink
    ring: PinnedRing
    device: DeviceStage
    decoders: DecodePool
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


@dataclass(frozen=True, slots=True)
class Located:
    """The object version being read: its presigned URL (or file), and what the first
    read told."""

    where: Location
    ref: ObjectRef
    head: ObjectHead

    @property
    def target(self) -> Target:
        return Target(self.ref, self.head)


Done = tuple[DicomHeader, Digests, str, Timings]  # header, digests, backend, timings


def output_array(
    ctx: Context, obj: Located, npy_key: str, header: DicomHeader, dtype: str
) -> Writer:
    """The writer of the object's output values (``OutputSink.array``), told where the
    values come from: a slide may go to an OME-Zarr image (``SLIDE_LAYOUT``).

    Raises:
        LayoutRefused: a slide that cannot be one OME-Zarr array.
    """
    head = obj.head
    origin = Origin(header, obj.ref.bucket, obj.ref.key, head.version_id, head.etag, head.size)
    return ctx.sink.array(npy_key, header.pixel.shape, dtype, origin)


def chunk_job(
    ctx: Context, ref: Target, header: DicomHeader, slot: Slot, view: memoryview, chunk: PixelChunk
) -> ChunkJob:
    """The device job for ``chunk``, whose range's bytes are ``view`` (in ``slot``); it
    holds its own reference to ``slot`` until copied.

    Its result has the host values, or None when the sink is off (a hook has them).

    Raises:
        MalformedDicom: an item header the chunk must hold is not there (``check_items``).
    """
    check_items(view, chunk)
    slot.retain()
    job = _job(ctx, ref, header, chunk.samples(view), chunk.first_element, chunk.elements)
    return dataclasses.replace(job, on_consumed=slot.release_threadsafe, pitch=chunk.pitch)


def decoded_job(
    ctx: Context, ref: Target, header: DicomHeader, array: npt.NDArray[Any], first_element: int
) -> ChunkJob:
    """The device job for decoded frames (``array``, C-contiguous, in ``header.pixel``'s
    layout) starting at sample ``first_element``."""
    data = array.reshape(-1).view(np.uint8).data
    return _job(ctx, ref, header, data, first_element, array.size)


def encoded_job(
    ctx: Context,
    ref: Target,
    header: DicomHeader,
    frames: Sequence[bytes | memoryview],
    first_frame: int,
) -> ChunkJob:
    """The device job that decodes ``frames`` (codestreams, from frame ``first_frame`` on)
    on the device and preprocesses them (``ingest_gpu.decode``); the caller checked
    ``device_colour``."""
    codec = header.codec
    assert codec is not None
    colour = device_colour(codec)
    assert colour is not None
    fmt = device_format(codec)
    first = first_frame * fmt.frame_elements
    job = _job(ctx, ref, header, memoryview(b""), first, len(frames) * fmt.frame_elements)
    return dataclasses.replace(job, fmt=fmt, encoded=EncodedFrames(tuple(frames), colour))


def _job(
    ctx: Context,
    ref: Target,
    header: DicomHeader,
    pixels: memoryview,
    first_element: int,
    elements: int,
) -> ChunkJob:
    """A chunk's device job, which hands its result to the user hook when there is one."""
    dtype = output_dtype(ctx.settings, header)
    transform = header.transform(ctx.settings.window, dtype)
    on_result = None
    if ctx.hook is not None:
        hook, shape = ctx.hook, header.pixel.shape

        def on_result(result: ChunkResult) -> None:  # on the device thread
            array = result.device if result.device is not None else result.host
            hook(
                HookChunk(
                    ref.bucket,
                    ref.key,
                    ref.etag,
                    header.sop_instance_uid,
                    shape,
                    dtype,
                    first_element,
                    elements,
                    result.backend,
                    array,
                )
            )

    return ChunkJob(
        data=pixels,
        fmt=header.pixel,
        transform=transform,
        first_element=first_element,
        on_consumed=_nothing,
        keep_on_device=ctx.hook is not None,
        want_host=ctx.settings.sink != "none",
        on_result=on_result,
    )


def _nothing() -> None:
    """A decoded chunk's memory is its array's: nothing to hand back when it is copied."""


def object_reads(
    ctx: Context, obj: Located, ranges: list[ByteRange], hasher: SourceDigest
) -> AbstractAsyncContextManager[InOrder]:
    """``ordered_reads`` of this object's ``ranges``, at most ``fetch_concurrency`` at once
    across all objects (the source's GET threads), started up to twice that ahead (three
    quarters of the ring at most).

    A digest that takes ranges in any order takes each one right after its GET: the
    CRC on the GET's own thread while the bytes are still in cache, the tree hash (many
    times the CPU) in a worker thread, off the GET threads. Either way the ranges in
    flight are hashed on as many cores; the consumer gets a range once it is hashed.
    """

    async def read(byte_range: ByteRange, into: memoryview) -> None:
        if hasher.on_get_thread:
            then = functools.partial(hasher.update, byte_range.start)
            await ctx.source.read_into(obj.where, obj.head, byte_range, into, then)
            return
        await ctx.source.read_into(obj.where, obj.head, byte_range, into)
        if hasher.any_order:
            data = into[: byte_range.length]
            await anyio.to_thread.run_sync(hasher.update, byte_range.start, data)

    ahead = max(1, min(2 * ctx.settings.fetch_concurrency, ctx.ring.stats().slots * 3 // 4))
    return ordered_reads(ctx.ring, ranges, read, ahead)
