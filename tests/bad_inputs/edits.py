"""Byte surgery on valid objects: pydicom rewrites (``edit``) and in-place patches of
element headers, lengths, private elements, nested sequences and encapsulated items.

Byte surgery works on explicit VR little endian objects written by
``ingest.embedded.samples``: element headers are 8 bytes (short VRs) or 12 bytes (OB,
OW, SQ, UN ...), Pixel Data is (7FE0,0010) OW with a 32-bit length.
"""

from __future__ import annotations

import struct
import warnings
from io import BytesIO
from typing import Any

from pydicom import dcmread, dcmwrite
from pydicom.dataelem import DataElement


def edit(data: bytes, **changes: Any) -> bytes:
    """``data`` rewritten by pydicom with elements set (``None``: deleted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        for keyword, value in changes.items():
            if value is None:
                delattr(ds, keyword)
            elif isinstance(value, DataElement):
                ds[value.tag] = value
            else:
                setattr(ds, keyword, value)
        out = BytesIO()
        dcmwrite(out, ds, enforce_file_format=True)
    return out.getvalue()


def pixel_tag_at(data: bytes) -> int:
    """Offset of the top-level explicit-VR (7FE0,0010) OB/OW element header."""
    for vr in (b"OW", b"OB"):
        at = data.rfind(b"\xe0\x7f\x10\x00" + vr + b"\0\0")
        if at != -1:
            return at
    raise ValueError("no explicit VR Pixel Data element")


def set_pixel_length(data: bytes, length: int) -> bytes:
    at = pixel_tag_at(data) + 8
    return data[:at] + struct.pack("<I", length) + data[at + 4 :]


def patch_short(data: bytes, tag: int, value: bytes) -> bytes:
    """``data`` with the first short-VR element ``tag`` (after the preamble) holding ``value``."""
    head = struct.pack("<HH", tag >> 16, tag & 0xFFFF)
    at = data.index(head, 132)
    length = struct.unpack_from("<H", data, at + 6)[0]
    return data[: at + 6] + struct.pack("<H", len(value)) + value + data[at + 8 + length :]


def insert_before_pixels(data: bytes, blob: bytes) -> bytes:
    at = pixel_tag_at(data)
    return data[:at] + blob + data[at:]


def private_ob(size: int, group: int = 0x0099) -> bytes:
    """A private creator plus one private OB element of ``size`` bytes (even)."""
    creator = b"DICOM-INGEST TEST"
    creator += b" " * (len(creator) % 2)
    head = struct.pack("<HH2sH", group, 0x0010, b"LO", len(creator)) + creator
    return head + struct.pack("<HH2sHI", group, 0x1000, b"OB", 0, size) + bytes(size)


def meta_with_private_information(data: bytes, size: int) -> bytes:
    """``data`` with a (0002,0102) Private Information OB of ``size`` bytes in its file meta."""
    group_len_at = 132 + 8  # (0002,0000) UL 4 at 132: its value at 140
    meta_len = struct.unpack_from("<I", data, group_len_at)[0]
    meta_end = group_len_at + 4 + meta_len
    uid = b"1.2.3.4\0"
    extra = struct.pack("<HH2sH", 0x0002, 0x0100, b"UI", len(uid)) + uid
    extra += struct.pack("<HH2sHI", 0x0002, 0x0102, b"OB", 0, size) + bytes(size)
    new_len = struct.pack("<I", meta_len + len(extra))
    return (
        data[:group_len_at] + new_len + data[group_len_at + 4 : meta_end] + extra + data[meta_end:]
    )


def padded(data: bytes, *, size: int | None = None, header_end: int | None = None) -> bytes:
    """``data`` with a private OB before Pixel Data, sized so that the object is ``size``
    bytes long, or so that the Pixel Data element header ends at byte ``header_end``."""
    overhead = len(private_ob(0))
    if size is not None:
        grow = size - len(data)
    elif header_end is not None:
        grow = header_end - (pixel_tag_at(data) + 12)
    else:
        raise ValueError("give size or header_end")
    out = insert_before_pixels(data, private_ob(grow - overhead))
    assert len(out) == size or pixel_tag_at(out) + 12 == header_end
    return out


def nested_sequences(levels: int, *, defined: bool) -> bytes:
    """``levels`` nested Request Attributes Sequences (0040,0275), explicit VR LE."""
    if not defined:
        open_ = struct.pack("<HH2sHI", 0x0040, 0x0275, b"SQ", 0, 0xFFFFFFFF)
        item = struct.pack("<HHI", 0xFFFE, 0xE000, 0xFFFFFFFF)
        close = struct.pack("<HHI", 0xFFFE, 0xE00D, 0) + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)
        return (open_ + item) * levels + close * levels
    inner = b""
    for _ in range(levels):
        inner = struct.pack("<HHI", 0xFFFE, 0xE000, len(inner)) + inner
        inner = struct.pack("<HH2sHI", 0x0040, 0x0275, b"SQ", 0, len(inner)) + inner
    return inner


def fragment_at(data: bytes, frame: int) -> int:
    """Where frame ``frame``'s item header is (one fragment a frame, after the Basic
    Offset Table item); ``frame`` = the frame count gives the Sequence Delimiter."""
    table = pixel_tag_at(data) + 12
    length = int(struct.unpack_from("<I", data, table + 4)[0])
    fragment = int(struct.unpack_from("<I", data, table + 8 + length + 4)[0])
    return table + 8 + length + frame * (8 + fragment)


def set_u32(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + struct.pack("<I", value) + data[at + 4 :]
