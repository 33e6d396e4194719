"""Encapsulated Uncompressed Explicit VR Little Endian (1.2.840.10008.1.2.1.98): pure layout.

This transfer syntax (DICOM 2023c, PS3.5 A.4.11) exists for what a native one
cannot hold: uncompressed Pixel Data past the 4 GiB of a 32-bit element length,
such as a whole-slide image. Its Pixel Data has an undefined length and holds
items, as compressed syntaxes do:

    Basic Offset Table item (FFFE,E000), length 0 or 4 bytes a frame
    one item per frame (FFFE,E000), length the frame's bytes (+1 pad byte if odd)
    ...
    Sequence Delimitation Item (FFFE,E0DD), length 0

Each frame is its own fragment, uncompressed, so frame k's samples start at
``first item + 8 + k * pitch`` with ``pitch = 8 + frame bytes (+ pad)``: the
pixels stay where a ranged GET can put them straight into a ring slot, and the
device copy leaves the 8 bytes between frames behind (``ingest_gpu.transfer``).

``chunk_fragments`` plans the reads as ``planning.chunk_pixels`` does for native
Pixel Data (whole frames per chunk when a frame fits), and each chunk carries
the item headers it must hold (``marks``), which ``check_items`` verifies once
it is read: a fragment that lies about its length is refused, not misread.
"""

from __future__ import annotations

import struct
from typing import Final

from ingest.dicom.syntaxes import ENCAPSULATED_UNCOMPRESSED as ENCAPSULATED_UNCOMPRESSED
from ingest.errors import LimitExceeded, MalformedDicom
from ingest.fetch.planning import ByteRange, PixelChunk
from ingest_gpu.formats import PixelFormat

ITEM_HEADER: Final = 8  # a tag and a 32-bit length
_ITEM: Final = struct.Struct("<HHI")
_ITEM_TAG: Final = (0xFFFE, 0xE000)
_DELIMITER: Final = _ITEM.pack(0xFFFE, 0xE0DD, 0)


def item_header(length: int) -> bytes:
    """An item's 8-byte header: (FFFE,E000) and ``length``."""
    return _ITEM.pack(*_ITEM_TAG, length)


def fragment_length(fmt: PixelFormat) -> int:
    """A frame's item length: its bytes, made even with a pad byte."""
    return fmt.frame_bytes + fmt.frame_bytes % 2


def fragment_pitch(fmt: PixelFormat) -> int:
    """Bytes from one frame's first sample to the next's."""
    return ITEM_HEADER + fragment_length(fmt)


def read_item(data: bytes | memoryview, at: int, what: str) -> int:
    """The length of the item whose header is at ``at``.

    Raises:
        MalformedDicom: not an item there (a Sequence Delimiter, or anything else).
    """
    group, element, length = _ITEM.unpack_from(data, at)
    if (group, element) != _ITEM_TAG:
        raise MalformedDicom(f"{what}: ({group:04X},{element:04X}) where an item should be")
    return int(length)


def check_offset_tables(
    basic: bytes, extended: bytes | None, lengths: bytes | None, fmt: PixelFormat
) -> None:
    """The offset tables, where present, must place frame k at k * pitch (one fragment each).

    ``basic`` is the Basic Offset Table item's value; ``extended`` and ``lengths`` the
    Extended Offset Table (7FE0,0001) and its lengths (7FE0,0002), or None.

    Raises:
        MalformedDicom: a table disagrees with one frame per fragment of this format.
    """
    pitch, frames = fragment_pitch(fmt), fmt.frames
    if basic:
        if len(basic) != 4 * frames:
            raise MalformedDicom(f"Basic Offset Table has {len(basic) // 4} offsets for {frames}")
        if struct.unpack(f"<{frames}I", basic) != tuple(k * pitch for k in range(frames)):
            raise MalformedDicom("Basic Offset Table does not give one fragment a frame")
    if extended is None and lengths is None:
        return
    if basic:
        raise MalformedDicom("both a Basic and an Extended Offset Table")
    if extended is None or lengths is None or len(extended) != 8 * frames != len(lengths):
        raise MalformedDicom("Extended Offset Table and its lengths do not hold a value a frame")
    if struct.unpack(f"<{frames}Q", extended) != tuple(k * pitch for k in range(frames)):
        raise MalformedDicom("Extended Offset Table does not give one fragment a frame")
    if set(struct.unpack(f"<{frames}Q", lengths)) - {fmt.frame_bytes, fragment_length(fmt)}:
        raise MalformedDicom("Extended Offset Table Lengths are not the frames' lengths")


