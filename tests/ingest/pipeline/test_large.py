"""A large object's header: how many GETs, of which bytes, before the first range.

``ingest.pipeline.large.read_header`` against a source that serves one object from memory and
records the ranges asked for (the GETs themselves are covered against SeaweedFS in
``tests/system/test_bad_input.py`` and ``tests/ingest/fetch/test_s3.py``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import pytest

from ingest.errors import LimitExceeded
from ingest.fetch.planning import ByteRange
from ingest.fetch.s3 import ObjectHead, Presigned
from ingest.pipeline.jobs import Context, Located
from ingest.pipeline.large import HEADER_GROWTH, read_header
from ingest.settings import load_settings
from ingest.source.notifications import ObjectRef
from tests import bad_inputs

KiB = 1024
MiB = 1024 * KiB

pytestmark = pytest.mark.anyio


@dataclass
class RecordingSource:
    data: bytes
    ranges: list[ByteRange] = field(default_factory=list)

    async def read_into(
        self, where: Presigned, head: ObjectHead, byte_range: ByteRange, into: memoryview
    ) -> None:
        assert head.etag == "e1"  # every read is of the version the first GET saw
        assert len(into) == byte_range.length
        self.ranges.append(byte_range)
        into[:] = self.data[byte_range.start : byte_range.end]


def _context(source: RecordingSource, max_header_bytes: int) -> Context:
    settings = load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
            "DICOM_INGEST_MAX_HEADER_BYTES": str(max_header_bytes),
        }
    )
    # read_header uses these two of the context's services
    fake = SimpleNamespace(settings=settings, source=source)
    return cast(Context, fake)


def _located(data: bytes) -> Located:
    ref = ObjectRef("b", "k", len(data), "e1", None, None, "ObjectCreated:Put", None)
    where = Presigned("http://127.0.0.1/b/k", "b", "k", None)
    return Located(where, ref, ObjectHead(len(data), "e1", None))


def _object(header_end: int) -> bytes:
    data = bad_inputs.padded(bad_inputs.large_base(), header_end=header_end)
    assert len(data) > header_end
    return data


@pytest.mark.parametrize(
    ("probe", "header_end", "expected"),
    [
        (1 * MiB, 775_000, []),  # fits the probe: no GET more
        (256 * KiB, 600 * KiB, [ByteRange(256 * KiB, 1 * MiB)]),  # one more, 4x
        (256 * KiB, 1536 * KiB, [ByteRange(256 * KiB, 1 * MiB), ByteRange(1 * MiB, 4 * MiB)]),
    ],
)
async def test_the_prefix_grows_fourfold_and_reads_only_new_bytes(
    probe: int, header_end: int, expected: list[ByteRange]
) -> None:
    data = _object(header_end)
    source = RecordingSource(data)
    expected = [ByteRange(r.start, min(r.end, len(data))) for r in expected]

    layout, _prefix, _hasher = await read_header(
        _context(source, 16 * MiB), _located(data), memoryview(data)[:probe]
    )

    assert source.ranges == expected
    assert HEADER_GROWTH == 4
    assert layout.pixel_offset == header_end
    assert layout.pixel_offset + layout.pixel_length <= len(data)


async def test_a_header_past_the_bound_is_refused_without_reading_past_it() -> None:
    data = _object(900 * KiB)
    source = RecordingSource(data)

    with pytest.raises(LimitExceeded):
        await read_header(_context(source, 300 * KiB), _located(data), memoryview(data)[: 64 * KiB])

    assert source.ranges == [ByteRange(64 * KiB, 256 * KiB), ByteRange(256 * KiB, 300 * KiB)]
