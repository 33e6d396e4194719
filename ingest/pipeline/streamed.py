"""A large encapsulated object decoded as its ranges arrive (``decode_streamed``).

Its Pixel Data value is read in order, in ranges, from its first byte to the
object's end (the hash takes every range); each range's complete frames are split
out of its ring slot while the next ones are read (``frame_stream``: the ranges and
a ``FrameSplitter``), and frames go on in groups (``decoded.compressed_step``), in
frame order.

Frames the device decodes are not copied out of the slot: each is a view of the
pinned slot it was read into, from which nvImageCodec reads it (a slide's tiles are
~30 KB, and their copy was a large share of a tile's host time). The slot then stays
out of the ring until its frames are decoded: each view holds a reference on it
(``SlotRefs``) until its group's step is done, and the group's device job holds one
more until the device thread has read the frames (its ``on_consumed``), since a
cancelled step may leave its job behind on the device. A frame split across two
ranges, and every frame the CPU decodes, is copied; so are the frames a range leaves
over for the next group (fewer than a group), since a slot they held would wait on
reads that may need it (a group larger than the ring's free slots hung).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import anyio

from ingest.dicom.codec_read import syntax_name
from ingest.dicom.device_codecs import device_colour, device_format
from ingest.dicom.encapsulated import FrameSplitter, value_ranges
from ingest.dicom.header import DicomHeader
from ingest.errors import IngestError, LimitExceeded, MalformedDicom
from ingest.fetch.digest import SourceDigest
from ingest.fetch.planning import ByteRange
from ingest.fetch.ring import Slot
from ingest.pipeline.decoded import (
    MAX_FRAME_GROWTH,
    Emit,
    Frame,
    Hold,
    Step,
    Write,
    check_frame_size,
    compressed_step,
    decode_in_order,
    decodes_on_device,
    frames_per_group,
    named,
    out_itemsize,
    results_to_host,
)
from ingest.pipeline.jobs import Context, Located, object_reads
from ingest_gpu.decode import DeviceDecodeError, Parsed, parse_each
from ingest_gpu.thread import ChunkResult


async def decode_streamed(
    ctx: Context,
    obj: Located,
    header: DicomHeader,
    hasher: SourceDigest,
    write: Write,
    per_frame: Callable[[], Awaitable[DicomHeader]] | None = None,
) -> None:
    """Decode, preprocess and write the frames of a large encapsulated object as its
    ranges arrive, in groups, the device's frames left in their slots.

    ``per_frame``: ``header`` is the layout alone (``per_frame_pending``), and this
    gives it with the per-frame values the frames need (thousands of frames take tens
    of milliseconds): it runs once the first ranges are under way, before the first
    group.

    Raises:
        IngestError: a read, fragments that disagree with the header, a frame too
            large, a decode, the device, ``per_frame`` or ``write``.
    """
    codec = header.codec
    assert codec is not None
    device = decodes_on_device(ctx, header)
    stream = frame_stream(header, obj.head.size, ctx.settings.part_size, views=device)
    ranges = stream.ranges
    per = frames_per_group(header, out_itemsize(ctx, header), device, results_to_host(ctx))
    refs = SlotRefs()
    fmt, colour = device_format(codec), device_colour(codec)

    def parsed_for_device(frames: list[Frame]) -> list[Parsed | DeviceDecodeError]:
        return parse_each(frames, fmt, colour) if device and colour is not None else []

    def split(view: memoryview) -> tuple[list[Frame], list[Parsed | DeviceDecodeError]]:
        """The frames ``view`` completes and, for the device, their codestreams parsed."""
        frames = stream.feed(view)
        return frames, parsed_for_device(frames)

    def detach(
        frames: list[Frame], codestreams: list[Parsed | DeviceDecodeError]
    ) -> tuple[list[Frame], list[Parsed | DeviceDecodeError]]:
        """``frames`` copied out of their slots, parsed again over the copies (a parsed
        codestream reads the bytes it was made from); a frame already copied is kept."""
        viewed = [k for k, frame in enumerate(frames) if isinstance(frame, memoryview)]
        copies, reparsed = list(frames), list(codestreams)
        for k in viewed:
            copies[k] = bytes(frames[k])
        for k, again in zip(viewed, parsed_for_device([copies[k] for k in viewed]), strict=True):
            reparsed[k] = again
        return copies, reparsed

    async def hash_part(start: int, view: memoryview) -> None:
        await anyio.to_thread.run_sync(hasher.update, start, view)

    async def produce(emit: Emit) -> None:
        nonlocal header
        pending: list[Frame] = []
        parsed: list[Parsed | DeviceDecodeError] = []  # for the device: each pending frame's
        owners: list[Slot | None] = []  # the slot each pending frame is a view of
        first = 0

        async def flush(at_least: int) -> None:
            nonlocal pending, parsed, owners, first
            while pending and len(pending) >= at_least:
                part, pending = pending[:per], pending[per:]
                ready, parsed = (parsed[:per] or None), parsed[per:]
                held = Counter(slot for slot in owners[:per] if slot is not None)
                owners = owners[per:]
                group = range(first, first + len(part))
                first = group.stop
                hold = device_hold(held) if held else None
                step = compressed_step(ctx, obj.target, header, group, part, ready, hold)
                await emit(group, refs.holding(held, step))

        async with object_reads(ctx, obj, ranges, hasher) as reads:
            if per_frame is not None:  # while the first ranges arrive
                header = await per_frame()
            index = 0
            async for slot, view in reads:
                try:
                    frames: list[Frame] = []
                    codestreams: list[Parsed | DeviceDecodeError] = []
                    refused: IngestError | None = None
                    async with anyio.create_task_group() as both:  # the hash releases the GIL
                        if hasher.in_order:
                            both.start_soon(hash_part, ranges[index].start, view)
                        if not stream.done:
                            # a part holds thousands of tiles: split them off the event loop,
                            # which meanwhile dispatches the device's batches
                            try:
                                frames, codestreams = await anyio.to_thread.run_sync(split, view)
                            except IngestError as exc:  # raised as it is, not in a group
                                refused = exc
                    if refused is not None:
                        raise refused
                    if frames:
                        viewed = [slot if isinstance(f, memoryview) else None for f in frames]
                        refs.take(slot, len(viewed) - viewed.count(None))
                        pending.extend(frames)
                        parsed.extend(codestreams)
                        owners.extend(viewed)
                finally:
                    slot.release()
                index += 1
                await flush(per)
                if any(owners):  # the frames left for the next group keep no slot
                    pending, parsed = await anyio.to_thread.run_sync(detach, pending, parsed)
                    refs.give_back(Counter(slot for slot in owners if slot is not None))
                    owners = [None] * len(pending)
        last = stream.finish()
        pending.extend(last)
        parsed.extend(parsed_for_device(last))
        owners.extend([None] * len(last))
        await flush(1)

    try:
        await decode_in_order(ctx, obj.target, header, produce, write)
    finally:
        refs.give_back_all()  # frames never grouped, steps never started


class FrameStream:
    """A large encapsulated object's Pixel Data as the worker reads it: ``ranges``, in
    order, from the value's first byte to the object's end, and the splitter that cuts
    the frames out of them as they arrive. Its errors name the transfer syntax first."""

    def __init__(
        self, header: DicomHeader, ranges: list[ByteRange], splitter: FrameSplitter
    ) -> None:
        self.header, self.ranges, self._splitter = header, ranges, splitter

    @property
    def done(self) -> bool:
        """The Sequence Delimiter has been read: what is left to read is the trailer."""
        return self._splitter.done

    def feed(self, view: memoryview) -> list[Frame]:
        """The frames the next range's bytes complete, in order (none once ``done``).

        Raises:
            MalformedDicom: the value contradicts itself or Number of Frames.
            LimitExceeded: a frame, or what is held to tell frames apart, is too large.
        """
        return named(self.header, self._splitter.feed, view)

    def finish(self) -> list[Frame]:
        """At the object's end: the frames not given yet (none once ``done``).

        Raises:
            MalformedDicom: the value ended before its Sequence Delimiter.
        """
        return named(self.header, self._splitter.finish)


def frame_stream(
    header: DicomHeader, object_size: int, part_size: int, views: bool = False
) -> FrameStream:
    """How the worker reads a large encapsulated object's frames: ranges of ``part_size``
    and a splitter that holds at most ``MAX_FRAME_GROWTH`` parts, or twice a decoded
    frame, of one frame (a compressed frame rarely exceeds its decoded size; a part or
    two is the usual). ``views``: frames wholly in one range are views of it (the
    device reads them from the ring's slots), not copies.

    Raises:
        LimitExceeded: a decoded frame would be larger than ``MAX_DECODED_FRAME_BYTES``.
        MalformedDicom: the value is not within the object, or the Extended Offset
            Table contradicts Number of Frames (naming the transfer syntax).
    """
    check_frame_size(header)
    ranges = value_ranges(header.pixel_offset, None, object_size, part_size)
    bound = max(MAX_FRAME_GROWTH * part_size, 2 * header.pixel.frame_bytes)
    try:
        splitter = FrameSplitter(
            header.pixel.frames, header.offset_table, max_frame_bytes=bound, views=views
        )
    except (MalformedDicom, LimitExceeded) as exc:  # the Extended Offset Table's checks
        raise type(exc)(f"{syntax_name(header.transfer_syntax_uid)}: {exc}") from exc
    return FrameStream(header, ranges, splitter)


class SlotRefs:
    """The references an object's frames hold on ring slots, one a frame split out as a
    view of its slot: each group's step gives its frames' back when it is done, and
    whatever is left when the object ends (it failed or was cancelled) goes back then.
    Used on the event loop only."""

    def __init__(self) -> None:
        self._held: Counter[Slot] = Counter()

    def take(self, slot: Slot, count: int) -> None:
        if count:
            slot.retain(count)
            self._held[slot] += count

    def give_back(self, counts: Counter[Slot]) -> None:
        for slot, count in counts.items():
            count = min(count, self._held[slot])
            if count:
                self._held[slot] -= count
                slot.release(count)

    def give_back_all(self) -> None:
        self.give_back(Counter(self._held))

    def holding(self, counts: Counter[Slot], step: Step) -> Step:
        """``step``, which gives ``counts`` back when it ends."""
        if not counts:
            return step

        async def held() -> ChunkResult:
            try:
                return await step()
            finally:
                self.give_back(counts)

        return held


def device_hold(slots: Iterable[Slot]) -> Hold:
    """Keeps ``slots`` for a device job: one reference each, taken on the event loop
    when the job is made; the release the device thread calls once it read them."""
    distinct = list(slots)

    def hold() -> Callable[[], None]:
        for slot in distinct:
            slot.retain()

        def release() -> None:
            for slot in distinct:
                slot.release_threadsafe()

        return release

    return hold
