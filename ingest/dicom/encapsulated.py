"""Encapsulated Pixel Data split into frames as its bytes stream in, in bounded memory (pure).

A compressed object of 10-20 GB (a whole-slide image) is read in consecutive
ranges; ``splitter.FrameSplitter`` takes the Pixel Data value's bytes in order and hands
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

from ingest.dicom.splitter import ITEM_HEADER
from ingest.errors import MalformedDicom
from ingest.fetch.planning import ByteRange, split_range


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
