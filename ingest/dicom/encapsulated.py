"""Encapsulated Pixel Data split into frames as its bytes stream in, in bounded memory (pure).

A compressed object of 10-20 GB (a whole-slide image) is read in consecutive
ranges; ``FrameSplitter`` takes the Pixel Data value's bytes in order and hands
out each frame's codestream (its fragments joined) as soon as the bytes holding
it have arrived. The value (PS3.5 A.4) is items of an 8-byte header, (FFFE,E000)
and a 32-bit length, then their bytes: the Basic Offset Table (BOT), the
fragments, then the Sequence Delimiter (FFFE,E0DD).

Frames are those ``pydicom.encaps.generate_frames`` (pydicom 3) gives for the
whole value, so decoding them equals ``pixel_array``:

* an Extended Offset Table (EOT): frame k is the first ``lengths[k]`` bytes of the
  item at ``offsets[k]`` (a BOT beside it is ignored, as pydicom does);
* a BOT: frame k is the fragments from the item at offset k to the next offset;
* neither: a single frame is every fragment; else pydicom counts the fragments.
  As many as frames: one a frame; more: a frame ends with each fragment holding
  a JPEG EOI/EOC marker (FF D9) in its last 10 bytes.

That count is known only at the end, so a fragment without the marker leaves both
readings open, and fragments are held (``max_frame_bytes`` in all) until one is
proven. A reading that needs a frame over ``max_frame_bytes`` is dead, which
settles RLE (one fragment a frame); when both stay alive past the bound, the
value is refused (``LimitExceeded``).

Where pydicom would guess, warn or read across items, this refuses
(``MalformedDicom``): a frame count other than Number of Frames, a value truncated
or without its delimiter, no fragments, a BOT not of Number of Frames offsets
rising from 0 onto items, EOT offsets not rising onto items or lengths past
them, fragments after the last marker. Errors name offsets (from the value's
first byte) and counts, never data. After an error the splitter is dropped, and
the frames it gave are not to be used.

``value_ranges`` plans the reads of such a value, whose end is not known until its
Sequence Delimiter (the splitter finds it as it splits).
"""

from __future__ import annotations

import struct
import sys
from array import array
from itertools import pairwise
from typing import Final

from ingest.errors import LimitExceeded, MalformedDicom
from ingest.fetch.planning import ByteRange, split_range

ITEM_HEADER: Final = 8  # a tag and a 32-bit length
_ITEM_TAG: Final = b"\xfe\xff\x00\xe0"
_DELIMITER_TAG: Final = b"\xfe\xff\xdd\xe0"
_UNDEFINED: Final = 0xFFFFFFFF
_EOI: Final = b"\xff\xd9"
_LENGTH: Final = struct.Struct("<I")
_HEADER: Final = struct.Struct("<II")  # an item header as two words: its tag, its length
_ITEM_WORD: Final = 0xE000FFFE  # (FFFE,E000) read as a little-endian word

# How frames are found: with a table, or without one (see the module docstring).
_EOT, _BOT, _ONE = "eot", "bot", "one"  # EOT; BOT; no table, a single frame
_EACH_OR_MARKS = "undecided"  # no table: every fragment so far ends with a marker
_HOLD = "hold"  # a fragment without a marker: both readings open, fragments held
_EACH, _MARKS = "each", "marks"  # settled: one fragment a frame; frames end at markers


def _words(raw: bytes, code: str, what: str, count: int) -> array[int]:
    """``raw`` as ``count`` little-endian unsigned integers of ``code``'s size."""
    table = array(code)
    if len(raw) != table.itemsize * count:
        raise MalformedDicom(f"{what} holds {len(raw)} bytes for {count} frames")
    table.frombytes(raw)
    if sys.byteorder == "big":
        table.byteswap()
    return table


def _rising(table: array[int]) -> bool:
    """Strictly increasing."""
    return all(a < b for a, b in pairwise(table))


