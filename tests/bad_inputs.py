"""A named corpus of hand-made bad objects and notifications, and a mutator of good ones.

Everything is deterministic and small (the biggest object is ~1.1 MiB, the
biggest notification 2 MiB). Each bad item names the dead-letter reason and
error type the worker must give it. Sizes are chosen against the test
settings: objects up to ``PART_SIZE`` (64 KiB) take the single-GET path,
larger ones the multi-range path (header probe, then ranged Pixel Data), and
``MAX_HEADER_BYTES`` (256 KiB) is the header bound.

Byte surgery works on explicit VR little endian objects written by
``ingest.embedded.samples``: element headers are 8 bytes (short VRs) or 12 bytes (OB,
OW, SQ, UN ...), Pixel Data is (7FE0,0010) OW with a 32-bit length.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from typing import Any, Final, Literal
from urllib.parse import quote_plus

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydicom import dcmread, dcmwrite
from pydicom.dataelem import DataElement

from ingest.embedded import samples
from ingest.errors import (
    IngestError,
    LimitExceeded,
    MalformedDicom,
    NotDicom,
    UnsupportedDicom,
)

PART_SIZE: Final = 64 * 1024
MAX_HEADER_BYTES: Final = 256 * 1024
MIB: Final = 1024 * 1024

ReadPath = Literal["single", "ranged"]


@dataclass(frozen=True, slots=True)
class BadObject:
    """An object that must be dead-lettered with ``error.reason``."""

    name: str
    kind: str  # the family it belongs to, for counting
    data: bytes
    error: type[IngestError]  # the error the parser must raise

    @property
    def reason(self) -> str:
        return self.error.reason

    @property
    def path(self) -> ReadPath:
        return "single" if len(self.data) <= PART_SIZE else "ranged"


@dataclass(frozen=True, slots=True)
class BadNotification:
    """A Kafka record value that is not a usable notification (``None``: a null value)."""

    name: str
    value: bytes | None


@dataclass(frozen=True, slots=True)
class GoodObject:
    """An object that must be processed, announced in ``fmt`` under an awkward ``key``."""

    key: str
    data: bytes
    fmt: str = "aws"  # aws | minio | eventbridge | ceph


# -- byte surgery ----------------------------------------------------------------------


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


def png_bytes() -> bytes:
    return samples.not_dicom()[1]


def tiny_png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


# -- the bases -------------------------------------------------------------------------


def small_base() -> bytes:
    """2 frames of 4 x 3, 16-bit, per-frame rescale: 48 bytes of Pixel Data (single GET)."""
    return samples.synthetic_multiframe(2, 4, 3)


def large_base() -> bytes:
    """12 frames of 128 x 96, 16-bit: ~300 KB, so the multi-range path at 64 KiB parts."""
    return samples.synthetic_multiframe(12, 128, 96)


def ct_small() -> bytes:
    return samples.example_bytes("CT_small.dcm")


def encapsulated_small() -> bytes:
    """Encapsulated Uncompressed, 4 frames of 32 x 32 16-bit with a Basic Offset Table:
    one GET."""
    return samples.synthetic_multiframe(4, 32, 32, encapsulated="basic")


def encapsulated_large() -> bytes:
    """Encapsulated Uncompressed, 40 frames of 64 x 64 16-bit, no offset table: ~330 KB,
    the multi-range path at 64 KiB parts (seven frames a chunk)."""
    return samples.synthetic_multiframe(40, 64, 64, encapsulated="none")


def fragment_at(data: bytes, frame: int) -> int:
    """Where frame ``frame``'s item header is (one fragment a frame, after the Basic
    Offset Table item); ``frame`` = the frame count gives the Sequence Delimiter."""
    table = pixel_tag_at(data) + 12
    length = int(struct.unpack_from("<I", data, table + 4)[0])
    fragment = int(struct.unpack_from("<I", data, table + 8 + length + 4)[0])
    return table + 8 + length + frame * (8 + fragment)


def set_u32(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + struct.pack("<I", value) + data[at + 4 :]


# -- the bad objects -------------------------------------------------------------------


def _not_dicom() -> Iterator[BadObject]:
    rng = np.random.default_rng(20261121)
    text = b"Patient notes: not an image, just text that is long enough.\n" * 40
    yield BadObject("empty", "not-dicom", b"", NotDicom)
    yield BadObject("text", "not-dicom", text, NotDicom)
    yield BadObject("png", "not-dicom", png_bytes(), NotDicom)
    yield BadObject("png-tiny", "not-dicom", tiny_png(), NotDicom)
    yield BadObject("random-4k", "not-dicom", rng.bytes(4096), NotDicom)
    yield BadObject("random-200k", "not-dicom", rng.bytes(200 * 1024), NotDicom)  # ranged
    yield BadObject("zeros-preamble-only", "not-dicom", bytes(128), NotDicom)
    yield BadObject("one-byte", "not-dicom", b"\0", NotDicom)
    # 'DICM' with nothing after it: the parser calls it valid DICOM without an image
    yield BadObject("preamble-dicm-only", "not-dicom", bytes(128) + b"DICM", UnsupportedDicom)
    junk = bytes(128) + b"DICM" + rng.bytes(3000)
    yield BadObject("preamble-dicm-random", "not-dicom", junk, MalformedDicom)


def _truncated() -> Iterator[BadObject]:
    ct = ct_small()  # 39 KB: single GET; file meta ends at 336, Pixel Data tag at 6288
    at = pixel_tag_at(ct)
    yield BadObject("cut-in-meta", "truncated", ct[:210], MalformedDicom)
    yield BadObject("cut-in-dataset", "truncated", ct[:1001], MalformedDicom)
    yield BadObject("cut-in-pixel-element-header", "truncated", ct[: at + 6], MalformedDicom)
    yield BadObject("cut-in-pixels", "truncated", ct[: at + 12 + 100], MalformedDicom)
    small = small_base()  # ends with its Pixel Data
    yield BadObject("cut-last-pixel-byte", "truncated", small[:-1], MalformedDicom)
    yield BadObject("cut-meta-at-element", "truncated", ct[:200], MalformedDicom)
    yield BadObject("cut-at-meta-end", "truncated", ct[:336], MalformedDicom)
    yield BadObject("cut-dataset-at-element", "truncated", ct[:384], MalformedDicom)
    yield BadObject("cut-in-transfer-syntax", "truncated", ct[:264], MalformedDicom)
    big = large_base()  # ~300 KB: ranged
    yield BadObject("ranged-cut-in-pixels", "truncated", big[:200_000], MalformedDicom)
    yield BadObject("cut-at-part-size", "truncated", big[:PART_SIZE], MalformedDicom)  # one GET
    yield BadObject(
        "ranged-cut-at-part-size-plus-2", "truncated", big[: PART_SIZE + 2], MalformedDicom
    )
    yield BadObject("ranged-cut-at-part", "truncated", big[: 2 * PART_SIZE], MalformedDicom)
    yield BadObject("ranged-cut-last-pixel-byte", "truncated", big[:-1], MalformedDicom)
    # a 100 KiB Private Information in the file meta, cut inside it at 80 KiB
    meta = meta_with_private_information(ct, 100 * 1024)
    yield BadObject("ranged-cut-in-meta", "truncated", meta[: 80 * 1024], MalformedDicom)
    # a 100 KiB private OB in the data set, cut inside it at 90 KiB
    padded = insert_before_pixels(ct, private_ob(100 * 1024))
    yield BadObject("ranged-cut-in-dataset", "truncated", padded[: 90 * 1024], MalformedDicom)


def _lying_headers() -> Iterator[BadObject]:
    small, big, ct = small_base(), large_base(), ct_small()
    yield BadObject(
        "pixel-length-past-end", "lying-header", set_pixel_length(small, 0xFFFFFFF0), MalformedDicom
    )
    yield BadObject(
        "ranged-pixel-length-past-end",
        "lying-header",
        set_pixel_length(big, len(big) * 4),
        MalformedDicom,
    )
    yield BadObject(
        "pixel-undefined-length",
        "lying-header",
        set_pixel_length(small, 0xFFFFFFFF),
        MalformedDicom,
    )
    yield BadObject(
        "ranged-pixel-undefined-length",
        "lying-header",
        set_pixel_length(big, 0xFFFFFFFF),
        MalformedDicom,
    )
    at = pixel_tag_at(small)
    yield BadObject(
        "pixel-vr-us", "lying-header", small[: at + 4] + b"US" + small[at + 6 :], MalformedDicom
    )
    # 3.2 GB claimed (4096 x 4096 x 100 x 2 bytes), 48 bytes present
    claims_gb = edit(small, Rows=4096, Columns=4096, NumberOfFrames=100)
    yield BadObject("claims-3gb", "lying-header", claims_gb, MalformedDicom)
    claims_gb_big = edit(big, Rows=4096, Columns=4096, NumberOfFrames=100)
    yield BadObject("ranged-claims-3gb", "lying-header", claims_gb_big, MalformedDicom)
    # 858 GB claimed: past the worker's pixel limit
    claims_tb = edit(small, Rows=65535, Columns=65535, NumberOfFrames=100)
    yield BadObject("claims-858gb", "lying-header", claims_tb, LimitExceeded)
    frames = edit(small, NumberOfFrames=2**31 - 1)  # 51 GB: under the limit, over the object
    yield BadObject("frames-2e31", "lying-header", frames, MalformedDicom)
    absurd = patch_short(small, 0x00280008, b"999999999999")  # IS: 12 characters
    yield BadObject("frames-1e12", "lying-header", absurd, LimitExceeded)
    yield BadObject(
        "frames-negative", "lying-header", edit(small, NumberOfFrames="-5"), MalformedDicom
    )
    yield BadObject(
        "frames-not-a-number",
        "lying-header",
        patch_short(small, 0x00280008, b"PHANTOM "),
        MalformedDicom,
    )
    # rows x columns x frames past 2**32 elements: a 32-bit product would wrap
    wrap32 = edit(small, Rows=65535, Columns=65535, NumberOfFrames=2)
    yield BadObject("elements-past-2e32", "lying-header", wrap32, MalformedDicom)
    # 65535^2 x (2^31-1) x 3 samples x 4 bytes wraps around 2**64
    wrap64 = edit(
        samples.synthetic_rgb(1, 2, 2),
        Rows=65535,
        Columns=65535,
        NumberOfFrames=2**31 - 1,
        BitsAllocated=32,
        BitsStored=32,
    )
    yield BadObject("bytes-past-2e64", "lying-header", wrap64, LimitExceeded)
    for bits, error in ((0, MalformedDicom), (7, MalformedDicom), (64, UnsupportedDicom)):
        data = edit(small, BitsAllocated=bits)
        yield BadObject(f"bits-allocated-{bits}", "lying-header", data, error)
    yield BadObject(
        "samples-per-pixel-2", "lying-header", edit(small, SamplesPerPixel=2), MalformedDicom
    )
    yield BadObject("rows-0", "lying-header", edit(small, Rows=0), MalformedDicom)
    yield BadObject("rows-missing", "lying-header", edit(small, Rows=None), MalformedDicom)
    rows = ct.index(b"\x28\x00\x10\x00US\x02\x00")  # Rows swallowing the rest of the object
    swallow = ct[: rows + 4] + b"OB\0\0" + struct.pack("<I", 0x7FFFFFFF) + ct[rows + 8 :]
    yield BadObject("element-swallows-object", "lying-header", swallow, MalformedDicom)
    slope = patch_short(ct, 0x00281053, b"NaN ")
    yield BadObject("rescale-slope-nan", "lying-header", slope, MalformedDicom)


def _encapsulated() -> Iterator[BadObject]:
    """Encapsulated Uncompressed whose items contradict one frame a fragment."""
    small, big = encapsulated_small(), encapsulated_large()
    kind = "encapsulated"
    for name, base in (("enc", small), ("ranged-enc", big)):
        yield BadObject(
            f"{name}-defined-length", kind, set_pixel_length(base, len(base)), MalformedDicom
        )
        first = fragment_at(base, 0)
        yield BadObject(
            f"{name}-first-fragment-short", kind, set_u32(base, first + 4, 2), MalformedDicom
        )
        middle = fragment_at(base, 3)  # ranged: inside the first chunk; 30: a later chunk
        yield BadObject(f"{name}-frame-3-lies", kind, set_u32(base, middle + 4, 6), MalformedDicom)
        end = fragment_at(base, samples_frames(base))
        no_end = base[:end] + bytes(8) + base[end + 8 :]
        yield BadObject(f"{name}-no-delimiter", kind, no_end, MalformedDicom)
        yield BadObject(f"{name}-cut-before-delimiter", kind, base[:end], MalformedDicom)
        yield BadObject(
            f"{name}-cut-in-fragments", kind, base[: fragment_at(base, 3) + 100], MalformedDicom
        )
    later = fragment_at(big, 30)
    yield BadObject("ranged-enc-frame-30-lies", kind, set_u32(big, later + 4, 8200), MalformedDicom)
    tag = fragment_at(big, 20)
    delimiter_early = big[:tag] + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0) + big[tag + 8 :]
    yield BadObject("ranged-enc-delimiter-at-frame-20", kind, delimiter_early, MalformedDicom)
    table = pixel_tag_at(small) + 12
    yield BadObject("enc-offset-table-lies", kind, set_u32(small, table + 12, 7), MalformedDicom)
    yield BadObject(
        "enc-offset-table-odd-length", kind, set_u32(small, table + 4, 6), MalformedDicom
    )


def samples_frames(data: bytes) -> int:
    """Number of Frames of an ``ingest.embedded.samples`` multi-frame object."""
    at = data.index(b"\x28\x00\x08\x00IS")
    length = struct.unpack_from("<H", data, at + 6)[0]
    return int(data[at + 8 : at + 8 + length])


def _nested() -> Iterator[BadObject]:
    ct, big = ct_small(), large_base()
    for levels in (300, 2000):
        data = insert_before_pixels(ct, nested_sequences(levels, defined=False))
        yield BadObject(f"nested-undefined-{levels}", "nested", data, MalformedDicom)
    data = insert_before_pixels(big, nested_sequences(500, defined=False))
    yield BadObject("ranged-nested-undefined-500", "nested", data, MalformedDicom)


def _limits() -> Iterator[BadObject]:
    # 1 MiB of private OB before Pixel Data: the header passes 256 KiB
    data = insert_before_pixels(ct_small(), private_ob(MIB))
    yield BadObject("header-over-limit", "limit", data, LimitExceeded)
    data = meta_with_private_information(ct_small(), 300 * 1024)
    yield BadObject("meta-over-limit", "limit", data, LimitExceeded)
    # the Pixel Data element header ends 2 bytes past the limit (one at the limit is fine)
    data = padded(ct_small(), header_end=MAX_HEADER_BYTES + 2)
    yield BadObject("header-2-bytes-over-limit", "limit", data, LimitExceeded)


def _unsupported() -> Iterator[BadObject]:
    for name in (
        "JPEG2000.dcm",
        "MR_small_RLE.dcm",
        "JPGExtended.dcm",
        "MR_small_jpeg_ls_lossless.dcm",
        "image_dfl.dcm",  # deflated: must be refused without inflating
        "MR_small_bigendian.dcm",
        "examples_palette.dcm",
        "test-SR.dcm",  # no Pixel Data at all
    ):
        yield BadObject(
            f"pydicom-{name}", "unsupported", samples.example_bytes(name), UnsupportedDicom
        )
    small = small_base()
    at = pixel_tag_at(small)
    floats = small[:at] + struct.pack("<HH2sHI", 0x7FE0, 0x0008, b"OF", 0, 8) + bytes(8)
    yield BadObject("float-pixel-data", "unsupported", floats, UnsupportedDicom)


def bad_objects() -> list[BadObject]:
    """Every bad object, in a fixed order; names are unique."""
    corpus = [
        *_not_dicom(),
        *_truncated(),
        *_lying_headers(),
        *_encapsulated(),
        *_nested(),
        *_limits(),
        *_unsupported(),
    ]
    names = [item.name for item in corpus]
    assert len(set(names)) == len(names), "corpus names must be unique"
    return corpus


# -- good objects under awkward keys ---------------------------------------------------

ODD_KEYS: Final = (
    ("odd keys/with space and+plus.dcm", "aws"),
    ("odd keys/100% literal %41 and %2B.dcm", "aws"),
    ("odd keys/ünïcødé 日本語 🩻.dcm", "aws"),
    ("odd keys/a+b=c&d?e#f;g,h@i$j.dcm", "minio"),
    ("odd keys/eventbridge ü+%.dcm", "eventbridge"),
    ("odd keys/ceph raw+plus %41 ü.dcm", "ceph"),
)


def good_objects() -> list[GoodObject]:
    """Valid objects: both read paths, odd keys in every format, defined-length nesting."""
    ct = samples.synthetic_ct_series(len(ODD_KEYS), rows=64, columns=64, seed=7)
    out = [GoodObject(key, data, fmt) for (key, fmt), (_, data) in zip(ODD_KEYS, ct, strict=True)]
    out.append(GoodObject("good/CT_small.dcm", ct_small()))
    out.append(GoodObject("good/multiframe-ranged.dcm", large_base()))
    out.append(GoodObject("good/rgb-planar.dcm", samples.synthetic_rgb(3, 64, 80, planar=True)))
    out.append(GoodObject("good/rtdose.dcm", samples.example_bytes("rtdose.dcm")))
    out.append(GoodObject("good/encapsulated.dcm", encapsulated_small()))
    out.append(GoodObject("good/encapsulated-ranged.dcm", encapsulated_large()))
    nested = insert_before_pixels(ct_small(), nested_sequences(500, defined=True))
    out.append(GoodObject("good/nested-defined-500.dcm", nested))
    ranged_header = insert_before_pixels(ct_small(), private_ob(150 * 1024))  # under 256 KiB
    out.append(GoodObject("good/header-150k.dcm", ranged_header))
    # the edges: the last single-GET size, the first ranged one, a header right at the limit
    out.append(GoodObject("good/exactly-part-size.dcm", padded(ct_small(), size=PART_SIZE)))
    out.append(GoodObject("good/part-size-plus-2.dcm", padded(ct_small(), size=PART_SIZE + 2)))
    at_limit = padded(ct_small(), header_end=MAX_HEADER_BYTES)
    out.append(GoodObject("good/header-ends-at-limit.dcm", at_limit))
    return out


# -- notifications ---------------------------------------------------------------------


def _record(
    bucket: Any, key: Any, *, source: str = "aws:s3", event: Any = "ObjectCreated:Put", **obj: Any
) -> dict[str, Any]:
    return {
        "eventVersion": "2.1",
        "eventSource": source,
        "eventName": event,
        "eventTime": "2026-11-21T00:00:00.000Z",
        "s3": {"bucket": {"name": bucket}, "object": {"key": key, **obj}},
    }


def notification(fmt: str, bucket: str, key: str, event: str = "ObjectCreated:Put") -> bytes:
    """One object-created notification for ``bucket``/``key`` as ``fmt`` sends it."""
    if fmt == "aws":
        doc: dict[str, Any] = {"Records": [_record(bucket, quote_plus(key), event=event)]}
    elif fmt == "minio":
        escaped = quote_plus(key, safe="")  # Go's url.QueryEscape: '/' too
        record = _record(bucket, escaped, source="minio:s3", event=f"s3:{event}")
        doc = {"EventName": f"s3:{event}", "Key": f"{bucket}/{key}", "Records": [record]}
    elif fmt == "ceph":
        doc = {"Records": [_record(bucket, key, source="ceph:s3", event=event)]}  # raw key
    elif fmt == "eventbridge":
        doc = {
            "version": "0",
            "detail-type": "Object Created" if event.startswith("ObjectCreated") else event,
            "source": "aws.s3",
            "time": "2026-11-21T00:00:00Z",
            "detail": {
                "bucket": {"name": bucket},
                "object": {"key": quote_plus(key)},
                "reason": "PutObject",
            },
        }
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return json.dumps(doc).encode()


def aws_records(bucket: str, keys: list[str], **obj: Any) -> bytes:
    """One AWS notification announcing several objects (``obj``: extra object fields)."""
    return _doc({"Records": [_record(bucket, quote_plus(key), **obj) for key in keys]})


def _doc(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def bad_notifications(bucket: str, key: str) -> list[BadNotification]:
    """Records that must be dead-lettered as ``bad_notification``; ``key`` exists in ``bucket``."""
    good = json.loads(notification("aws", bucket, key))
    padded = dict(good, padding="x" * (2 * MIB))  # a valid notification, 2 MiB long
    # a lone surrogate escape in the key: valid JSON, not valid Unicode
    surrogate = _doc({"Records": [_record(bucket, "PLACEHOLDER")]}).replace(
        b"PLACEHOLDER", b"\\ud800.dcm"
    )
    items = [
        ("not-json", b"{not json"),
        ("not-utf8", b"\xff\xfe\x00\x80 binary garbage \xc3\x28"),
        ("empty-value", b""),
        ("null-value", None),
        ("json-array", b"[1, 2, 3]"),
        ("json-string", b'"ObjectCreated:Put"'),
        ("json-null", b"null"),
        ("unknown-format", _doc({"hello": "world"})),
        ("eventbridge-not-s3", _doc({"detail-type": "Object Created", "source": "aws.ec2"})),
        ("records-not-list", _doc({"Records": "x"})),
        ("records-empty", _doc({"Records": []})),
        ("record-not-object", _doc({"Records": [42]})),
        ("event-name-number", b'{"Records": [{"eventName": 42}]}'),
        ("unknown-event-source", _doc({"Records": [_record(bucket, key, source="gcs")]})),
        ("bucket-name-number", _doc({"Records": [_record(123, key)]})),
        ("bucket-name-invalid", _doc({"Records": [_record("Not..A_Bucket!", key)]})),
        ("bucket-name-ip", _doc({"Records": [_record("192.168.1.1", key)]})),
        ("key-number", _doc({"Records": [_record(bucket, 42)]})),
        ("key-missing", _doc({"Records": [_record(bucket, "")]})),
        ("key-bad-utf8-escape", _doc({"Records": [_record(bucket, "a%FF%FEb.dcm")]})),
        ("key-lone-surrogate", surrogate),
        ("key-too-long", _doc({"Records": [_record(bucket, "k" * 1025)]})),
        ("size-string", _doc({"Records": [_record(bucket, key, size="big")]})),
        ("size-negative", _doc({"Records": [_record(bucket, key, size=-1)]})),
        ("size-huge", _doc({"Records": [_record(bucket, key, size=2**64)]})),
        ("size-bool", _doc({"Records": [_record(bucket, key, size=True)]})),
        ("etag-with-space", _doc({"Records": [_record(bucket, key, eTag="a b")]})),
        (
            "mixed-sources",
            _doc({"Records": [_record(bucket, key), _record(bucket, key, source="ceph:s3")]}),
        ),
        ("json-deeply-nested", b"[" * 200_000 + b"]" * 200_000),
        ("json-huge-integer", b'{"Records": [' + b"9" * 5000 + b"]}"),
        ("over-1mib", b'{"x": "' + b"y" * MIB + b'"}'),
        ("valid-but-2mib", _doc(padded)),
        # past the consumer's max_partition_fetch_bytes (4 MiB): must not stall the partition
        ("over-4mib-fetch-limit", b'{"x": "' + b"y" * (5 * MIB) + b'"}'),
    ]
    return [BadNotification(name, value) for name, value in items]


def skipped_notifications(bucket: str, key: str) -> list[tuple[str, bytes]]:
    """Records that announce no new content: skipped and counted, never dead-lettered.

    Returns (name, value) pairs; ``key`` exists, so processing one would be visible.
    """
    minio = json.loads(notification("minio", bucket, key))

    def minio_event(event: str) -> bytes:
        doc = json.loads(json.dumps(minio))
        doc["EventName"] = doc["Records"][0]["eventName"] = event
        return _doc(doc)

    return [
        ("aws-object-removed", notification("aws", bucket, key, "ObjectRemoved:Delete")),
        ("aws-restore-completed", notification("aws", bucket, key, "ObjectRestore:Completed")),
        ("minio-object-accessed", minio_event("s3:ObjectAccessed:Get")),
        ("minio-put-tagging", minio_event("s3:ObjectCreated:PutTagging")),
        ("minio-put-retention", minio_event("s3:ObjectCreated:PutRetention")),
        ("eventbridge-object-deleted", notification("eventbridge", bucket, key, "Object Deleted")),
        ("ceph-object-removed", notification("ceph", bucket, key, "ObjectRemoved:Delete")),
        ("s3-test-event", _doc({"Service": "Amazon S3", "Event": "s3:TestEvent"})),
    ]


# -- mutations of a valid object (hypothesis) ------------------------------------------

# single GET, single GET, ranged, ranged Encapsulated Uncompressed
MUTATION_BASES: Final = (small_base, ct_small, large_base, encapsulated_large)
MUTATION_KINDS: Final = ("flip", "set", "insert", "delete", "truncate")


@st.composite
def mutated_object(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with 1-4 byte flips, sets, insertions, deletions or a truncation.

    Half the positions fall in the header (up to the Pixel Data element header),
    where a change can mislead the parser; the rest is mostly Pixel Data.
    """
    data = bytearray(base)
    header_end = pixel_tag_at(base) + 12
    for _ in range(draw(st.integers(1, 4))):
        limit = draw(st.sampled_from([min(len(data), header_end), len(data)]))
        mutate(draw, data, draw(st.integers(0, limit)))
    return bytes(data)


def mutate(draw: st.DrawFn, data: bytearray, at: int) -> None:
    """One random edit of ``data`` at ``at``: a bit flip, a byte set, an insertion,
    a deletion or a truncation (``MUTATION_KINDS``)."""
    kind = draw(st.sampled_from(MUTATION_KINDS))
    if kind == "flip" and at < len(data):
        data[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "set" and at < len(data):
        data[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x20]))
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=12))
    elif kind == "delete":
        del data[at : at + draw(st.integers(1, 40))]
    elif kind == "truncate":
        del data[at:]


def mutations(per_base: int) -> list[bytes]:
    """Distinct mutants of each of ``MUTATION_BASES`` (up to ``per_base`` each), fixed per run.

    Hypothesis draws them (``derandomize``: the same examples every run, so a
    failure reproduces); the caller runs the whole list through one worker, so
    the worker starts once however many there are.
    """
    found: dict[bytes, None] = {}
    for make in MUTATION_BASES:
        base = make()

        @settings(
            max_examples=per_base,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(mutated_object(base))
        def collect(data: bytes) -> None:
            found[data] = None

        collect()
        found.pop(base, None)
    return list(found)
