"""Per-frame Rescale Slope and Intercept read straight from the raw functional groups.

A multi-frame object (Enhanced CT/MR, DESIGN.md 3.4's "per frame where the
file has per-frame values") carries one Per-Frame Functional Groups item per
frame. pydicom turns each into a ``Dataset`` when it is first read, about
90 us a frame: 0.18 s of one core, under pydicom's lock, for a 2,048-frame
object whose pixels arrive in 0.1 s (``python -m tests.header_cost``).
Here the sequence's raw bytes (a ``RawDataElement``, still unconverted when
its length is defined) are walked for the two values only: each frame item's
top-level elements are skipped by their lengths, and only its Pixel Value
Transformation Sequence is entered.

Anything this walker is not sure of (a value with several numbers or none, a
length that runs out of its parent, an unexpected tag, a big-endian or
deflated object) makes it return None, and ``dicom.py`` reads the same
values through pydicom, which then also produces the precise error. The tests
compare both paths on the same objects.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

PIXEL_VALUE_TRANSFORMATION = 0x00289145
RESCALE_INTERCEPT = 0x00281052
RESCALE_SLOPE = 0x00281053

_ITEM, _ITEM_END, _SEQUENCE_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD
_UNDEFINED = 0xFFFFFFFF
_LONG_VRS = frozenset(
    (b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV")
)
_CAPITALS = range(ord("A"), ord("Z") + 1)
# Any other two capitals: a 2-byte length (pydicom decides whether the VR is known).
_SHORT_VRS = frozenset(bytes((a, b)) for a in _CAPITALS for b in _CAPITALS) - _LONG_VRS
_TAG = struct.Struct("<HH")
_EXPLICIT = struct.Struct("<HH2sH")  # tag, VR, 2-byte length (or reserved before a long one)
_U32 = struct.Struct("<I")


class _Unsure(Exception):
    """The bytes are not what this walker reads with confidence: use pydicom."""


def per_frame_rescale(value: bytes, implicit_vr: bool) -> list[tuple[float, float] | None] | None:
    """Each frame item's (slope, intercept), None for an item without its own
    Pixel Value Transformation; or None when pydicom must read the sequence.

    ``value`` is the Per-Frame Functional Groups Sequence's value (its items),
    little endian, implicit or explicit VR as ``implicit_vr`` says.
    """
    try:
        walker = _Walker(value, implicit_vr)
        return [walker.frame_rescale(start, end) for start, end in walker.items(0, len(value))]
    except (_Unsure, struct.error, ValueError, RecursionError):  # nested too deep for us
        return None


class _Walker:
    def __init__(self, data: bytes, implicit_vr: bool) -> None:
        self._data = data
        self._implicit = implicit_vr

    def frame_rescale(self, start: int, end: int) -> tuple[float, float] | None:
        found = self._find(start, end, PIXEL_VALUE_TRANSFORMATION)
        if found is None:
            return None
        first = next(self.items(*found), None)
        if first is None:  # an empty sequence: the frame has none of its own
            return None
        slope, intercept = self._find_any(*first, (RESCALE_SLOPE, RESCALE_INTERCEPT))
        if slope is None or intercept is None:
            raise _Unsure  # pydicom says which one is missing
        return self._number(*slope), self._number(*intercept)

    def items(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """(start, end) of each item's elements in a sequence value [start, end)."""
        pos = start
        while pos < end:
            tag, length, value = self._item_header(pos, end)
            if tag != _ITEM:
                raise _Unsure
            if length == _UNDEFINED:
                item_end = self._skip_elements(value, end, until=_ITEM_END)
                yield value, item_end - 8
                pos = item_end
            else:
                if value + length > end:
                    raise _Unsure
                yield value, value + length
                pos = value + length

    def _find(self, start: int, end: int, wanted: int) -> tuple[int, int] | None:
        """(start, end) of the value of element ``wanted`` among a dataset's elements."""
        return self._find_any(start, end, (wanted,))[0]

    def _find_any(
        self, start: int, end: int, wanted: tuple[int, ...]
    ) -> list[tuple[int, int] | None]:
        """For each tag of ``wanted``, (start, end) of its value among a dataset's elements,
        or None; one pass that stops once all are found."""
        found: list[tuple[int, int] | None] = [None] * len(wanted)
        missing = len(wanted)
        pos = start
        while pos < end:
            tag, length, value = self._element_header(pos, end)
            if length == _UNDEFINED:  # a sequence of undefined length
                after = self._skip_items(value, end)
                value_end, pos = after - 8, after
            else:
                value_end = pos = value + length
                if value_end > end:
                    raise _Unsure
            if tag in wanted:
                index = wanted.index(tag)
                if found[index] is not None:  # a tag twice: pydicom decides which counts
                    raise _Unsure
                found[index] = (value, value_end)
                missing -= 1
                if not missing:
                    break
        return found

    def _skip_elements(self, start: int, end: int, *, until: int) -> int:
        """The position after the ``until`` delimiter that ends an undefined-length item."""
        pos = start
        while pos < end:
            tag, length, value = self._item_header(pos, end)
            if tag == until:
                return value
            tag, length, value = self._element_header(pos, end)
            pos = self._skip_items(value, end) if length == _UNDEFINED else value + length
        raise _Unsure

    def _skip_items(self, start: int, end: int) -> int:
        """The position after the delimiter that ends an undefined-length sequence."""
        pos = start
        while pos < end:
            tag, length, value = self._item_header(pos, end)
            if tag == _SEQUENCE_END:
                return value
            if tag != _ITEM:
                raise _Unsure
            pos = (
                self._skip_elements(value, end, until=_ITEM_END)
                if length == _UNDEFINED
                else value + length
            )
        raise _Unsure

    def _item_header(self, pos: int, end: int) -> tuple[int, int, int]:
        """Item and delimiter tags: always a 4-byte length, with or without VR."""
        if pos + 8 > end:
            raise _Unsure
        group, element = _TAG.unpack_from(self._data, pos)
        return group << 16 | element, _U32.unpack_from(self._data, pos + 4)[0], pos + 8

    def _element_header(self, pos: int, end: int) -> tuple[int, int, int]:
        """Tag, value length and value position of the element at ``pos``."""
        if pos + 8 > end:
            raise _Unsure
        group, element, vr, short = _EXPLICIT.unpack_from(self._data, pos)
        if group == 0xFFFE:  # a delimiter where an element should be
            raise _Unsure
        tag = group << 16 | element
        if self._implicit:
            return tag, _U32.unpack_from(self._data, pos + 4)[0], pos + 8
        if vr in _LONG_VRS:
            if pos + 12 > end:
                raise _Unsure
            return tag, _U32.unpack_from(self._data, pos + 8)[0], pos + 12
        if vr not in _SHORT_VRS:
            raise _Unsure
        return tag, short, pos + 8

    def _number(self, start: int, end: int) -> float:
        """A DS value holding one finite number, as pydicom reads it (else pydicom decides)."""
        text = self._data[start:end].strip(b" \x00")
        if not text or b"\\" in text or b"_" in text:
            raise _Unsure
        number = float(text)
        if not math.isfinite(number):
            raise _Unsure
        return number
