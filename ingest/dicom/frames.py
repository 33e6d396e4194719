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


PIXEL_MEASURES = 0x00289110
PLANE_POSITION = 0x00209113
PLANE_ORIENTATION = 0x00209116
PLANE_POSITION_SLIDE = 0x0048021A
_PLANE_GROUPS = (PIXEL_MEASURES, PLANE_POSITION, PLANE_ORIENTATION, PLANE_POSITION_SLIDE)
PIXEL_SPACING = 0x00280030
SLICE_THICKNESS = 0x00180050
SPACING_BETWEEN_SLICES = 0x00180088
IMAGE_POSITION = 0x00200032
IMAGE_ORIENTATION = 0x00200037
MATRIX_COLUMN = 0x0048021E
MATRIX_ROW = 0x0048021F


def per_frame_planes(value: bytes, implicit_vr: bool) -> list[dict[str, object]] | None:
    """Each frame item's plane values (Pixel Measures, Plane Position, Plane
    Orientation, Plane Position (Slide)) by pydicom keyword, as pydicom gives them
    (one number, a tuple of several, an int); or None when pydicom must read the
    sequence. A frame item without a value leaves its keyword out.
    """
    try:
        walker = Walker(value, implicit_vr)
        return [_frame_planes(walker, start, end) for start, end in walker.items(0, len(value))]
    except (Unsure, struct.error, ValueError, RecursionError):
        return None


def _frame_planes(walker: Walker, start: int, end: int) -> dict[str, object]:
    measures, position, orientation, slide = walker.find_any(start, end, _PLANE_GROUPS)
    out: dict[str, object] = {}
    if measures is not None:
        _read_first(walker, measures, out, _MEASURES)
    if position is not None:
        _read_first(walker, position, out, ((IMAGE_POSITION, "ImagePositionPatient"),))
    if orientation is not None:
        _read_first(walker, orientation, out, ((IMAGE_ORIENTATION, "ImageOrientationPatient"),))
    if slide is not None:
        _read_first(walker, slide, out, _SLIDE)
    return out


_MEASURES = (
    (PIXEL_SPACING, "PixelSpacing"),
    (SLICE_THICKNESS, "SliceThickness"),
    (SPACING_BETWEEN_SLICES, "SpacingBetweenSlices"),
)
_SLIDE = (
    (MATRIX_COLUMN, "ColumnPositionInTotalImagePixelMatrix"),
    (MATRIX_ROW, "RowPositionInTotalImagePixelMatrix"),
)
_SIGNED_LONGS = frozenset((MATRIX_COLUMN, MATRIX_ROW))


def _read_first(
    walker: Walker,
    sequence: tuple[int, int],
    out: dict[str, object],
    wanted: tuple[tuple[int, str], ...],
) -> None:
    """The wanted values of a sequence's first item (a functional group has one).

    A sequence with other than one item, or a value of another form than the one
    read here, is left to pydicom."""
    items = list(walker.items(*sequence))
    if len(items) != 1:
        raise Unsure
    found = walker.find_any(*items[0], tuple(tag for tag, _ in wanted))
    for (tag, keyword), place in zip(wanted, found, strict=True):
        if place is None:
            continue
        raw = walker.data[place[0] : place[1]]
        if tag in _SIGNED_LONGS:
            if len(raw) != 4:
                raise Unsure
            out[keyword] = struct.unpack("<i", raw)[0]
            continue
        parts = [ds_number(raw, 0, len(raw)) for raw in raw.split(b"\\")]
        out[keyword] = parts[0] if len(parts) == 1 else tuple(parts)
