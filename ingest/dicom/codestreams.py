"""Image sizes read from a compressed frame's own header, before it is decoded.

A codestream states the size it decodes to; a frame whose header claims more
samples than the DICOM header's image would make the decoder allocate what the
header never promised, so the codec compares the two before decoding
(``ingest/dicom/codec.py``).
"""

from __future__ import annotations

import struct
from typing import Final

_SOF: Final = frozenset({*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC} | {0xF7})  # JPEG, JPEG-LS


def j2k_size(frame: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG 2000 codestream's SIZ (15444-1 A.5.1)."""
    at = 0
    if frame.startswith(b"\x00\x00\x00\x0cjP  "):  # a JP2 file: find its codestream box
        at = 12
        while at + 8 <= len(frame) and frame[at + 4 : at + 8] != b"jp2c":
            box = int.from_bytes(frame[at : at + 4], "big")
            if box < 8:
                return None
            at += box
        at += 8
    if frame[at : at + 4] != b"\xff\x4f\xff\x51" or len(frame) < at + 42:
        return None
    xsiz, ysiz, xosiz, yosiz = struct.unpack_from(">4I", frame, at + 8)
    (csiz,) = struct.unpack_from(">H", frame, at + 40)
    return max(ysiz - yosiz, 0), max(xsiz - xosiz, 0), csiz


def jpeg_size(frame: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG or JPEG-LS frame header (SOFn, SOF55)."""
    at = 2 if frame.startswith(b"\xff\xd8") else len(frame)
    while at + 4 <= len(frame) and frame[at] == 0xFF:
        marker = frame[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        (length,) = struct.unpack_from(">H", frame, at + 2)
        if marker in _SOF and at + 10 <= len(frame):
            height, width = struct.unpack_from(">HH", frame, at + 5)
            return height, width, frame[at + 9]
        if marker == 0xDA or length < 2:  # a scan before a frame header
            return None
        at += 2 + length
    return None