class FrameSplitter:
    """Feeds on the Pixel Data value's bytes in order; hands out each frame's codestream as
    soon as it is complete. Holds at most ``max_frame_bytes`` and a partial item header,
    copied (nothing ``feed`` is given is kept), and the BOT's 4 bytes a frame.

    With ``views``, a frame that is one item wholly inside the bytes ``feed`` was given
    comes out as a view of them, not a copy (the caller keeps those bytes as they are
    while it uses the frame); any other frame is copied.
    """

    def __init__(
        self,
        number_of_frames: int,
        extended_offsets: tuple[bytes, bytes] | None = None,
        *,
        max_frame_bytes: int,
        views: bool = False,
    ) -> None:
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be positive")
        if number_of_frames < 1:
            raise MalformedDicom(f"Number of Frames is {number_of_frames}")
        self._n, self._max, self._views = number_of_frames, max_frame_bytes, views
        self._max_held = max(1024, max_frame_bytes // 64)  # held fragments cost ~64 B each
        self._offsets = self._lengths = self._bot = array("I")  # the tables
        self._mode = ""  # set by the BOT item, unless there is an EOT
        if extended_offsets is not None:
            self._mode = _EOT
            self._offsets = _words(extended_offsets[0], "Q", "Extended Offset Table", self._n)
            self._lengths = _words(extended_offsets[1], "Q", "its lengths", self._n)
            if not _rising(self._offsets):
                raise MalformedDicom("Extended Offset Table offsets do not rise")
            if max(self._lengths) > max_frame_bytes:
                raise LimitExceeded(f"an EOT frame length is over {max_frame_bytes} bytes")
        self._pos = 0  # bytes of the value consumed
        self._head = bytearray()  # a partial item header
        self._item_at = 0  # where the current item's header starts
        self._left = 0  # bytes of the current item still to come
        self._keep = 0  # of those, how many are kept (the rest skipped)
        self._first = -1  # where the first fragment's header starts (after the BOT)
        self._fragments = 0  # fragment items begun
        self._k = 0  # EOT / BOT: the frame being collected
        self._parts = 0  # BOT: fragments in the frame being collected
        self._one: bytes | None = None  # the frame (or fragment) so far, when one piece
        self._buf = bytearray()  # ... or when several
        self._size = 0  # its bytes
        self._frag_size = 0  # bytes of the current fragment
        self._held: list[tuple[bytes, bool]] = []  # _HOLD: fragments and their marker
        self._held_bytes = 0
        self._group = 0  # _HOLD: bytes since the last marker
        self._open = 0  # _MARKS: fragments since the last marker
        self._emitted = 0
        self._out: list[bytes | memoryview] = []
        self._done = False

    @property
    def done(self) -> bool:
        """The Sequence Delimiter has been read: every frame is out, later bytes are ignored."""
        return self._done

    @property
    def value_length(self) -> int | None:
        """The value's bytes through its delimiter, once ``done``."""
        return self._pos if self._done else None

    @property
    def frames(self) -> int:
        """Frames handed out so far."""
        return self._emitted

    @property
    def buffered(self) -> int:
        """Bytes held: frame data (at most ``max_frame_bytes``) and a partial item header."""
        return len(self._head) + self._size + self._held_bytes

    def feed(self, data: bytes | memoryview) -> list[bytes | memoryview]:
        """Take the value's next bytes; the frames they complete, in order.

        Raises:
            MalformedDicom: the value contradicts itself or Number of Frames.
            LimitExceeded: a frame (or the bytes held to tell frames apart) is too large.
        """
        out: list[bytes | memoryview] = []
        self._out = out
        with memoryview(data) as raw, raw.cast("B") as view:
            at, end = 0, len(view)
            while at < end and not self._done:
                if self._left == 0:  # no slice of ``view`` outlives its statement
                    if not self._head:
                        at = self._whole_items(view, at, end)
                        if at == end:
                            break
                    need = min(ITEM_HEADER - len(self._head), end - at)
                    self._head += view[at : at + need]
                    at += need
                    if len(self._head) == ITEM_HEADER:
                        self._header(bytes(self._head))
                    continue
                step = min(self._left, end - at)
                keep = min(step, self._keep)
                if keep:
                    self._take(view[at : at + keep])
                    self._keep -= keep
                at, self._pos, self._left = at + step, self._pos + step, self._left - step
                if self._left == 0:
                    self._item_end()
        return out

    def finish(self) -> list[bytes | memoryview]:
        """At the end of the data: the frames not yet given (none once ``done``).

        Raises:
            MalformedDicom: the value ended before its Sequence Delimiter.
        """
        if self._done:
            return []
        where = f"{self._left} bytes short of the item at {self._item_at}" if self._left else ""
        where = f"inside the item header at {self._pos}" if self._head else where
        raise MalformedDicom(f"the Pixel Data value ends {where or 'with no Sequence Delimiter'}")

    def _whole_items(self, view: memoryview, at: int, end: int) -> int:
        """Take the items wholly in ``view`` from ``at`` that are each one frame (or, with
        an EOT, one the table skips) as the state machine would, in fewer steps: a slide
        holds a million such tiles. Stops at the first item that needs the full reading
        (any other case, the delimiter, anything malformed), which ``feed`` then takes
        through ``_header``; returns where it stopped.
        """
        mode, n = self._mode, self._n
        if self._first < 0 or self._size or mode not in (_EOT, _BOT, _EACH, _EACH_OR_MARKS):
            return at
        while at + ITEM_HEADER <= end:
            tag, length = _HEADER.unpack_from(view, at)
            stop = at + ITEM_HEADER + length
            if tag != _ITEM_WORD or stop > end or length > self._max:  # also undefined length
                break
            offset, k = self._pos - self._first, self._k
            if mode == _EOT:
                if k >= n or offset > self._offsets[k] or self._lengths[k] > length:
                    break
                if offset == self._offsets[k]:  # else an item the table skips
                    self._emit(self._frame(view, at + ITEM_HEADER, self._lengths[k]))
                    self._k = k + 1
            elif mode == _BOT:
                if k + 1 >= n or offset != self._bot[k] or self._bot[k + 1] != stop - at + offset:
                    break
                self._emit(self._frame(view, at + ITEM_HEADER, length))
                self._k = k + 1
            else:
                if self._fragments >= n:
                    break
                if mode == _EACH_OR_MARKS and (
                    length == 0 or _EOI not in bytes(view[stop - min(10, length) : stop])
                ):
                    break
                self._emit(self._frame(view, at + ITEM_HEADER, length))
            self._fragments += 1
            self._item_at, self._pos, at = self._pos, self._pos + stop - at, stop
        return at

    def _frame(self, view: memoryview, at: int, length: int) -> bytes | memoryview:
        """The frame at ``view[at : at + length]``: a view of it or a copy (``views``)."""
        frame = view[at : at + length]
        return frame if self._views else bytes(frame)

    def _header(self, head: bytes) -> None:
        """An item header is complete: check it and say how much of its value to keep."""
        self._head.clear()
        tag, (length,) = head[:4], _LENGTH.unpack_from(head, 4)
        self._item_at, self._pos = self._pos, self._pos + ITEM_HEADER
        where = f"at {self._item_at}"
        if tag == _DELIMITER_TAG and self._first >= 0:
            self._end_of_value()
            return
        if tag != _ITEM_TAG:
            group, element = struct.unpack("<HH", tag)
            raise MalformedDicom(f"({group:04X},{element:04X}) {where} where an item should be")
        if length == _UNDEFINED:
            raise MalformedDicom(f"an item of undefined length {where}")
        self._left = length
        if self._first < 0:
            self._keep = self._bot_item(length, where)
            self._first = self._pos + length
        else:
            self._fragments += 1
            self._frag_size = 0
            self._keep = self._begin(self._item_at - self._first, length, where)
        if length == 0:
            self._item_end()

    def _bot_item(self, length: int, where: str) -> int:
        """The BOT item's header: how frames will be found; the table's bytes to keep."""
        if length % 4:
            raise MalformedDicom(f"a Basic Offset Table of {length} bytes {where}")
        if self._mode == _EOT:
            return 0  # pydicom prefers the EOT and ignores the BOT
        if length == 0:
            self._mode = _ONE if self._n == 1 else _EACH_OR_MARKS
            return 0
        if length != 4 * self._n:
            raise MalformedDicom(f"the Basic Offset Table has {length // 4} offsets, not {self._n}")
        if length > self._max:
            raise LimitExceeded(f"a Basic Offset Table of {length} bytes")
        self._mode = _BOT
        return length

    def _item_end(self) -> None:
        if self._mode == _BOT and not self._bot:
            self._bot = _words(self._pop(), "I", "the Basic Offset Table", self._n)
            if self._bot[0] != 0 or not _rising(self._bot):
                raise MalformedDicom("Basic Offset Table offsets do not rise from 0")
        elif self._fragments:
            self._fragment_end()

    def _take(self, piece: memoryview) -> None:
        """Copy kept bytes out of the caller's buffer (one copy when a frame is one piece)."""
        if self._one is None and not self._buf:
            self._one = bytes(piece)
        else:
            if self._one is not None:
                self._buf += self._one
                self._one = None
            self._buf += piece
        self._size += len(piece)
        self._frag_size += len(piece)

    def _pop(self) -> bytes:
        """The bytes taken since the last pop."""
        got = self._one if self._one is not None else bytes(self._buf)
        self._one, self._size = None, 0
        self._buf.clear()
        return got

    def _marker(self) -> bool:
        """pydicom's end-of-frame test: FF D9 within the fragment's last 10 bytes."""
        tail = min(10, self._frag_size)
        data = self._one if self._one is not None else self._buf
        return tail > 0 and _EOI in data[-tail:]

    def _emit(self, frame: bytes | memoryview) -> None:
        self._emitted += 1
        if self._emitted > self._n:
            raise MalformedDicom(f"more frames than the {self._n} of Number of Frames")
        self._out.append(frame)

    def _over(self, size: int, where: str) -> None:
        if size > self._max:
            raise LimitExceeded(f"frame {self._emitted}: {size} bytes, over {self._max} ({where})")

    def _begin(self, at: int, length: int, where: str) -> int:
        """A fragment item of ``length`` starts at offset ``at`` past the BOT: bytes to keep."""
        mode = self._mode
        if mode == _EOT:
            k = self._k
            if k < self._n and at >= self._offsets[k]:
                if at > self._offsets[k]:
                    raise MalformedDicom(f"EOT offset {k} is not at an item (item {where})")
                if self._lengths[k] > length:
                    raise MalformedDicom(f"EOT length {k} is past its item {where}")
                return self._lengths[k]
            return 0  # an item the table does not point to, as pydicom skips it
        self._over(length, where)
        if mode in (_BOT, _ONE):
            self._over(self._size + length, where)
        elif mode == _EACH_OR_MARKS and self._fragments > self._n:
            raise MalformedDicom(f"more frames than the {self._n} of Number of Frames ({where})")
        elif mode == _HOLD:
            if self._fragments > self._n:  # more fragments than frames: frames end at markers
                self._settle_marks()
                self._over(self._size + length, where)
            elif self._group + length > self._max:  # a marked frame too large: one a fragment
                self._mode = _EACH
                self._release_held()
            elif self._held_bytes + length > self._max or len(self._held) >= self._max_held:
                raise LimitExceeded(  # the count of fragments, at the end, would tell
                    f"no offset table: fragments {self._emitted + 1}-{self._fragments} "
                    f"({self._held_bytes + length} bytes) held past {self._max} undecided"
                )
        elif mode == _EACH and self._fragments > self._n:  # so frames end at markers
            raise LimitExceeded(f"more fragments than frames {where}: a frame over {self._max}")
        elif mode == _MARKS:
            self._over(self._size + length, where)
        return length

    def _fragment_end(self) -> None:
        """A fragment's bytes are all in: hand out what it completes."""
        mode = self._mode
        if mode == _EOT:
            if self._k < self._n and self._item_at - self._first == self._offsets[self._k]:
                self._emit(self._pop())
                self._k += 1
        elif mode == _BOT:
            self._parts += 1
            if self._k + 1 < self._n:
                end, following = self._pos - self._first, self._bot[self._k + 1]
                if end == following:
                    self._emit(self._pop())
                    self._k, self._parts = self._k + 1, 0
                elif end > following:
                    raise MalformedDicom(f"BOT offset {self._k + 1} is not at an item")
        elif mode in (_EACH_OR_MARKS, _HOLD):
            marker, size = self._marker(), self._size
            if mode == _EACH_OR_MARKS and marker:
                self._emit(self._pop())
                return
            self._mode = _HOLD
            self._held.append((self._pop(), marker))
            self._held_bytes += size
            self._group = 0 if marker else self._group + size
        elif mode == _EACH or (mode == _MARKS and self._marker()):
            self._emit(self._pop())
            self._open = 0
        elif mode == _MARKS:
            self._open += 1

    def _release_held(self) -> None:
        """Held fragments are frames, one each."""
        for fragment, _ in self._held:
            self._emit(fragment)
        self._held, self._held_bytes, self._group = [], 0, 0

    def _settle_marks(self) -> None:
        """More fragments than frames: held fragments become frames ending at markers."""
        self._mode = _MARKS
        frame: list[bytes] = []
        for fragment, marker in self._held:
            frame.append(fragment)
            if marker:
                self._emit(b"".join(frame))
                frame = []
        self._held, self._held_bytes, self._group = [], 0, 0
        self._open = len(frame)
        for fragment in frame:  # the frame still open continues in the buffer
            self._buf += fragment
            self._size += len(fragment)

    def _end_of_value(self) -> None:
        """The Sequence Delimiter: the last frames, and the count against Number of Frames."""
        self._done = True
        if not self._fragments:
            raise MalformedDicom(f"no fragments before the Sequence Delimiter at {self._item_at}")
        if self._mode == _EOT and self._k < self._n:
            raise MalformedDicom(f"EOT offset {self._k} is past the last item")
        if self._mode == _BOT and (self._k + 1 < self._n or not self._parts):
            last = self._k + 1 if self._parts else self._k
            raise MalformedDicom(f"BOT offset {last} is past the last fragment")
        if self._mode in (_BOT, _ONE):
            self._emit(self._pop())
        elif self._mode == _HOLD and self._fragments == self._n:  # one fragment a frame
            self._release_held()
        elif self._mode == _MARKS and self._open:
            raise MalformedDicom("fragments after the last end-of-frame marker")
        if self._emitted != self._n:
            what = f"{self._fragments} fragments make {self._emitted} frames"
            raise MalformedDicom(f"{what}, not the {self._n} of Number of Frames")


def value_ranges(
    value_start: int, value_end: int | None, object_size: int, part_size: int
) -> list[ByteRange]:
    """Consecutive reads of at most ``part_size`` from the value's first byte to
    ``value_end``, or to the object's end while that is unknown (the splitter is
    ``done`` at the delimiter and ignores what follows).

    Raises:
        MalformedDicom: the value is not within the object, or too short for a BOT
            item and a delimiter.
    """
    end = object_size if value_end is None else value_end
    if not 0 <= value_start <= end <= object_size:
        raise MalformedDicom(
            f"Pixel Data value [{value_start}, {end}) is not within the object of {object_size}"
        )
    if end - value_start < 2 * ITEM_HEADER:
        raise MalformedDicom(f"Pixel Data value of {end - value_start} bytes at {value_start}")
    return split_range(value_start, end, part_size)
