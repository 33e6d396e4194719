"""Range planning and Pixel Data chunking (pure)."""

from __future__ import annotations

import base64
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.errors import LimitExceeded
from ingest.fetch.planning import (
    HEADER_PROBE_BYTES,
    ByteRange,
    chunk_pixels,
    first_read,
    split_range,
)
from ingest.fetch.ring import SMALL_SLOT_SIZE
from ingest.pipeline.jobs import DevicePlan, device_plan
from ingest.settings import load_settings
from ingest.sink.output import MAX_PARTS, MIN_PART, output_part_size
from ingest_gpu.formats import PixelFormat

MiB = 1024 * 1024


def fmt(
    frames: int, rows: int, cols: int, samples: int = 1, bits: int = 16, planar: bool = False
) -> PixelFormat:
    return PixelFormat(rows, cols, frames, samples, bits, bits, False, planar)


def test_http_range_is_inclusive() -> None:
    assert ByteRange(0, 10).http_range == "bytes=0-9"
    assert ByteRange(5, 6).length == 1


def test_first_read_small_and_large() -> None:
    assert first_read(500_000, 8 * MiB, 16 * MiB) == ByteRange(0, 500_000)
    assert first_read(100 * MiB, 8 * MiB, 16 * MiB) == ByteRange(0, HEADER_PROBE_BYTES)
    assert HEADER_PROBE_BYTES == SMALL_SLOT_SIZE  # the probe takes one small slot
    # never longer than the header bound (so a longer header is refused) or a part
    assert first_read(100 * MiB, 8 * MiB, 256 * 1024) == ByteRange(0, 256 * 1024)
    assert first_read(100 * MiB, 512 * 1024, 16 * MiB) == ByteRange(0, 512 * 1024)


@given(st.integers(0, 10**7), st.integers(1, 10**7), st.integers(10**3, 10**6))
@settings(max_examples=200, deadline=None)
def test_split_range_covers_exactly(start: int, length: int, part: int) -> None:
    ranges = split_range(start, start + length, part)
    assert ranges[0].start == start
    assert ranges[-1].end == start + length
    assert all(a.end == b.start for a, b in itertools.pairwise(ranges))
    assert all(0 < r.length <= part for r in ranges)


def test_chunks_hold_whole_frames_when_a_frame_fits() -> None:
    f = fmt(frames=100, rows=512, cols=512)  # 0.5 MiB frames
    chunks = chunk_pixels(1234, f, 8 * MiB)
    assert len(chunks) == 7  # 16 frames per 8 MiB chunk
    assert all(c.first_element % f.frame_elements == 0 for c in chunks)
    assert chunks[0].range.start == 1234
    assert chunks[-1].range.end == 1234 + f.total_bytes
    assert sum(c.elements for c in chunks) == f.total_elements


def test_frames_larger_than_a_part_split_on_samples() -> None:
    f = fmt(frames=2, rows=4096, cols=4096)  # 32 MiB frames
    chunks = chunk_pixels(0, f, 8 * MiB)
    assert len(chunks) == 8
    assert all(c.range.length <= 8 * MiB for c in chunks)


def test_planar_colour_frame_larger_than_a_part_is_refused() -> None:
    f = fmt(frames=1, rows=4096, cols=4096, samples=3, bits=8, planar=True)
    with pytest.raises(LimitExceeded):
        chunk_pixels(0, f, 8 * MiB)


def test_output_parts_are_8_mib_until_s3s_part_limit_needs_more() -> None:
    mib = 1024 * 1024
    assert output_part_size(1) == MIN_PART
    assert output_part_size(MAX_PARTS * MIN_PART) == MIN_PART
    assert output_part_size(MAX_PARTS * MIN_PART + 1) == MIN_PART + mib
    for total in (80 * 1024**3, 128 * 1024**3, 10**12):  # 20 GB RGB as float32 and beyond
        part = output_part_size(total)
        assert part % mib == 0
        assert -(-total // part) <= MAX_PARTS


@pytest.mark.parametrize(
    ("part_mib", "sink", "backend", "chunk_mib", "window"),
    [
        (32, "none", "cuda", 32, 4),  # results stay on the GPU: whole parts, 128 MiB
        (8, "none", "cuda", 8, 16),
        (256, "none", "cuda", 256, 2),  # two at least, so copies overlap kernels
        (32, "s3", "cuda", 8, 2),  # to the sink: chunks of its 8 MiB parts, two in flight
        (32, "s3", "cpu", 8, 2),
        (4, "s3", "cpu", 4, 2),
        (32, "none", "cpu", 16, 2),  # the CPU twin's results wait in host memory: 16 MiB
        (8, "none", "cpu", 8, 4),
    ],
)
def test_device_plan(part_mib: int, sink: str, backend: str, chunk_mib: int, window: int) -> None:
    settings = load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
            "DICOM_INGEST_PART_SIZE": str(part_mib * MiB),
            "DICOM_INGEST_SINK": sink,
        }
    )
    assert device_plan(settings, backend) == DevicePlan(chunk_mib * MiB, window)
