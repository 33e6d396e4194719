"""Per-frame Rescale Slope and Intercept read straight from the raw functional groups.

A multi-frame object (Enhanced CT/MR, whose output is rescaled per frame:
docs/output.md) carries one Per-Frame Functional Groups item per frame. pydicom
turns each into a ``Dataset`` when it is first read, under pydicom's lock: for an
object of thousands of frames that takes longer than its pixels take to arrive
(``python -m ingest.bench.diagnostics.header_cost`` measures both). Here the
sequence's raw bytes (a ``RawDataElement``, still unconverted when its length is
defined) are walked (``walk``) for the two values only: each frame item's top-level
elements are skipped by their lengths, and only its Pixel Value Transformation
Sequence is entered.

Anything this walker is not sure of (a value with several numbers or none, a
length that runs out of its parent, an unexpected tag, a big-endian or
deflated object) makes it return None, and ``parse.py`` reads the same
values through pydicom, which then also produces the precise error. The tests
compare both paths on the same objects.
"""

from __future__ import annotations

import math
import struct

from ingest.dicom.walk import Unsure, Walker

PIXEL_VALUE_TRANSFORMATION = 0x00289145
RESCALE_INTERCEPT = 0x00281052
RESCALE_SLOPE = 0x00281053


def per_frame_rescale(value: bytes, implicit_vr: bool) -> list[tuple[float, float] | None] | None:
    """Each frame item's (slope, intercept), None for an item without its own
    Pixel Value Transformation; or None when pydicom must read the sequence.

    ``value`` is the Per-Frame Functional Groups Sequence's value (its items),
    little endian, implicit or explicit VR as ``implicit_vr`` says.
    """
    try:
        walker = Walker(value, implicit_vr)
        return [_frame_rescale(walker, start, end) for start, end in walker.items(0, len(value))]
    except (Unsure, struct.error, ValueError, RecursionError):  # nested too deep for us
        return None


def _frame_rescale(walker: Walker, start: int, end: int) -> tuple[float, float] | None:
    found = walker.find_any(start, end, (PIXEL_VALUE_TRANSFORMATION,))[0]
    if found is None:
        return None
    first = next(walker.items(*found), None)
    if first is None:  # an empty sequence: the frame has none of its own
        return None
    slope, intercept = walker.find_any(*first, (RESCALE_SLOPE, RESCALE_INTERCEPT))
    if slope is None or intercept is None:
        raise Unsure  # pydicom says which one is missing
    return ds_number(walker.data, *slope), ds_number(walker.data, *intercept)


def ds_number(data: bytes, start: int, end: int) -> float:
    """A DS value holding one finite number, as pydicom reads it (else pydicom decides)."""
    text = data[start:end].strip(b" \x00")
    if not text or b"\\" in text or b"_" in text:
        raise Unsure
    number = float(text)
    if not math.isfinite(number):
        raise Unsure
    return number
