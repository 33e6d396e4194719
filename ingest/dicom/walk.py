"""A walker over raw little-endian DICOM elements, for the values pydicom is slow to give.

pydicom turns every element it reads into Python objects; for the few values
the pipeline needs, walking the bytes is ten to a hundred times cheaper
(``frames``: per-frame rescale values; ``direct``: a plain
header). The walker skips elements by their lengths, enters sequences of
undefined length item by item, and raises :class:`Unsure` on anything it does
not read with confidence (a length running out of its parent, a delimiter
where an element should be, VR bytes that are not two capitals, an element
of undefined length that is not a sequence: pydicom finds the end of those
by searching for the delimiter's bytes). Callers then leave
the bytes to pydicom, which also gives the precise error.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from pydicom.datadict import dictionary_VR

ITEM, ITEM_END, SEQUENCE_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD
UNDEFINED = 0xFFFFFFFF
MAX_DEPTH = 16  # sequences of undefined length in one another; real headers nest 2-4
LONG_VRS = frozenset(
    (b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV")
)
_CAPITALS = range(ord("A"), ord("Z") + 1)
# Any other two capitals: a 2-byte length (pydicom decides whether the VR is known).
_SHORT_VRS = frozenset(bytes((a, b)) for a in _CAPITALS for b in _CAPITALS) - LONG_VRS
_TAG = struct.Struct("<HH")
_EXPLICIT = struct.Struct("<HH2sH")  # tag, VR, 2-byte length (or reserved before a long one)
_U32 = struct.Struct("<I")


def _dictionary_vr(tag: int) -> str | None:
    try:
        return str(dictionary_VR(tag))
    except KeyError:  # private or unknown
        return None


class Unsure(Exception):
    """The bytes are not what this walker reads with confidence: use pydicom."""


class Element:
    """Where one element lies: its tag, VR (None in implicit VR), value start and end.

    A plain slotted class, not a frozen dataclass: one is made for every element
    walked, and a frozen dataclass's ``__init__`` costs about three times as much.
    """

    __slots__ = ("end", "next", "start", "tag", "vr")

    def __init__(self, tag: int, vr: bytes | None, start: int, end: int, after: int) -> None:
        self.tag, self.vr, self.start, self.end, self.next = tag, vr, start, end, after


class Walker:
    """Elements, items and sequences of ``data`` (little endian; implicit or explicit VR)."""

    def __init__(self, data: bytes, implicit_vr: bool) -> None:
        self.data = data
        self.implicit = implicit_vr
        self._depth = 0  # undefined-length sequences entered

    def element(self, pos: int, end: int) -> Element:
        """The element whose header is at ``pos``, within a parent ending at ``end``; an
        undefined-length sequence's value ends before its delimiter, ``next`` after it."""
        tag, vr, length, value = self._element_header(pos, end)
        if length == UNDEFINED:
            after = self.skip_items(value, end)
            return Element(tag, vr, value, after - 8, after)
        if value + length > end:
            raise Unsure
        return Element(tag, vr, value, value + length, value + length)

    def span(self, pos: int, end: int) -> tuple[int, bytes | None, int, int, int]:
        """``element``'s answer as a tuple (tag, VR, value start, value end, next), with an
        explicit VR element of a 2-byte length read inline: a plain header is mostly
        those, and walking one is most of what reading it costs."""
        if not self.implicit and pos + 8 <= end:
            group, number, vr, length = _EXPLICIT.unpack_from(self.data, pos)
            if vr in _SHORT_VRS and group != 0xFFFE:
                value = pos + 8
                if value + length > end:
                    raise Unsure
                return group << 16 | number, vr, value, value + length, value + length
        found = self.element(pos, end)
        return found.tag, found.vr, found.start, found.end, found.next

    def items(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """(start, end) of each item's elements in a sequence value [start, end)."""
        pos = start
        while pos < end:
            tag, length, value = self._item_header(pos, end)
            if tag != ITEM:
                raise Unsure
            if length == UNDEFINED:
                item_end = self._skip_elements(value, end)
                yield value, item_end - 8
                pos = item_end
            else:
                if value + length > end:
                    raise Unsure
                yield value, value + length
                pos = value + length

    def find_any(
        self, start: int, end: int, wanted: tuple[int, ...]
    ) -> list[tuple[int, int] | None]:
        """For each tag of ``wanted``, (start, end) of its value among a dataset's elements,
        or None; one pass that stops once all are found."""
        found: list[tuple[int, int] | None] = [None] * len(wanted)
        missing = len(wanted)
        pos = start
        while pos < end:
            found_element = self.element(pos, end)
            pos = found_element.next
            if found_element.tag in wanted:
                index = wanted.index(found_element.tag)
                if found[index] is not None:  # a tag twice: pydicom decides which counts
                    raise Unsure
                found[index] = (found_element.start, found_element.end)
                missing -= 1
                if not missing:
                    break
        return found

    def skip_items(self, start: int, end: int) -> int:
        """The position after the delimiter that ends an undefined-length sequence."""
        if self._depth >= MAX_DEPTH:
            raise Unsure  # pydicom recurses into these: let it say they nest too deeply
        self._depth += 1
        try:
            pos = start
            while pos < end:
                tag, length, value = self._item_header(pos, end)
                if tag == SEQUENCE_END:
                    return value
                if tag != ITEM:
                    raise Unsure
                pos = self._skip_elements(value, end) if length == UNDEFINED else value + length
            raise Unsure
        finally:
            self._depth -= 1

    def _skip_elements(self, start: int, end: int) -> int:
        """The position after the delimiter that ends an undefined-length item."""
        pos = start
        while pos < end:
            tag, _length, value = self._item_header(pos, end)
            if tag == ITEM_END:
                return value
            pos = self.element(pos, end).next
        raise Unsure

    def _item_header(self, pos: int, end: int) -> tuple[int, int, int]:
        """Item and delimiter tags: always a 4-byte length, with or without VR."""
        if pos + 8 > end:
            raise Unsure
        group, element = _TAG.unpack_from(self.data, pos)
        return group << 16 | element, _U32.unpack_from(self.data, pos + 4)[0], pos + 8

    def _element_header(self, pos: int, end: int) -> tuple[int, bytes | None, int, int]:
        """Tag, VR, value length and value position of the element at ``pos``."""
        if pos + 8 > end:
            raise Unsure
        group, number, vr, short = _EXPLICIT.unpack_from(self.data, pos)
        if group == 0xFFFE:  # a delimiter where an element should be
            raise Unsure
        tag = group << 16 | number
        if self.implicit:
            length = _U32.unpack_from(self.data, pos + 4)[0]
            if length == UNDEFINED and _dictionary_vr(tag) != "SQ":  # pydicom scans for bytes
                raise Unsure
            return tag, None, length, pos + 8
        if vr in LONG_VRS:
            if pos + 12 > end:
                raise Unsure
            length = _U32.unpack_from(self.data, pos + 8)[0]
            if length == UNDEFINED and vr != b"SQ":  # UN of undefined length: implicit inside
                raise Unsure
            return tag, vr, length, pos + 12
        if vr not in _SHORT_VRS:
            raise Unsure
        return tag, vr, short, pos + 8
