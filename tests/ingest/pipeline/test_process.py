"""Encapsulated Uncompressed (``ingest.dicom.fragments``): header, read plan, item checks.

The reference is pydicom's: its ``generate_frames`` takes the frames out of the
fragments (``tests.reference.as_native``), so the samples writer, our parser and
our plan are each checked against a reader that is not ours.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest

from ingest.dicom.direct import read_plain_header
from ingest.dicom.fragments import (
    ENCAPSULATED_UNCOMPRESSED,
    ITEM_HEADER,
    check_items,
    check_offset_tables,
    chunk_fragments,
    fragment_pitch,
)
from ingest.dicom.parse import DicomHeader, NeedMoreBytes, parse_header
from ingest.embedded.samples import synthetic_rgb
from ingest.embedded.samples_multiframe import synthetic_multiframe
from ingest.errors import IngestError, LimitExceeded, MalformedDicom
from ingest.pipeline.jobs import pixel_chunks, pixels_start
from ingest.pipeline.process import whole_header
from ingest_gpu.formats import PixelFormat, Transform, pitched_frames
from ingest_gpu.jobs import ChunkJob, CpuRunner, job_samples
from tests import bad_inputs
from tests.bad_inputs import fragment_at, set_u32
from tests.reference import reference_array

OBJECTS = {
    "16-bit, basic table": lambda: synthetic_multiframe(7, 33, 31, encapsulated="basic"),
    "16-bit, extended table": lambda: synthetic_multiframe(7, 33, 31, encapsulated="extended"),
    "16-bit, no table": lambda: synthetic_multiframe(7, 33, 31, encapsulated="none"),
    "8-bit odd frames": lambda: synthetic_multiframe(
        6, 15, 13, bits_allocated=8, encapsulated="basic"
    ),
    "rgb odd frames": lambda: synthetic_rgb(5, 17, 9, encapsulated="none"),
    "rgb planar": lambda: synthetic_rgb(4, 16, 10, planar=True, encapsulated="basic"),
    "signed 32-bit": lambda: synthetic_multiframe(
        3, 20, 20, bits_allocated=32, signed=True, encapsulated="extended"
    ),
    "one frame": lambda: synthetic_multiframe(1, 40, 40, encapsulated="basic"),
}


def parse(data: bytes) -> DicomHeader:
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    return header


def through_the_plan(data: bytes, header: DicomHeader, part: int) -> np.ndarray:
    """The values the worker's chunks give (the CPU twin), checked chunk by chunk."""
    chunks = pixel_chunks(header, part)
    assert chunks[0].range.start == pixels_start(header)
    values = []
    for before, chunk in zip([None, *chunks], chunks, strict=False):
        if before is not None:
            assert chunk.range.start == before.range.end  # they tile the object
        assert chunk.range.length <= part
        view = memoryview(data)[chunk.range.start : chunk.range.end]
        check_items(view, chunk)
        job = ChunkJob(
            chunk.samples(view),
            header.pixel,
            header.transform(None, "float32"),
            chunk.first_element,
            lambda: None,
            pitch=chunk.pitch,
        )
        assert job.sample_nbytes == chunk.elements * header.pixel.itemsize
        (result,) = CpuRunner().run([job])
        assert not isinstance(result, BaseException)
        assert result.host is not None
        values.append(result.host)
    # the last chunk ends with the Sequence Delimiter: what follows is the trailer
    end = chunks[-1].range.end
    assert data[end - ITEM_HEADER : end] == struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)
    return np.concatenate(values)


@pytest.mark.parametrize("name", OBJECTS)
def test_every_plan_gives_pydicoms_frames(name: str) -> None:
    data = OBJECTS[name]()
    header = parse(data)
    assert header.transfer_syntax_uid == ENCAPSULATED_UNCOMPRESSED
    assert header.frame_pitch == fragment_pitch(header.pixel)
    assert header.pixel_length == header.pixel.total_bytes
    expected = reference_array(data, None, "float32")
    frame = header.pixel.frame_bytes
    parts = {len(data) + 16, 3 * frame + 40, frame + 2 * ITEM_HEADER, 4 * ITEM_HEADER + 8}
    for part in sorted(parts):
        if header.pixel.planar and frame + 2 * ITEM_HEADER > part:
            with pytest.raises(LimitExceeded):
                pixel_chunks(header, part)
            continue
        assert np.array_equal(
            through_the_plan(data, header, part).reshape(expected.shape), expected
        )


