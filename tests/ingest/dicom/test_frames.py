"""The raw per-frame walker (``ingest/dicom/frames.py``) against pydicom's reading.

Two kinds of check: sequences built byte by byte (defined and undefined
lengths, implicit and explicit VR, frames without values of their own, values
it must refuse), and whole objects, intact and mutated, parsed with the
walker and without it: the header, or the error, must be the same.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ingest.dicom.rescale
from ingest.dicom.frames import (
    PIXEL_VALUE_TRANSFORMATION,
    RESCALE_INTERCEPT,
    RESCALE_SLOPE,
    per_frame_rescale,
)
from ingest.dicom.parse import DicomHeader, NeedMoreBytes, parse_header
from ingest.embedded.samples import synthetic_multiframe
from ingest.errors import IngestError
from tests.bad_inputs import mutate

FRAME_CONTENT = 0x00209111
FRAME_NUMBER = 0x00209157  # inside Frame Content: UL


def element(tag: int, vr: bytes, value: bytes, implicit: bool, undefined: bool = False) -> bytes:
    head = struct.pack("<HH", tag >> 16, tag & 0xFFFF)
    length = 0xFFFFFFFF if undefined else len(value)
    end = struct.pack("<HHI", 0xFFFE, 0xE0DD, 0) if undefined else b""
    if implicit:
        return head + struct.pack("<I", length) + value + end
    if vr in (b"SQ", b"OB", b"UN", b"UT"):
        return head + vr + b"\0\0" + struct.pack("<I", length) + value + end
    return head + vr + struct.pack("<H", len(value)) + value


def item(body: bytes, undefined: bool = False) -> bytes:
    if undefined:
        return (
            struct.pack("<HHI", 0xFFFE, 0xE000, 0xFFFFFFFF)
            + body
            + struct.pack("<HHI", 0xFFFE, 0xE00D, 0)
        )
    return struct.pack("<HHI", 0xFFFE, 0xE000, len(body)) + body


def ds(text: str) -> bytes:
    raw = text.encode()
    return raw + b" " * (len(raw) % 2)


def frame(
    slope: str | None, intercept: str | None, implicit: bool, undefined: bool, with_pvt: bool = True
) -> bytes:
    content = element(
        FRAME_CONTENT,
        b"SQ",
        item(element(FRAME_NUMBER, b"UL", struct.pack("<I", 7), implicit), undefined),
        implicit,
        undefined,
    )
    if not with_pvt:
        return item(content, undefined)
    values = b""
    if intercept is not None:
        values += element(RESCALE_INTERCEPT, b"DS", ds(intercept), implicit)
    if slope is not None:
        values += element(RESCALE_SLOPE, b"DS", ds(slope), implicit)
    pvt = element(PIXEL_VALUE_TRANSFORMATION, b"SQ", item(values, undefined), implicit, undefined)
    return item(content + pvt, undefined)


def layouts() -> Iterator[tuple[bool, bool]]:
    for implicit in (False, True):
        for undefined in (False, True):
            yield implicit, undefined


@pytest.mark.parametrize(("implicit", "undefined"), list(layouts()))
def test_values_of_each_frame_and_none_for_frames_without_their_own(
    implicit: bool, undefined: bool
) -> None:
    value = (
        frame("0.5", "-1024", implicit, undefined)
        + frame(None, None, implicit, undefined, with_pvt=False)
        + frame("2E1", "+3.25", implicit, undefined)
    )
    assert per_frame_rescale(value, implicit) == [(0.5, -1024.0), None, (20.0, 3.25)]


@pytest.mark.parametrize(
    ("slope", "intercept"),
    [("1\\2", "0"), ("", "0"), ("nan", "0"), ("1", "inf"), ("1_0", "0"), (None, "0"), ("x", "0")],
)
def test_anything_doubtful_is_left_to_pydicom(slope: str | None, intercept: str) -> None:
    value = frame("1", "0", False, False) + frame(slope, intercept, False, False)
    assert per_frame_rescale(value, False) is None


def test_bytes_that_do_not_hold_together_are_left_to_pydicom() -> None:
    good = frame("1", "0", False, False)
    assert per_frame_rescale(good, False) == [(1.0, 0.0)]
    assert per_frame_rescale(good[:-3], False) is None  # cut short
    assert per_frame_rescale(b"\x08\x00\x10\x00" + good[4:], False) is None  # not an item
    undefined = frame("1", "0", False, True)
    assert per_frame_rescale(undefined[:-8], False) is None  # the item's end is missing


def parse_both(data: bytes) -> tuple[object, object]:
    def parse() -> object:
        try:
            return parse_header(data, len(data), max_header_bytes=64 << 20)
        except IngestError as exc:
            return (type(exc).__name__, str(exc))

    fast = parse()
    with mock.patch.object(ingest.dicom.rescale, "per_frame_rescale", return_value=None):
        slow = parse()
    return fast, slow


@pytest.mark.parametrize("per_frame", [True, False])
def test_a_whole_object_reads_the_same_with_and_without_the_walker(per_frame: bool) -> None:
    data = synthetic_multiframe(37, 4, 4, per_frame_rescale=per_frame)
    walked: list[object] = []

    def spy(value: bytes, implicit: bool) -> object:
        walked.append(result := per_frame_rescale(value, implicit))
        return result

    with mock.patch.object(ingest.dicom.rescale, "per_frame_rescale", spy):
        fast = parse_header(data, len(data))
    assert len(walked) == 1
    assert walked[0] is not None  # the walker read them, not pydicom
    slow = parse_both(data)[1]
    assert isinstance(fast, DicomHeader)
    assert fast == slow
    assert len(fast.transform_slopes) == (37 if per_frame else 1)


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A 9-frame object with 1-3 edits in its header (where the functional groups are)."""
    data = bytearray(synthetic_multiframe(9, 2, 2))
    header_end = data.find(b"\xe0\x7f\x10\x00")
    for _ in range(draw(st.integers(1, 3))):
        mutate(draw, data, draw(st.integers(0, header_end)))
    return bytes(data)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mutated_headers())
def test_mutated_objects_read_the_same_with_and_without_the_walker(data: bytes) -> None:
    fast, slow = parse_both(data)
    if isinstance(fast, NeedMoreBytes):
        assert isinstance(slow, NeedMoreBytes)
    else:
        assert fast == slow
