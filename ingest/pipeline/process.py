"""One object, end to end: ranged reads into the ring, header, device, outputs.

``process_object`` is what an object task runs; it returns a ``Processed`` or
raises an ``IngestError``. There is no HEAD: the first GET reads into a slot
either the whole object (when the notification's size, or nothing known,
says it fits one part) or a header probe, and its answer gives the object's
true size and ETag. Then one of two paths:

* small (the first GET held it all): header parse (``whole_header``) and
  SHA-256 run together in a worker thread; the Pixel Data is handed to the
  device straight from the slot.
* large: ``ingest/pipeline/large.py`` parses the header's layout from the probe
  and reads the Pixel Data in chunks, each to the device as soon as it is read.

A Deflated object (the parser says ``DeflatedDataSet``) is read in order from
its start and inflated as it arrives, on either path (``ingest/pipeline/inflated.py``).

What the two paths share (the services, the device plan and jobs) is in
``ingest/pipeline/jobs.py``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from ingest.dicom.fragments import ITEM_HEADER
from ingest.dicom.parse import DicomHeader, NeedMoreBytes, parse_header
from ingest.errors import DeflatedDataSet, MalformedDicom, NotDicom, ObjectChanged
from ingest.fetch.digest import Digests, SourceDigest
from ingest.fetch.planning import first_read
from ingest.fetch.ring import Slot
from ingest.pipeline.decoded import decode_whole
from ingest.pipeline.inflated import inflate_ranged, inflate_whole
from ingest.pipeline.jobs import (
    Context,
    Done,
    Located,
    chunk_job,
    decoding,
    output_array,
    pixel_chunks,
)
from ingest.pipeline.large import read_header, read_large
from ingest.settings import Settings
from ingest.sink.output import output_dtype, output_key, output_keys, writes_zarr
from ingest.sink.records import Processed, Timings
from ingest.source.notifications import ObjectRef

MAX_VERSION_RETRIES = 3


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
    where = await ctx.source.locate(ref)
    expected = ref.size if ref.size else ctx.settings.part_size  # a hint; the answer decides
    first = first_read(expected, ctx.settings.part_size, ctx.settings.max_header_bytes)
    npy_key, json_key = output_keys(ctx.settings, ref.bucket, ref.key)
    slot = await ctx.ring.acquire(first.length)  # a small slot when it fits one
    deflated_at: int | None = None
    parse = functools.partial(_parse_and_hash, settings=ctx.settings)
    try:
        # a whole object is parsed where its GET ran (the event loop or a GET thread)
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
            try:
                layout, prefix, hasher = await read_header(ctx, obj, slot.view[:filled])
            except DeflatedDataSet as deflated:  # read from the start: keep the probe's bytes
                probe, deflated_at = bytes(slot.view[:filled]), deflated.data_set_offset
            parse_s = time.perf_counter() - t
    finally:
        slot.release()
    if not small:
        if deflated_at is None:
            with decoding():
                done = await read_large(ctx, obj, layout, prefix, hasher, npy_key)
        else:
            done = await inflate_ranged(ctx, obj, probe, deflated_at, npy_key)
        done[3].parse_s += parse_s
    header, digests, backend, timings = done
    timings.first_get_s = first_s
    timings.started_at = started
    timings.total_s = time.perf_counter() - started
    key = output_key(ctx.settings, header, npy_key)
    written_as = "ome-zarr" if writes_zarr(ctx.settings, header) else "npy"
    return Processed(ref, head, header, digests, backend, key, json_key, timings, written_as)


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A whole object's header and source digest, and the seconds they took (in a thread).

    ``header`` None: a Deflated object, whose data set starts at ``deflated_at``."""

    header: DicomHeader | None
    digests: Digests
    seconds: float
    deflated_at: int = 0


def whole_header(data: memoryview | bytes, max_header_bytes: int) -> DicomHeader:
    """The header of an object the first GET held whole (``data`` is all of it).

    Raises:
        DeflatedDataSet: a Deflated object, whose data set is read by inflating it.
        MalformedDicom: the object ends before its header does.
        DicomError, LimitExceeded: what the parser finds wrong with it.
    """
    header = parse_header(data, len(data), max_header_bytes=max_header_bytes)
    if isinstance(header, NeedMoreBytes):
        raise MalformedDicom("the header does not end inside the object")
    return header


def _parse_and_hash(data: memoryview, settings: Settings) -> _Parsed:
    """Parse and hash a whole object (``data`` is all of it)."""
    started = time.perf_counter()
    deflated_at = 0
    header: DicomHeader | None
    try:
        header = whole_header(data, settings.max_header_bytes)
    except DeflatedDataSet as deflated:
        header, deflated_at = None, deflated.data_set_offset
    digests = SourceDigest(settings, len(data), data).digests()
    return _Parsed(header, digests, time.perf_counter() - started, deflated_at)


async def _small(ctx: Context, obj: Located, slot: Slot, npy_key: str, parsed: _Parsed) -> Done:
    """The whole object is in ``slot`` (the caller releases it), parsed."""
    header, digests = parsed.header, parsed.digests
    data = slot.view[: obj.head.size]
    if header is None:
        done = await inflate_whole(ctx, obj, data, parsed.deflated_at, digests, npy_key)
        done[3].parse_s += parsed.seconds
        return done
    with decoding():  # the header is parsed: what goes wrong now is in the Pixel Data
        timings = Timings(parse_s=parsed.seconds)
        if header.codec is not None:
            value = data[header.pixel_offset : header.pixel_offset + header.pixel_length]
            t = time.perf_counter()
            dtype = output_dtype(ctx.settings, header)
            async with output_array(ctx, obj, npy_key, header, dtype) as out:
                await decode_whole(ctx, obj.target, header, value, out.write)
            timings.device_s = time.perf_counter() - t
            return header, digests, ctx.device.backend, timings
        # one chunk: a "part" larger than the object holds all its frames and item headers
        chunk = pixel_chunks(header, obj.head.size + 2 * ITEM_HEADER)[0]
        view = data[chunk.range.start : chunk.range.end]
        t = time.perf_counter()
        dtype = output_dtype(ctx.settings, header)
        async with output_array(ctx, obj, npy_key, header, dtype) as out:
            job = chunk_job(ctx, obj.target, header, slot, view, chunk)
            result = await ctx.device.process(job)
            timings.device_s = time.perf_counter() - t
            await out.write(result.host)  # None when the sink is off: a hook has the values
        return header, digests, ctx.device.backend, timings
