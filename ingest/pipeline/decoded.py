"""An object whose Pixel Data is decoded before the device: compressed, big endian,
palette or YBR colour, 1-bit, or with a Modality LUT Sequence.

An object that fit its first GET (``decode_whole``): its frames are cut out of the
slot (``generate_frames``: the Basic or Extended Offset Table, or the fragments). A
larger encapsulated one (``streamed.decode_streamed``): its Pixel Data is read in
ranges, in order, each range's complete frames split out as it arrives. Frames go
in groups, several at once, to the device's decoder (``device_codecs``) or the
decoding processes, then as one chunk each through the device stage (rescale,
window, cast) to the output writer, in frame order, while later groups are read.

Memory: the ring's slots, one frame being split, and at most one more group than
there are decoding processes, each of at most ``GROUP_BYTES`` of decoded values and
of their output (one frame when a frame is larger). When the device decodes, a group
holds ``DEVICE_GROUP_BYTES`` of output where results come back to host memory, else
of decoded values, which are then in device memory only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import anyio
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup
from pydicom.encaps import generate_frames

from ingest.dicom.codec_read import syntax_name
from ingest.dicom.device_codecs import device_colour
from ingest.dicom.header import DicomHeader
from ingest.dicom.syntaxes import EXPLICIT_VR_BE, is_compressed
from ingest.errors import IngestError, LimitExceeded, MalformedDicom, ProcessingError
from ingest.fetch.digest import SourceDigest
from ingest.fetch.planning import split_range
from ingest.pipeline.jobs import (
    Context,
    Located,
    Target,
    decoded_job,
    encoded_job,
    object_reads,
)
from ingest.sink.output import output_dtype
from ingest_gpu.decode import DeviceDecodeError, Parsed
from ingest_gpu.thread import ChunkResult

# A group of frames: one decode task and one device chunk. Its decoded values and its
# output (float32: four times 8-bit values) each stay within this.
GROUP_BYTES = 8 * 1024 * 1024
# A group the device decodes: its decoded values live in device memory, not here, and
# so does its output when no result comes back to the host (a hook without the sink).
DEVICE_GROUP_BYTES = 16 * 1024 * 1024
# Frames decode whole: one larger than these bounds is refused rather than held.
MAX_DECODED_FRAME_BYTES = 256 * 1024 * 1024
MAX_FRAME_GROWTH = 4  # a compressed frame may span this many parts


def frames_per_group(
    header: DicomHeader, out_itemsize: int = 4, device: bool = False, host_output: bool = True
) -> int:
    """Frames a group holds: its decoded values and its output within ``GROUP_BYTES``;
    when the device decodes them, their output (``host_output``) or else their decoded
    values within ``DEVICE_GROUP_BYTES``."""
    out_frame = header.pixel.frame_elements * out_itemsize
    if device:
        held = max(header.pixel.frame_bytes, out_frame) if host_output else header.pixel.frame_bytes
        return max(1, DEVICE_GROUP_BYTES // held)
    return max(1, GROUP_BYTES // max(header.pixel.frame_bytes, out_frame))


def frame_groups(
    header: DicomHeader, out_itemsize: int = 4, device: bool = False, host_output: bool = True
) -> list[range]:
    """Consecutive frames in groups of ``frames_per_group``."""
    per = frames_per_group(header, out_itemsize, device, host_output)
    frames = header.pixel.frames
    return [range(first, min(first + per, frames)) for first in range(0, frames, per)]


Frame = bytes | memoryview  # a codestream; a view of the ring slot it was read into


def compressed_frames(header: DicomHeader, value: memoryview) -> list[bytes]:
    """Each frame's codestream (its fragments joined) from the whole Pixel Data value of
    an object that fit its first GET, once its frames are known to decode whole
    (``check_frame_size``).

    Raises:
        LimitExceeded: a decoded frame would be larger than ``MAX_DECODED_FRAME_BYTES``.
        MalformedDicom: the offset tables or fragments disagree with the frame count.
    """
    check_frame_size(header)
    frames = header.pixel.frames
    if frames == 1:
        return [single_frame(value, header.transfer_syntax_uid)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydicom warns, then guesses: we check the count
            found = list(
                generate_frames(
                    bytes(value), number_of_frames=frames, extended_offsets=header.offset_table
                )
            )
    except Exception as exc:
        raise MalformedDicom(
            f"the fragments of {header.transfer_syntax_uid} Pixel Data cannot be split into"
            f" {frames} frames ({type(exc).__name__})"
        ) from exc
    if len(found) != frames:
        raise MalformedDicom(
            f"{len(found)} frames in the fragments of {header.transfer_syntax_uid} Pixel Data,"
            f" but Number of Frames is {frames}"
        )
    return found


_ITEM: Final = struct.Struct("<HHI")


def single_frame(value: memoryview, syntax: str | None) -> bytes:
    """The codestream of a one-frame object: every fragment after the Basic Offset Table
    item, joined (what pydicom's ``generate_frames`` gives for one frame, without reading
    the value item by item in Python objects: most of an archive is single-frame).

    Raises:
        MalformedDicom: an item that is not one, or runs past the value; no fragment.
    """
    pieces: list[memoryview] = []
    at, end, table = 0, len(value), True
    while at + 8 <= end:
        group, element, length = _ITEM.unpack_from(value, at)
        if (group, element) == (0xFFFE, 0xE0DD):  # the Sequence Delimitation Item
            break
        if (group, element) != (0xFFFE, 0xE000) or at + 8 + length > end:
            raise MalformedDicom(
                f"the fragments of {syntax} Pixel Data cannot be split into 1 frame"
                f" (an item at byte {at} is not one, or runs past the value)"
            )
        if not table:
            pieces.append(value[at + 8 : at + 8 + length])
        table, at = False, at + 8 + length
    if not pieces:
        raise MalformedDicom(f"no fragment in the {syntax} Pixel Data of one frame")
    return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)


Decode = Callable[[], Awaitable[npt.NDArray[np.generic]]]  # one group's decode on the CPU
Step = Callable[[], Awaitable[ChunkResult]]  # one group decoded and preprocessed
Write = Callable[[npt.NDArray[np.generic] | None], Awaitable[None]]


Emit = Callable[[range, Step], Awaitable[None]]  # hands a group's step on, in order


def cpu_step(
    ctx: Context, target: Target, header: DicomHeader, group: range, decode: Decode
) -> Step:
    """Decode a group on the CPU (``decode``), then preprocess it on the device stage."""

    async def step() -> ChunkResult:
        array = np.ascontiguousarray(await decode())
        first = group.start * header.pixel.frame_elements
        return await ctx.device.process(decoded_job(ctx, target, header, array, first))

    return step


Hold = Callable[[], Callable[[], None]]  # keeps a group's frames; returns what lets them go


def compressed_step(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    group: range,
    frames: Sequence[Frame],
    parsed: Sequence[Parsed | DeviceDecodeError] | None = None,
    hold: Hold | None = None,
) -> Step:
    """A group of codestreams: decoded on the device where it decodes them
    (``device_codecs``), else, or when the device refuses them, on the CPU.

    ``parsed``: the frames' codestreams as the splitting thread parsed them
    (``ingest_gpu.decode.parse_each``); a group with a frame refused there goes to the CPU,
    and without them the device thread parses. ``hold``, for frames that are views of
    ring slots, keeps them for the device job (the step's caller keeps them while the
    step runs) and gives the release that the job's ``on_consumed`` calls.
    """
    codec = header.codec
    assert codec is not None

    async def decode() -> npt.NDArray[np.generic]:  # the processes take bytes
        return await ctx.decoders.encapsulated(codec, [bytes(frame) for frame in frames])

    on_cpu = cpu_step(ctx, target, header, group, decode)
    if not decodes_on_device(ctx, header):
        return on_cpu
    ready: tuple[Parsed, ...] | None = None
    if parsed is not None:
        if any(isinstance(p, DeviceDecodeError) for p in parsed):
            return on_cpu  # the CPU decodes it, or names what is wrong with it
        ready = tuple(p for p in parsed if not isinstance(p, DeviceDecodeError))

    async def on_device() -> ChunkResult:
        job = encoded_job(ctx, target, header, frames, group.start)
        assert job.encoded is not None
        if ready is not None:
            job = dataclasses.replace(job, encoded=dataclasses.replace(job.encoded, parsed=ready))
        if hold is not None:
            job = dataclasses.replace(job, on_consumed=hold())
        try:
            return await ctx.device.process(job)
        except ProcessingError as exc:
            if not isinstance(exc.__cause__, DeviceDecodeError):
                raise
        return await on_cpu()  # the CPU decodes it, or names what is wrong with it

    return on_device


async def decode_whole(
    ctx: Context, target: Target, header: DicomHeader, value: memoryview, write: Write
) -> None:
    """Decode, preprocess and write every frame of an object whose whole stored Pixel
    Data value is ``value``; ``write`` takes each chunk's host result in frame order.

    Raises:
        IngestError: a frame that cannot be decoded, fragments that disagree with the
            header, a device or sink failure.
    """
    codec = header.codec
    assert codec is not None
    if is_compressed(codec.transfer_syntax_uid):
        frames = compressed_frames(header, value)

        def step(group: range) -> Step:
            return compressed_step(ctx, target, header, group, frames[group.start : group.stop])

    else:
        check_frame_size(header)
        stored = bytes(value)

        def step(group: range) -> Step:
            decode = functools.partial(ctx.decoders.native, codec, stored, group.start, len(group))
            return cpu_step(ctx, target, header, group, decode)

    async def produce(emit: Emit) -> None:
        device = decodes_on_device(ctx, header)
        for group in frame_groups(header, out_itemsize(ctx, header), device, results_to_host(ctx)):
            await emit(group, step(group))

    await decode_in_order(ctx, target, header, produce, write)


async def decode_streamed_native(
    ctx: Context, obj: Located, header: DicomHeader, hasher: SourceDigest, write: Write
) -> None:
    """Decode, preprocess and write the frames of a large native object that needs its
    values converted (big endian, palette, YBR, 1-bit, a Modality LUT Sequence): the
    object is read in ranges from its Pixel Data on, in order (the rest for the hash),
    and its frames are cut out in groups as the bytes arrive.

    Raises:
        LimitExceeded: frames that do not start on a byte (1-bit frames of a size not a
            multiple of 8, odd 8-bit big endian OW frames).
        IngestError: a read, a decode, the device or ``write``.
    """
    codec = header.codec
    assert codec is not None
    bits = codec.rows * codec.columns * codec.samples_per_pixel * codec.bits_allocated
    if codec.photometric_interpretation == "YBR_FULL_422":
        bits = bits * 2 // 3
    swapped = codec.transfer_syntax_uid == EXPLICIT_VR_BE and codec.pixel_vr == "OW"
    if bits % 8 or (swapped and codec.bits_allocated == 8 and bits % 16):
        raise LimitExceeded(
            "frames that do not start on a byte (or a word, 8-bit big endian OW) are decoded"
            " only from objects that fit one part (DICOM_INGEST_PART_SIZE)"
        )
    check_frame_size(header)
    frame_len, part_size = bits // 8, ctx.settings.part_size
    frames, start = header.pixel.frames, header.pixel_offset
    per = frames_per_group(header, out_itemsize(ctx, header))
    end = start + frames * frame_len
    ranges = split_range(start, end, part_size) + split_range(end, obj.head.size, part_size)

    async def produce(emit: Emit) -> None:
        buffer = bytearray()  # frames read but not yet grouped: at most a group and a part
        first = 0
        async with object_reads(ctx, obj, ranges, hasher) as reads:
            index = 0
            async for slot, view in reads:
                try:
                    if hasher.in_order:
                        await anyio.to_thread.run_sync(hasher.update, ranges[index].start, view)
                    if ranges[index].start < end:
                        buffer += view
                finally:
                    slot.release()
                index += 1
                while first < frames and len(buffer) >= min(per, frames - first) * frame_len:
                    count = min(per, frames - first)
                    data = bytes(buffer[: count * frame_len])
                    del buffer[: count * frame_len]
                    decode = functools.partial(ctx.decoders.native, codec, data, 0, count)
                    group = range(first, first + count)
                    await emit(group, cpu_step(ctx, obj.target, header, group, decode))
                    first += count

    await decode_in_order(ctx, obj.target, header, produce, write)


async def decode_in_order(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    produce: Callable[[Emit], Awaitable[None]],
    write: Write,
) -> None:
    """Start each group's step (decode and device) as ``produce`` emits it, one more at a
    time than there are decoding processes; take the results to ``write`` in frame order.

    Raises:
        IngestError: from ``produce``, a decode, the device or ``write``.
    """
    limiter = anyio.Semaphore(ctx.decoders.processes + 1)
    send, receive = anyio.create_memory_object_stream[tuple[range, _Pending]](math.inf)

    async def run_producer(tg: TaskGroup) -> None:
        async def emit(group: range, step: Step) -> None:
            await limiter.acquire()
            pending = _Pending()
            tg.start_soon(pending.run, step)
            await send.send((group, pending))

        async with send:
            await produce(emit)

    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_producer, tg)
            try:
                async with receive:
                    async for _, pending in receive:
                        result = await pending.result()
                        limiter.release()
                        await write(result.host)
            except Exception as exc:  # this task's error leaves as it is, not grouped
                failure = exc
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as grouped:  # the reads' or the splitter's, alone
        only = grouped.exceptions[0] if len(grouped.exceptions) == 1 else None
        if isinstance(only, Exception):
            raise only from None
        raise
    if failure is not None:
        raise failure


def named(header: DicomHeader, step: Callable[..., list[Frame]], *args: object) -> list[Frame]:
    """``step(*args)``; its ``MalformedDicom`` or ``LimitExceeded`` names the syntax first."""
    try:
        return step(*args)
    except (MalformedDicom, LimitExceeded) as exc:
        raise type(exc)(f"{syntax_name(header.transfer_syntax_uid)}: {exc}") from exc


def decodes_on_device(ctx: Context, header: DicomHeader) -> bool:
    """The device decodes this object's frames (``device_codecs``)."""
    codec = header.codec
    return ctx.device.decodes and codec is not None and device_colour(codec) is not None