@pytest.mark.parametrize("name", OBJECTS)
def test_the_plain_reader_and_pydicom_agree(name: str) -> None:
    """A plain header (no functional groups, no Extended Offset Table: the RGB tiles)
    is read straight from its bytes; the others by pydicom. Both agree."""
    data = OBJECTS[name]()
    plain = read_plain_header(data, len(data), 1 << 40)
    assert (plain is not None) == name.startswith("rgb")
    if plain is not None:
        assert plain == parse(data)


def test_a_prefix_short_of_the_first_fragment_asks_for_more() -> None:
    data = synthetic_multiframe(300, 16, 16, encapsulated="basic")  # a 1,200-byte table
    header = parse(data)
    for cut in (fragment_at(data, 0) - 500, fragment_at(data, 0) + 4):
        more = parse_header(data[:cut], len(data))
        assert isinstance(more, NeedMoreBytes)
        assert more.at_least > cut
    assert parse_header(data[: fragment_at(data, 0) + ITEM_HEADER], len(data)) == header


def test_objects_past_four_gib_need_no_native_length() -> None:
    """A layout past 4 GiB (the point of the syntax) is planned from the header alone."""
    fmt = PixelFormat(512, 512, 20_480, 1, 16, 12, False, False)  # 10.7 GB
    chunks = chunk_fragments(4096, fmt, 32 * 1024 * 1024)
    assert sum(c.elements for c in chunks) == fmt.total_elements
    assert all(c.range.length <= 32 * 1024 * 1024 for c in chunks)
    assert chunks[-1].range.end == 4096 + 20_480 * fragment_pitch(fmt) + ITEM_HEADER
    assert chunks[0].pitch == fragment_pitch(fmt)
    assert len(chunks[0].marks) == 63


def test_offset_tables_must_give_a_frame_a_fragment() -> None:
    fmt = PixelFormat(2, 2, 3, 1, 16, 16, False, False)
    pitch = fragment_pitch(fmt)
    good = struct.pack("<3I", 0, pitch, 2 * pitch)
    check_offset_tables(good, None, None, fmt)
    check_offset_tables(
        b"", struct.pack("<3Q", 0, pitch, 2 * pitch), struct.pack("<3Q", 8, 8, 8), fmt
    )
    bad: list[tuple[Any, ...]] = [
        (struct.pack("<3I", 0, pitch, 2 * pitch + 2), None, None),
        (struct.pack("<2I", 0, pitch), None, None),
        (good, struct.pack("<3Q", 0, pitch, 2 * pitch), struct.pack("<3Q", 8, 8, 8)),
        (b"", struct.pack("<3Q", 0, pitch, 2 * pitch), None),
        (b"", struct.pack("<3Q", 0, pitch, 2 * pitch), struct.pack("<3Q", 8, 8, 9)),
    ]
    for basic, extended, lengths in bad:
        with pytest.raises(MalformedDicom):
            check_offset_tables(basic, extended, lengths, fmt)


def test_an_extended_table_that_lies_is_refused_at_the_header() -> None:
    data = synthetic_multiframe(5, 16, 16, encapsulated="extended")
    table = data.index(b"\xe0\x7f\x01\x00OV") + 12
    lying = set_u32(data, table + 8, 1234)  # frame 1's offset
    with pytest.raises(MalformedDicom, match="Extended Offset Table"):
        parse_header(lying, len(lying))