def chunk_fragments(first_item: int, fmt: PixelFormat, part_size: int) -> list[PixelChunk]:
    """Plan the reads of frames held one per fragment, the first item's header at ``first_item``.

    The ranges tile the items from ``first_item`` to the end of the Sequence
    Delimiter (the last chunk's), so a hash of them in order is the object's.
    Whole frames per chunk when one fits a part with room for the delimiter; a
    larger frame is split on sample boundaries (not planar colour).

    Raises:
        LimitExceeded: a planar-colour frame is larger than one part.
        ValueError: ``part_size`` has no room for a sample between two item headers.
    """
    frame, itemsize, per_frame = fmt.frame_bytes, fmt.itemsize, fmt.frame_elements
    length = fragment_length(fmt)
    pitch, header = ITEM_HEADER + length, item_header(length)
    if pitch + ITEM_HEADER <= part_size:
        per = (part_size - ITEM_HEADER) // pitch
        chunks = []
        for k in range(0, fmt.frames, per):
            count = min(per, fmt.frames - k)
            start = first_item + k * pitch
            marks = tuple((j * pitch, header) for j in range(count))
            end = start + count * pitch
            if k + count == fmt.frames:
                marks += ((count * pitch, _DELIMITER),)
                end += ITEM_HEADER
            span = (count - 1) * pitch + frame
            chunks.append(
                PixelChunk(
                    ByteRange(start, end),
                    k * per_frame,
                    count * per_frame,
                    ITEM_HEADER,
                    span,
                    pitch if count > 1 else 0,
                    marks,
                )
            )
        return chunks
    if fmt.planar and fmt.samples > 1:
        raise LimitExceeded(
            f"planar colour frame of {frame} bytes exceeds the part size {part_size}"
        )
    step = (part_size - 2 * ITEM_HEADER - 1) // itemsize * itemsize  # header, pad, delimiter
    if step <= 0:
        raise ValueError(f"part size {part_size} holds no sample between two item headers")
    return [
        _piece(first_item + k * pitch, k, s, min(step, frame - s), fmt, header)
        for k in range(fmt.frames)
        for s in range(0, frame, step)
    ]


def _piece(item: int, k: int, at: int, size: int, fmt: PixelFormat, header: bytes) -> PixelChunk:
    """Bytes ``[at, at + size)`` of frame ``k``'s samples, with what surrounds them."""
    first, last = at == 0, at + size == fmt.frame_bytes
    start = item + (0 if first else ITEM_HEADER + at)
    end = item + ITEM_HEADER + at + size + (fragment_length(fmt) - fmt.frame_bytes if last else 0)
    marks: tuple[tuple[int, bytes], ...] = ((0, header),) if first else ()
    if last and k == fmt.frames - 1:
        marks += ((end - start, _DELIMITER),)
        end += ITEM_HEADER
    first_element = k * fmt.frame_elements + at // fmt.itemsize
    skip = ITEM_HEADER if first else 0
    return PixelChunk(ByteRange(start, end), first_element, size // fmt.itemsize, skip, size)


def check_items(view: memoryview, chunk: PixelChunk) -> None:
    """The item headers (and the Sequence Delimiter) ``chunk``'s bytes must hold are there.

    Raises:
        MalformedDicom: a fragment of another length, or no delimiter after the last.
    """
    for at, expected in chunk.marks:
        found = bytes(view[at : at + ITEM_HEADER])
        if found == expected:
            continue
        where = chunk.range.start + at
        if expected == _DELIMITER:
            raise MalformedDicom(f"no Sequence Delimiter after the last frame's item (at {where})")
        raise MalformedDicom(
            f"the fragment at byte {where} is not one frame of "
            f"{_ITEM.unpack(expected)[2]} bytes (Encapsulated Uncompressed: a frame a fragment)"
        )
