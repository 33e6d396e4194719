"""A Deflated Explicit VR Little Endian object: read in order, inflated as it arrives,
decoded in groups, in bounded memory.

``parse_header`` tells a Deflated object by its file meta (``DeflatedDataSet``).
Everything after the meta is one deflate stream, so stored offsets say nothing of
where the Pixel Data lies: the object is read from its first byte, in order:
from its first GET's slot when it fit (``inflate_whole``), or in ranges
(``inflate_ranged``: ``object_reads``, each range hashed in order as any large
object's, so the source digest is of the stored bytes). The stream is inflated a
step at a time in a worker thread (``ingest.dicom.deflate.Inflater``):

1. until the inflated data set's header parses (``inflated_header``; a header
   larger than ``max_header_bytes`` inflated is refused as any header is);
2. then its Pixel Data, native once inflated: its frames are cut into the same
   groups as every decoded object's (``frames_per_group``), each group decoded as
   pydicom decodes it (``decoders.native``), then through the device stage to the
   writer in frame order (``decode_in_order``);
3. then the rest, inflated only to check that the stream ends where the object
   does (and that the Pixel Data element fits the data set), before the output is
   completed.

Memory: the ring's slots (the reads), the header's inflated prefix (at most
``max_header_bytes``), one group being filled (``GROUP_BYTES`` and one step), the
groups ``decode_in_order`` holds (one more than there are decoding processes),
and zlib's window and one input piece. The inflated size itself never matters: a
deflate bomb costs time (at most 1,032 inflated bytes a stored byte), not memory.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

import anyio

from ingest.dicom.deflate import NAME, Inflater, frame_bits, inflated_header
from ingest.dicom.header import DicomHeader
from ingest.errors import LimitExceeded, MalformedDicom
from ingest.fetch.digest import Digests, SourceDigest
from ingest.fetch.planning import split_range
from ingest.fetch.ring import Slot
from ingest.pipeline.decoded import (
    GROUP_BYTES,
    Emit,
    Write,
    check_frame_size,
    cpu_step,
    decode_in_order,
    frames_per_group,
    out_itemsize,
)
from ingest.pipeline.jobs import (
    Context,
    Done,
    Located,
    Target,
    decoding,
    object_reads,
    output_array,
)
from ingest.sink.output import output_dtype
from ingest.sink.records import Timings

STEP = 1024 * 1024  # inflated bytes a step (one hand-off to a thread)
HEADER_FIRST = 64 * 1024  # inflated bytes the header parse is first tried on

# The stored bytes of the data set, in order; None at their end. A view stays valid
# until the next call.
NextChunk = Callable[[], Awaitable[memoryview | None]]


async def inflate_whole(
    ctx: Context,
    obj: Located,
    data: memoryview,
    data_set_offset: int,
    digests: Digests,
    npy_key: str,
) -> Done:
    """Process a Deflated object that fit its first GET: ``data`` is all of it (in a slot
    the caller holds), ``digests`` its source digest.

    Raises:
        IngestError: a corrupt or cut stream, a bad header, a decode, the device, the sink.
    """
    rest: list[memoryview] = [data[data_set_offset:]]

    async def next_chunk() -> memoryview | None:
        return rest.pop() if rest else None

    header, timings = await _inflate(ctx, obj, next_chunk, len(rest[0]), npy_key)
    return header, digests, ctx.device.backend, timings


async def inflate_ranged(
    ctx: Context, obj: Located, probe: bytes, data_set_offset: int, npy_key: str
) -> Done:
    """Process a Deflated object larger than its first GET, whose bytes were ``probe``
    (a copy): the rest is read in ranges, in order, each hashed, inflated and released.

    Raises:
        IngestError: a read, a corrupt or cut stream, a bad header, a decode, the
            device, the sink.
    """
    size = obj.head.size
    hasher = SourceDigest(ctx.settings, size, probe)
    ranges = split_range(len(probe), size, ctx.settings.part_size)
    first: list[memoryview] = [memoryview(probe)[data_set_offset:]]
    held: Slot | None = None
    async with object_reads(ctx, obj, ranges, hasher) as reads:
        index = 0

        async def next_chunk() -> memoryview | None:
            nonlocal held, index
            if held is not None:  # the inflater has used up its bytes
                held.release()
                held = None
            if first:
                return first.pop()
            read = await anext(reads, None)
            if read is None:
                return None
            held, view = read
            start = ranges[index].start
            index += 1
            if hasher.in_order:
                await anyio.to_thread.run_sync(hasher.update, start, view)
            return view[max(0, data_set_offset - start) :]  # a meta longer than the probe

        try:
            header, timings = await _inflate(ctx, obj, next_chunk, size - data_set_offset, npy_key)
        finally:
            if held is not None:
                held.release()
    return header, hasher.digests(), ctx.device.backend, timings


class _DataSet:
    """The inflated data set, read a bounded step at a time from the stored chunks."""

    def __init__(self, next_chunk: NextChunk) -> None:
        self._inflater = Inflater()
        self._next = next_chunk
        self.position = 0  # bytes of the data set read so far

    @property
    def ended(self) -> bool:
        """Whether the stream has ended: every byte of the data set has been read."""
        return self._inflater.eof and self._inflater.needs_input

    async def read(self, max_length: int) -> bytes:
        """At most ``max_length`` more bytes; ``b""`` once the data set has ended.

        Raises:
            MalformedDicom: the stream is corrupt, or the object ends inside it.
            IngestError: reading the next range.
        """
        inflater = self._inflater
        while not inflater.eof:
            if inflater.needs_input:
                chunk = await self._next()
                if chunk is None:
                    inflater.finish()  # raises: the stream has not ended
                    break
                inflater.give(chunk)
                continue
            out = await anyio.to_thread.run_sync(inflater.inflate, max_length)
            if out:
                self.position += len(out)
                return out
        return b""

    async def skip_to_end(self) -> None:
        """Inflate the rest of the data set (thrown away), then take the stored bytes
        after the stream: they are hashed and checked, and the object must end there.

        Raises:
            MalformedDicom: a corrupt stream, one the object ends inside, bytes after it.
            IngestError: reading a range.
        """
        while await self.read(STEP):
            pass
        while (chunk := await self._next()) is not None:
            self._inflater.give(chunk)
        self._inflater.finish()


async def _inflate(
    ctx: Context, obj: Located, next_chunk: NextChunk, stored_bytes: int, npy_key: str
) -> tuple[DicomHeader, Timings]:
    """The header from the inflated data set, then its frames through the device to the
    output, then the rest of the stream checked before the output is completed."""
    data_set = _DataSet(next_chunk)
    started = time.perf_counter()
    header, prefix = await _read_header(ctx, data_set, stored_bytes)
    timings = Timings(parse_s=time.perf_counter() - started)
    started = time.perf_counter()
    dtype = output_dtype(ctx.settings, header)
    async with output_array(ctx, obj, npy_key, header, dtype) as out:
        pixels = prefix[header.pixel_offset :]
        del prefix
        with decoding():
            await _frames(ctx, obj.target, header, data_set, pixels, out.write)
            await data_set.skip_to_end()
            if data_set.position < header.pixel_offset + header.pixel_length:
                raise MalformedDicom(
                    f"{NAME}: Pixel Data length runs past the end of the"
                    f" {data_set.position}-byte inflated data set"
                )
    timings.device_s = time.perf_counter() - started
    return header, timings


async def _read_header(
    ctx: Context, data_set: _DataSet, stored_bytes: int
) -> tuple[DicomHeader, bytearray]:
    """The header, and the data set's bytes inflated to find it (the Pixel Data's first
    bytes among them): at first ``HEADER_FIRST``, then as much as the parser asks for,
    never past ``max_header_bytes``.

    Raises:
        MalformedDicom, UnsupportedDicom, LimitExceeded: what ``inflated_header`` raises.
    """
    limit = ctx.settings.max_header_bytes
    prefix, want = bytearray(), HEADER_FIRST
    while True:
        while len(prefix) < want and (piece := await data_set.read(min(STEP, want - len(prefix)))):
            prefix += piece
        parse = functools.partial(
            inflated_header, bytes(prefix), data_set.ended, stored_bytes, max_header_bytes=limit
        )
        parsed = await anyio.to_thread.run_sync(parse)
        if isinstance(parsed, DicomHeader):
            return parsed, prefix
        if parsed.at_least <= len(prefix) or data_set.ended:  # the parser's own bound
            raise MalformedDicom(f"{NAME}: the header does not end inside the data set")
        want = parsed.at_least


async def _frames(
    ctx: Context,
    target: Target,
    header: DicomHeader,
    data_set: _DataSet,
    pixels: bytearray,
    write: Write,
) -> None:
    """Cut the inflated Pixel Data (``pixels``: its first bytes, then ``data_set``) into
    groups of frames as it arrives, and decode, preprocess and write them in order.

    Frames that do not start on a byte (1-bit) are cut from the whole value, which
    must then fit one group.

    Raises:
        MalformedDicom: the data set ends inside the frames.
        LimitExceeded: a frame larger than decoding allows; 1-bit frames that do not
            start on a byte, in more Pixel Data than one group.
        IngestError: a decode, the device or ``write``.
    """
    codec = header.codec
    assert codec is not None
    _check(header)
    frames, bits = codec.number_of_frames, frame_bits(codec)
    per = frames_per_group(header, out_itemsize(ctx, header))
    whole = -(-bits * frames // 8)
    if bits % 8 and whole > GROUP_BYTES:
        raise LimitExceeded(
            f"{NAME}: frames that do not start on a byte are decoded from Pixel Data of at"
            f" most {GROUP_BYTES} bytes; this one holds {whole}"
        )

    async def fill(length: int) -> None:
        while len(pixels) < length:
            piece = await data_set.read(STEP)
            if not piece:
                raise MalformedDicom(
                    f"{NAME}: truncated: the inflated data set ends inside the Pixel Data"
                    f" ({data_set.position} bytes; its frames end at"
                    f" {header.pixel_offset + whole})"
                )
            pixels.extend(piece)

    async def produce(emit: Emit) -> None:
        if bits % 8:  # one buffer of every frame, decoded a group at a time
            await fill(whole)
            value = bytes(pixels[:whole])
            pixels.clear()
            for start in range(0, frames, per):
                count = min(per, frames - start)
                group = range(start, start + count)
                decode = functools.partial(ctx.decoders.native, codec, value, start, count)
                await emit(group, cpu_step(ctx, target, header, group, decode))
            return
        frame_len = bits // 8
        for start in range(0, frames, per):
            count = min(per, frames - start)
            await fill(count * frame_len)
            data = bytes(pixels[: count * frame_len])
            del pixels[: count * frame_len]
            group = range(start, start + count)
            decode = functools.partial(ctx.decoders.native, codec, data, 0, count)
            await emit(group, cpu_step(ctx, target, header, group, decode))
        pixels.clear()

    await decode_in_order(ctx, target, header, produce, write)


def _check(header: DicomHeader) -> None:
    """What ``decode_native`` checks of the whole value, for frames decoded a group at a
    time, and the bound on a decoded frame.

    Raises:
        LimitExceeded: a decoded frame larger than ``decoded.MAX_DECODED_FRAME_BYTES``.
        MalformedDicom: YBR_FULL_422 Pixel Data a third larger than it needs (full YBR
            stored): pydicom refuses it.
    """
    codec = header.codec
    assert codec is not None
    check_frame_size(header)
    whole = frame_bits(codec) * codec.number_of_frames // 8
    full = whole // 2 * 3
    if (
        codec.photometric_interpretation == "YBR_FULL_422"
        and header.pixel_length >= full + full % 2
    ):
        raise MalformedDicom(
            f"{NAME}: Pixel Data of {header.pixel_length} bytes is a third larger"
            f" than YBR_FULL_422 needs ({whole})"
        )