def out_itemsize(ctx: Context, header: DicomHeader) -> int:
    return np.dtype(output_dtype(ctx.settings, header)).itemsize


def results_to_host(ctx: Context) -> bool:
    """Chunk results come back to host memory (the sink writes them)."""
    return ctx.settings.sink != "none"


def check_frame_size(header: DicomHeader) -> None:
    """Frames decode whole: one larger than ``MAX_DECODED_FRAME_BYTES`` is refused.

    Raises:
        LimitExceeded: it is larger.
    """
    if header.pixel.frame_bytes > MAX_DECODED_FRAME_BYTES:
        raise LimitExceeded(
            f"{syntax_name(header.transfer_syntax_uid)}: a decoded frame of"
            f" {header.pixel.frame_bytes} bytes exceeds {MAX_DECODED_FRAME_BYTES}"
            " (frames decode whole)"
        )


class _Pending:
    """One group's step, started in the task group, its result taken in order."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: ChunkResult | IngestError | None = None

    async def run(self, step: Step) -> None:
        try:
            self._value = await step()
        except IngestError as exc:
            self._value = exc
        finally:
            self._done.set()

    async def result(self) -> ChunkResult:
        await self._done.wait()
        value = self._value
        if isinstance(value, IngestError):
            raise value
        assert value is not None
        return value