def test_a_fragment_that_lies_is_caught_in_its_chunk() -> None:
    data = synthetic_multiframe(12, 16, 16, encapsulated="none")
    header = parse(data)
    lying = set_u32(data, fragment_at(data, 9) + 4, 510)
    chunks = pixel_chunks(header, 4 * fragment_pitch(header.pixel) + ITEM_HEADER)
    caught = []
    for chunk in chunks:
        try:
            check_items(memoryview(lying)[chunk.range.start : chunk.range.end], chunk)
        except MalformedDicom as exc:
            caught.append((chunk.first_element // header.pixel.frame_elements, str(exc)))
    assert caught == [
        (
            8,
            f"the fragment at byte {fragment_at(data, 9)} is not one frame of 512 bytes"
            " (Encapsulated Uncompressed: a frame a fragment)",
        )
    ]


def test_the_twin_gathers_pitched_frames_and_refuses_a_ragged_run() -> None:
    fmt = PixelFormat(2, 3, 4, 1, 16, 16, True, False)
    frames = np.arange(24, dtype="<i2").reshape(4, 6)
    pitch = fmt.frame_bytes + 10
    raw = bytearray(3 * pitch + fmt.frame_bytes)
    for k in range(4):
        raw[k * pitch : k * pitch + fmt.frame_bytes] = frames[k].tobytes()
    job = ChunkJob(memoryview(bytes(raw)), fmt, Transform(), 0, lambda: None, pitch=pitch)
    assert np.array_equal(job_samples(job).view("<i2"), frames.ravel())
    assert pitched_frames(len(raw), fmt.frame_bytes, pitch) == 4
    for nbytes, frame, step in ((len(raw) - 1, fmt.frame_bytes, pitch), (40, 12, 8), (5, 12, 20)):
        with pytest.raises(ValueError, match="bytes"):
            pitched_frames(nbytes, frame, step)
    (ragged,) = CpuRunner().run(
        [ChunkJob(memoryview(bytes(raw))[:-2], fmt, Transform(), 0, lambda: None, pitch=pitch)]
    )
    assert isinstance(ragged, ValueError)


# -- mutants -----------------------------------------------------------------------------

MUTANTS = 3000
PIXEL_DATA = b"\xe0\x7f\x10\x00OB"


def mutant(base: bytes, rng: random.Random) -> bytes:
    """1-3 byte flips, sets, insertions, deletions or a truncation, half of them in the
    Pixel Data's items."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 3)):
        start = data.rfind(PIXEL_DATA)
        if not data:
            break
        at = rng.randrange(start if start >= 0 and rng.random() < 0.5 else 0, len(data))
        kind = rng.choice(("flip", "set", "insert", "delete", "truncate"))
        if kind == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "set":
            data[at] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0x20))
        elif kind == "insert":
            data[at:at] = rng.randbytes(rng.randint(1, 12))
        elif kind == "delete":
            del data[at : at + rng.randint(1, 40)]
        else:
            del data[at:]
    return bytes(data)


def as_the_worker_reads(data: bytes) -> np.ndarray:
    """The float32 values the worker writes, or the ``IngestError`` it raises: the header
    of the whole object, its read plan at the test's part size (one chunk when it fits a
    part), the item checks of every chunk and the NumPy twin."""
    header = whole_header(data, bad_inputs.MAX_HEADER_BYTES)
    part = bad_inputs.PART_SIZE if len(data) > bad_inputs.PART_SIZE else len(data) + 16
    values = []
    for chunk in pixel_chunks(header, part):
        view = memoryview(data)[chunk.range.start : chunk.range.end]
        if len(view) < chunk.range.length:
            raise IngestError("a range past the end (the worker's GET would fail)")
        check_items(view, chunk)
        job = ChunkJob(
            chunk.samples(view),
            header.pixel,
            header.transform(None, "float32"),
            chunk.first_element,
            lambda: None,
            pitch=chunk.pitch,
        )
        (result,) = CpuRunner().run([job])
        if isinstance(result, BaseException):
            raise result
        assert result.host is not None
        values.append(result.host)
    return np.concatenate(values)


@pytest.mark.slow
def test_mutants_are_refused_or_read_as_pydicom_reads_them() -> None:
    """3,000 mutants of three objects (a Basic Offset Table, none, an Extended Offset
    Table), from a fixed seed: each is refused with an ``IngestError`` (anything else
    raised is a crash), or processed exactly as pydicom reads it. Prints the counts
    (``pytest -s``)."""
    rng = random.Random(5)
    bases = (
        bad_inputs.encapsulated_small(),
        bad_inputs.encapsulated_large(),
        synthetic_rgb(6, 20, 21, encapsulated="extended"),
    )
    processed = refused = 0
    for _ in range(MUTANTS):
        data = mutant(rng.choice(bases), rng)
        try:
            ours = as_the_worker_reads(data)
        except IngestError:
            refused += 1
            continue
        expected = reference_array(data, None, "float32").ravel()
        assert np.array_equal(ours, expected, equal_nan=True), data[:16]
        processed += 1
    print(f"\n{MUTANTS} mutants: {processed} processed as pydicom reads them, {refused} refused")
    assert processed > 0
    assert refused > 0
