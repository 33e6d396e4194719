"""Pure planning: which byte ranges to read, and how Pixel Data splits into chunks.

An object no larger than one part is read with a single GET into one slot and
processed from there. A larger object is read in three kinds of range: a
header prefix (grown on demand up to ``max_header_bytes``), the Pixel Data in
chunks of at most one part each, and whatever trails the Pixel Data (read only
so that the SHA-256 of the whole object is exact). Chunks hold whole frames
whenever a frame fits in a part, so planar colour and per-frame rescale need
no state across chunks; a frame larger than a part is split on sample
boundaries, which elementwise preprocessing allows except for planar colour.
``ingest.dicom.fragments`` plans Encapsulated Uncompressed frames the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ingest.errors import LimitExceeded
from ingest_gpu.formats import PixelFormat

# A large object's first GET: one small ring slot. Enhanced multi-frame headers grow
# with their per-frame functional groups (~95 bytes a frame: 8,190 frames end at
# 775 KB), and every GET more before the first range is a round trip (milliseconds on
# a large object), so the probe holds such a header whole.
HEADER_PROBE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of an object."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def http_range(self) -> str:
        """The HTTP ``Range`` header value (inclusive end)."""
        return f"bytes={self.start}-{self.end - 1}"


@dataclass(frozen=True, slots=True)
class PixelChunk:
    """One part of the Pixel Data: where it lies in the object and which samples it holds.

    Native Pixel Data is the samples alone. Encapsulated Uncompressed
    (``ingest.dicom.fragments``) keeps an item header before each frame: the range then
    starts ``skip`` bytes before its first sample, its samples span ``span``
    bytes, whole frames one every ``pitch`` bytes (0: contiguous), and ``marks``
    are the item headers that must be at those offsets of the range.
    """

    range: ByteRange
    first_element: int
    elements: int
    skip: int = 0
    span: int = -1  # -1: the whole range
    pitch: int = 0
    marks: tuple[tuple[int, bytes], ...] = ()

    def samples(self, view: memoryview) -> memoryview:
        """The bytes of this chunk's samples (and, pitched, what lies between frames)."""
        span = self.range.length if self.span < 0 else self.span
        return view[self.skip : self.skip + span]


def split_range(start: int, end: int, part_size: int) -> list[ByteRange]:
    """Cut ``[start, end)`` into consecutive ranges of at most ``part_size`` bytes."""
    if part_size <= 0:
        raise ValueError("part_size must be positive")
    return [ByteRange(s, min(s + part_size, end)) for s in range(start, end, part_size)]


def first_read(object_size: int, part_size: int, max_header_bytes: int) -> ByteRange:
    """The first GET: the whole object when it fits one part, else a header probe (never
    longer than ``max_header_bytes``, so a header over that bound is still refused)."""
    if object_size <= part_size:
        return ByteRange(0, object_size)
    return ByteRange(0, min(object_size, HEADER_PROBE_BYTES, part_size, max_header_bytes))


def chunk_pixels(pixel_offset: int, fmt: PixelFormat, part_size: int) -> list[PixelChunk]:
    """Plan the Pixel Data reads: whole frames per chunk when a frame fits in a part.

    Raises:
        LimitExceeded: a planar-colour frame is larger than one part.
    """
    itemsize = fmt.itemsize
    if fmt.frame_bytes <= part_size:
        step = (part_size // fmt.frame_bytes) * fmt.frame_elements
    elif fmt.planar and fmt.samples > 1:
        raise LimitExceeded(
            f"planar colour frame of {fmt.frame_bytes} bytes exceeds the part size {part_size}"
        )
    else:
        step = part_size // itemsize
    chunks = []
    for first in range(0, fmt.total_elements, step):
        count = min(step, fmt.total_elements - first)
        start = pixel_offset + first * itemsize
        chunks.append(PixelChunk(ByteRange(start, start + count * itemsize), first, count))
    return chunks
