"""A named corpus of hand-made bad objects and notifications, and a mutator of good ones.

Compressed objects of every syntax the worker decodes have their own family
(``compressed_cases``: codestreams and encapsulated items broken in each way the
worker must survive, with what must come of each) and mutator
(``mutated_compressed``), and ``decode_as_worker`` decodes one in this process
the way the worker does.

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

import copy
import functools
import json
import struct
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, Final, Literal
from urllib.parse import quote_plus

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydicom import dcmread, dcmwrite
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.encaps import generate_frames
from pydicom.uid import UID, JPEGBaseline8Bit, RLELossless

from ingest.dicom.codec import decode_encapsulated
from ingest.dicom.parse import DicomHeader
from ingest.dicom.syntaxes import is_compressed
from ingest.embedded import samples
from ingest.embedded.samples_compressed import CT_SYNTAXES, compressed_ct
from ingest.embedded.samples_slide import jpeg_slide_bytes, write_fragments
from ingest.errors import (
    IngestError,
    LimitExceeded,
    MalformedDicom,
    NotDicom,
    UnsupportedDicom,
)
from ingest.fetch.planning import ByteRange, first_read
from ingest.pipeline.decoded import compressed_frames, frame_groups
from ingest.pipeline.large import header_or_more
from ingest.pipeline.process import whole_header
from ingest.pipeline.streamed import frame_stream

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
    syntax: str | None = None  # a compressed object's: its dead letter must name it

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


# pydicom's sample files of the syntaxes and pixel semantics the worker now decodes
DECODED_SAMPLES: Final = (
    "JPEG2000.dcm",
    "MR_small_RLE.dcm",
    "JPGExtended.dcm",
    "MR_small_jpeg_ls_lossless.dcm",
    "MR_small_bigendian.dcm",
    "examples_palette.dcm",
    "image_dfl.dcm",  # Deflated: inflated as it is read (bad ones: ``deflated_cases``)
)


def _unsupported() -> Iterator[BadObject]:
    for name in ("test-SR.dcm",):  # no Pixel Data at all
        yield BadObject(
            f"pydicom-{name}", "unsupported", samples.example_bytes(name), UnsupportedDicom
        )
    small = small_base()
    at = pixel_tag_at(small)
    floats = small[:at] + struct.pack("<HH2sHI", 0x7FE0, 0x0008, b"OF", 0, 8) + bytes(8)
    yield BadObject("float-pixel-data", "unsupported", floats, UnsupportedDicom)


# -- deflated objects ------------------------------------------------------------------
#
# Deflated Explicit VR Little Endian: the data set after the file meta is one raw deflate
# stream (``deflate_file`` writes one as pydicom does, from pieces, so a data set of
# hundreds of MiB of zeros is never held). The worker reads such an object in order and
# inflates it a step at a time (``ingest/pipeline/inflated.py``); these are what it must
# refuse, naming the syntax, in bounded memory and time, and what it must process.

DEFLATED: Final = "1.2.840.10008.1.2.1.99"
BOMB_BYTES: Final = 64 * MIB  # zeros inflated from ~65 KB
_ZEROS: Final = bytes(MIB)


def zeros(size: int) -> Iterator[bytes]:
    """``size`` zero bytes, a MiB at a time (the same MiB object each time)."""
    whole, rest = divmod(size, MIB)
    for _ in range(whole):
        yield _ZEROS
    if rest:
        yield bytes(rest)


def meta_end(data: bytes) -> int:
    """Where the data set starts: after the file meta, by its Group Length (0002,0000)."""
    return 144 + int(struct.unpack_from("<I", data, 140)[0])


def deflate_file(data: bytes, data_set: Sequence[bytes] | Iterator[bytes] | None = None) -> bytes:
    """``data`` (Explicit VR Little Endian, with a file meta Group Length) as Deflated
    Explicit VR Little Endian: its file meta naming that syntax, then the raw deflate
    stream of its data set (or of ``data_set``, deflated piece by piece), padded to even
    as pydicom pads it."""
    end = meta_end(data)
    meta = data[132:end]
    at = meta.index(b"\x02\x00\x10\x00UI")
    old = struct.unpack_from("<H", meta, at + 6)[0]
    uid = DEFLATED.encode()  # 22 bytes: even
    meta = meta[: at + 6] + struct.pack("<H", len(uid)) + uid + meta[at + 8 + old :]
    meta = meta[:8] + struct.pack("<I", len(meta) - 12) + meta[12:]
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    stream = bytearray()
    for piece in [data[end:]] if data_set is None else data_set:
        stream += deflater.compress(piece)
    stream += deflater.flush()
    if len(stream) % 2:
        stream += b"\0"
    return data[:132] + meta + bytes(stream)


def noisy_large() -> bytes:
    """``large_base`` with random 16-bit samples (Bits Stored 12: pydicom masks them): ~300
    KB that deflate barely shrinks, so the Deflated object is read in ranges."""
    data = large_base()
    value = pixel_tag_at(data) + 12
    length = int(struct.unpack_from("<I", data, value - 4)[0])
    noise = np.random.default_rng(99).bytes(length)
    return data[:value] + noise + data[value + length :]


def _first_failing_flip(data: bytes, start: int) -> bytes:
    """``data`` with one stream byte inverted, the first from ``start`` on that zlib refuses."""
    body = meta_end(data)
    for at in range(start, len(data)):
        flipped = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        try:
            zlib.decompress(flipped[body:], -zlib.MAX_WBITS)
        except zlib.error:
            return flipped
    raise AssertionError("no flip that zlib refuses")


@functools.cache
def deflated_goods() -> tuple[tuple[str, bytes], ...]:
    """Deflated objects that must be processed: one GET and ranged, and one whose 64 MiB
    of trailing padding inflates from ~65 KB (inflated, thrown away, in bounded memory)."""
    ct, noisy = ct_small(), noisy_large()
    trailer = struct.pack("<HH2sHI", 0xFFFC, 0xFFFC, b"OB", 0, BOMB_BYTES)
    padded_bomb = deflate_file(ct, [ct[meta_end(ct) :], trailer, *zeros(BOMB_BYTES)])
    return (
        ("ct-small", deflate_file(ct)),
        ("ranged-multiframe-noise", deflate_file(noisy)),
        ("multiframe-per-frame-rescale", deflate_file(large_base())),
        ("padding-bomb", padded_bomb),
    )


@functools.cache
def deflated_cases() -> tuple[BadObject, ...]:
    """Deflated objects the worker must refuse, naming the syntax: cut, corrupt, trailed by
    garbage, bombs (a header that inflates past ``MAX_HEADER_BYTES``, Pixel Data that the
    stored stream could never inflate to), a data set that ends inside its Pixel Data or
    before its Pixel Data element's length, file meta elements inside the data set."""
    ct, noisy = ct_small(), noisy_large()
    small, big = deflate_file(ct), deflate_file(noisy)
    body = meta_end(small)
    at, value = pixel_tag_at(ct), pixel_tag_at(ct) + 12
    block = small[body] | 0b110  # BTYPE 11: a reserved block type
    header_bomb = [ct[meta_end(ct) : at], private_ob(0)[:-8]]  # the creator; then its OB
    header_bomb += [struct.pack("<HH2sHI", 0x0099, 0x1000, b"OB", 0, BOMB_BYTES)]
    header_bomb += [*zeros(BOMB_BYTES), ct[at:]]
    frames = 100_000  # 2.46 GB of Pixel Data declared, its element's length agreeing
    lying = edit(noisy, NumberOfFrames=frames, PerFrameFunctionalGroupsSequence=None)
    lying = set_pixel_length(lying, frames * 128 * 96 * 2)
    cases = [
        ("deflated-cut-in-stream", small[: len(small) // 2]),
        ("deflated-cut-in-header", small[: body + 200]),
        ("ranged-deflated-cut-in-stream", big[: len(big) * 2 // 3]),
        ("deflated-corrupt-block-type", small[:body] + bytes([block]) + small[body + 1 :]),
        ("deflated-corrupt-mid-stream", _first_failing_flip(small, len(small) // 3)),
        ("ranged-deflated-corrupt", _first_failing_flip(big, len(big) // 2)),
        ("deflated-trailing-garbage", small + b"trailing garbage after the stream!"),
        ("deflated-data-set-cut-in-pixels", deflate_file(ct[: value + 1000])),
        ("ranged-deflated-data-set-cut-in-pixels", deflate_file(noisy[:200_000])),
        ("ranged-deflated-pixel-length-past-end", deflate_file(set_pixel_length(noisy, 400_000))),
        ("deflated-meta-in-data-set", deflate_file(ct, [ct[144:body], ct[body:]])),
        ("deflated-declares-2-gb", deflate_file(lying)),
    ]
    out = [BadObject(name, "deflated", data, MalformedDicom, DEFLATED) for name, data in cases]
    # the object ends where its file meta does: the parser finds that before the syntax
    out.append(BadObject("deflated-cut-after-meta", "deflated", small[:body], MalformedDicom))
    bomb = deflate_file(ct, header_bomb)
    out.append(BadObject("deflated-header-bomb", "deflated", bomb, LimitExceeded, DEFLATED))
    return tuple(out)


# -- compressed objects: every syntax the worker decodes, broken ----------------------
#
# Each base is a compressed object taken apart (header, one codestream a frame) and
# written back whole or with one thing changed: a frame's codestream (cut, zeroed,
# flipped, replaced, a frame header that lies), Number of Frames, the offset tables,
# the items or their delimiter, or the transfer syntax. The bases: three 64 x 64 CT
# slices in each of ``CT_SYNTAXES`` and a JPEG-tiled slide of 3 x 2 tiles of 64 (all
# one GET), and a slide of 6 x 5 tiles (~91 KB: the streamed path, which splits
# frames with ``FrameSplitter`` as ranges arrive). What must come of each
# (``_DECODES``, ``_REFUSED``, else MalformedDicom) was found by running them, and
# checked to be right: what cannot be decoded is refused; what decodes gives pydicom's
# values (not bad, then: processed). Known product bugs are in ``_BUGS``.

COMPRESSED_SIZE: Final = 64  # rows and columns of a compressed CT frame and a slide tile
OffsetChoice = Literal["basic", "extended", "none"]
Outcome = type[IngestError] | None  # None: decodes, to what pydicom's pixel_array gives
_ITEM_TAG: Final = b"\xfe\xff\x00\xe0"
_JPEG_SOF: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xF7}  # + JPEG-LS
_UNSUPPORTED: Final = (  # transfer syntaxes with pixel data the worker has no decoder for
    "1.2.840.10008.1.2.4.110",  # JPEG XL Lossless (pydicom 3.0 does not know its name)
    "1.2.840.10008.1.2.4.100",  # MPEG2 Main Profile / Main Level
    "1.2.840.10008.1.2.4.94",  # JPIP Referenced
    "1.2.840.10008.1.2.4.52",  # JPEG Extended (Process 3 and 5), retired
    "1.2.840.10008.1.2.4.107",  # HEVC/H.265 Main Profile
)


@dataclass(frozen=True)
class CompressedBase:
    """A compressed object taken apart: its header (no Pixel Data) and each frame's
    codestream, written back (``write``) with frames, tables or counts changed."""

    name: str
    syntax: str
    header: Dataset
    frames: tuple[bytes, ...]
    target: int  # the frame whose codestream a mutation changes

    def write(
        self, frames: Sequence[bytes] | None = None, offsets: OffsetChoice = "basic"
    ) -> bytes:
        """The object with ``frames`` (default: its own), one fragment each, and ``offsets``."""
        frames = self.frames if frames is None else frames
        ds = copy.deepcopy(self.header)
        ds.NumberOfFrames = len(frames)
        lengths = np.array([len(frame) for frame in frames], dtype=np.int64)
        out = BytesIO()
        write_fragments(out, ds, frames, lengths, offsets)
        return out.getvalue()

    def with_target(self, frame: bytes) -> bytes:
        """The object with its target frame's codestream replaced by ``frame``."""
        k = self.target
        return self.write([*self.frames[:k], frame, *self.frames[k + 1 :]])


def _taken_apart(data: bytes) -> tuple[Dataset, list[bytes]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        count = int(ds.get("NumberOfFrames") or 1)
        frames = [bytes(f) for f in generate_frames(ds.PixelData, number_of_frames=count)]
        del ds.PixelData
    return ds, frames


@functools.cache
def compressed_base(syntax: str) -> CompressedBase:
    """Three 64 x 64 CT slices (``compressed_ct``, slices 0-2) in ``syntax``; mutations
    change the middle one."""
    header, _ = _taken_apart(compressed_ct(syntax, 0, COMPRESSED_SIZE, COMPRESSED_SIZE))
    frames = tuple(
        _taken_apart(compressed_ct(syntax, k, COMPRESSED_SIZE, COMPRESSED_SIZE))[1][0]
        for k in range(3)
    )
    return CompressedBase(f"ct-{UID(syntax).keyword}", syntax, header, frames, target=1)


@functools.cache
def slide_base(ranged: bool) -> CompressedBase:
    """A JPEG baseline (YBR_FULL_422) slide of 64 x 64 tiles: 3 x 2 (~20 KB, one GET), or
    6 x 5 (~91 KB: ranged; mutations change tile 25, in the second range)."""
    across, down = (6, 5) if ranged else (3, 2)
    data = jpeg_slide_bytes(
        tiles_across=across, tiles_down=down, tile=COMPRESSED_SIZE, distinct=across * down
    )
    header, frames = _taken_apart(data)
    name = "ranged-slide" if ranged else "slide"
    return CompressedBase(name, JPEGBaseline8Bit, header, tuple(frames), 25 if ranged else 1)


def compressed_bases() -> list[CompressedBase]:
    """One base a syntax of ``CT_SYNTAXES``, then the two slides."""
    return [*(compressed_base(s) for s in CT_SYNTAXES), slide_base(False), slide_base(True)]


def items_of(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(where, length) of each item of the encapsulated Pixel Data (the Basic Offset Table
    first), and where the Sequence Delimiter is."""
    at, found = pixel_tag_at(data) + 12, []
    while data[at : at + 4] == _ITEM_TAG:
        length = int(struct.unpack_from("<I", data, at + 4)[0])
        found.append((at, length))
        at += 8 + length
    return found, at


def meta_syntax(data: bytes) -> str:
    """The Transfer Syntax UID in ``data``'s file meta."""
    at = data.index(b"\x02\x00\x10\x00UI", 132)
    length = struct.unpack_from("<H", data, at + 6)[0]
    return data[at + 8 : at + 8 + length].rstrip(b"\0 ").decode()


def relabelled(data: bytes, syntax: str) -> bytes:
    """``data`` with its file meta's Transfer Syntax UID replaced (group length fixed)."""
    value = syntax.encode() + b"\0" * (len(syntax) % 2)
    at = data.index(b"\x02\x00\x10\x00UI", 132)
    old = struct.unpack_from("<H", data, at + 6)[0]
    out = data[: at + 6] + struct.pack("<H", len(value)) + value + data[at + 8 + old :]
    group = struct.unpack_from("<I", out, 140)[0]  # (0002,0000)'s value
    return set_u32(out, 140, group + len(value) - old)


def codestream_header_end(frame: bytes) -> int:
    """Where a frame's codestream header ends: JPEG (-LS) at its first scan's data, JPEG 2000
    at its first tile-part, RLE after its 64-byte header."""
    if frame[:2] == b"\xff\xd8":
        at = 2
        while at + 4 <= len(frame) and frame[at] == 0xFF:
            length = int(struct.unpack_from(">H", frame, at + 2)[0])
            if frame[at + 1] == 0xDA:
                return min(at + 2 + length, len(frame))
            at += 2 + length
        return min(at, len(frame))
    if frame[:2] == b"\xff\x4f":
        at = frame.find(b"\xff\x90")
        return at if at > 0 else len(frame)
    return min(64, len(frame))


def _sof_at(frame: bytes) -> int:
    """Where a JPEG (-LS) frame's SOF marker segment is."""
    at = 2
    while at + 4 <= len(frame) and frame[at] == 0xFF:
        if frame[at + 1] in _JPEG_SOF:
            return at
        at += 2 + struct.unpack_from(">H", frame, at + 2)[0]
    raise ValueError("no SOF marker segment")


def claims_size(frame: bytes, rows: int, columns: int) -> bytes | None:
    """The codestream with its frame header saying ``rows`` x ``columns`` (JPEG's SOF,
    JPEG 2000's SIZ with no image offset); None for RLE, which has no size to state."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame)
        return frame[: at + 5] + struct.pack(">HH", rows, columns) + frame[at + 9 :]
    if frame[:2] == b"\xff\x4f":  # SOC, SIZ: Lsiz, Rsiz, then Xsiz, Ysiz, XOsiz, YOsiz
        return frame[:8] + struct.pack(">IIII", columns, rows, 0, 0) + frame[24:]
    return None


def claims_components(frame: bytes) -> bytes:
    """The codestream claiming one component more than it has (RLE: a first segment
    starting past the frame's end)."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame) + 9
        return frame[:at] + bytes([frame[at] + 1]) + frame[at + 1 :]
    if frame[:2] == b"\xff\x4f":  # Csiz at 40
        count = struct.unpack_from(">H", frame, 40)[0]
        return frame[:40] + struct.pack(">H", count + 1) + frame[42:]
    return frame[:4] + struct.pack("<I", 0x7FFFFFF0) + frame[8:]


def claims_precision(frame: bytes) -> bytes:
    """The codestream claiming another sample precision: JPEG 16 bits (the CT's are 12,
    the slide's 8), JPEG 2000 unsigned samples (the CT's are signed); RLE 15 segments."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame) + 4
        return frame[:at] + b"\x10" + frame[at + 1 :]
    if frame[:2] == b"\xff\x4f":  # Ssiz of the first component at 42: bit 7 the sign
        return frame[:42] + bytes([frame[42] & 0x7F]) + frame[43:]
    return struct.pack("<I", 15) + frame[4:]


def _codestream_mutants(b: CompressedBase) -> Iterator[tuple[str, str, bytes]]:
    frame = b.frames[b.target]
    third = len(frame) // 3
    zeroed = frame[:third] + bytes(third) + frame[2 * third :]
    flipped = bytearray(frame)
    for at in range(len(frame) // 4, 3 * len(frame) // 4, 37):
        flipped[at] ^= 0x10
    noise = np.random.default_rng(len(frame)).bytes(len(frame))
    yield "codestream-cut", "corrupt", b.with_target(frame[: len(frame) // 2])
    yield "codestream-zeroed", "corrupt", b.with_target(zeroed)
    yield "codestream-flipped", "corrupt", b.with_target(bytes(flipped))
    yield "codestream-random", "corrupt", b.with_target(noise)
    yield "codestream-header-only", "corrupt", b.with_target(frame[: codestream_header_end(frame)])
    size = COMPRESSED_SIZE
    claims = (
        ("claims-larger", 65535, 65535),
        ("claims-smaller", 32, 32),
        ("claims-height-0", 0, size),
    )
    for name, rows, columns in claims:
        changed = claims_size(frame, rows, columns)
        if changed is not None:
            yield name, "claims", b.with_target(changed)
    yield "claims-components", "claims", b.with_target(claims_components(frame))
    yield "claims-precision", "claims", b.with_target(claims_precision(frame))
    # the DICOM header claims frames of 12288 x 12288 (288 MiB or more decoded each)
    yield "header-claims-larger", "claims", edit(b.write(), Rows=12288, Columns=12288)


def _structure_mutants(b: CompressedBase) -> Iterator[tuple[str, str, bytes]]:
    n, k = len(b.frames), b.target
    good = b.write()
    items, delimiter = items_of(good)
    tables: tuple[OffsetChoice, ...] = ("basic", "extended", "none")
    for table_kind in tables:
        data = b.write(offsets=table_kind)
        yield f"frames-more-{table_kind}", "frame-count", edit(data, NumberOfFrames=n + 1)
        yield f"frames-fewer-{table_kind}", "frame-count", edit(data, NumberOfFrames=n - 1)
    one = b.write(b.frames[:1])
    yield "one-frame-claims-2", "frame-count", edit(one, NumberOfFrames=2)
    yield "frames-1e12", "frame-count", patch_short(good, 0x00280008, b"999999999999")
    table = items[0][0] + 8
    offsets = struct.unpack_from(f"<{n}I", good, table)
    yield "bot-mid-item", "offset-table", set_u32(good, table + 4 * k, offsets[k] + 2)
    yield "bot-past-end", "offset-table", set_u32(good, table + 4 * (n - 1), 0x7FFFFFF0)
    swapped = set_u32(set_u32(good, table + 4 * k, offsets[k + 1]), table + 4 * (k + 1), offsets[k])
    yield "bot-swapped", "offset-table", swapped
    yield "bot-not-rising", "offset-table", set_u32(good, table + 4 * (k + 1), offsets[k])
    yield "bot-not-from-zero", "offset-table", set_u32(good, table, 8)
    yield "bot-odd-length", "offset-table", set_u32(good, table - 4, 4 * n - 2)
    eot = b.write(offsets="extended")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(eot))
    starts = np.frombuffer(ds.ExtendedOffsetTable, "<u8").copy()
    lengths = np.frombuffer(ds.ExtendedOffsetTableLengths, "<u8").copy()

    def eot_with(name: str, at: int, value: int, table: str = "offsets") -> tuple[str, str, bytes]:
        changed = (starts if table == "offsets" else lengths).copy()
        changed[at] = value
        field = "ExtendedOffsetTable" if table == "offsets" else "ExtendedOffsetTableLengths"
        return name, "extended-offset-table", edit(eot, **{field: changed.tobytes()})

    yield eot_with("eot-mid-item", k, int(starts[k]) + 2)
    yield eot_with("eot-not-rising", k, int(starts[k + 1]))
    yield eot_with("eot-past-end", n - 1, 2**40)
    yield eot_with("eot-length-past-item", k, int(lengths[k]) + 100, "lengths")
    yield eot_with("eot-length-short", k, int(lengths[k]) // 2, "lengths")
    yield eot_with("eot-length-huge", k, 2**40, "lengths")
    fewer = {"ExtendedOffsetTable": starts[:-1].tobytes()}
    fewer["ExtendedOffsetTableLengths"] = lengths[:-1].tobytes()
    yield "eot-too-few", "extended-offset-table", edit(eot, **fewer)
    # (an Extended Offset Table without its lengths is left out: the worker ignores
    # the table, pydicom's pixel_array fails on it, so there is nothing to compare)
    at, length = items[1 + k]
    yield "object-cut-mid-frame", "delimiter", good[: at + 8 + length // 2]
    yield "cut-before-delimiter", "delimiter", good[:delimiter]
    yield "no-delimiter", "delimiter", good[:delimiter] + bytes(8) + good[delimiter + 8 :]
    yield "item-tag-is-delimitation", "item", good[:at] + b"\xfe\xff\x0d\xe0" + good[at + 4 :]
    yield "item-tag-is-pixel-data", "item", good[:at] + b"\xe0\x7f\x10\x00" + good[at + 4 :]
    yield "item-undefined-length", "item", set_u32(good, at + 4, 0xFFFFFFFF)
    yield "item-length-past-end", "item", set_u32(good, at + 4, 0x7FFFFFF0)
    empty = struct.pack("<HHI", 0xFFFE, 0xE000, 0)
    yield "empty-fragment-frame", "empty-fragment", b.with_target(b"")
    empty_tables: tuple[OffsetChoice, ...] = ("none", "basic")
    for table_kind in empty_tables:
        data = b.write(offsets=table_kind)
        found, end = items_of(data)
        first = found[1][0]
        yield (
            f"empty-fragment-first-{table_kind}",
            "empty-fragment",
            data[:first] + empty + data[first:],
        )
        yield (
            f"empty-fragment-extra-{table_kind}",
            "empty-fragment",
            data[:end] + empty + data[end:],
        )


def _syntax_mutants(b: CompressedBase, index: int) -> Iterator[tuple[str, str, bytes]]:
    good = b.write()
    yield (
        "labelled-unsupported",
        "syntax",
        relabelled(good, _UNSUPPORTED[index % len(_UNSUPPORTED)]),
    )
    other: dict[str, str] = {
        RLELossless: "1.2.840.10008.1.2.4.80",  # RLE segments read as JPEG-LS
        **dict.fromkeys((*CT_SYNTAXES[1:4], JPEGBaseline8Bit), "1.2.840.10008.1.2.4.90"),
        **dict.fromkeys(CT_SYNTAXES[4:6], RLELossless),
        **dict.fromkeys(CT_SYNTAXES[6:], "1.2.840.10008.1.2.4.57"),
    }
    yield "labelled-other-codec", "syntax", relabelled(good, other[b.syntax])


_CT: Final = tuple(f"ct-{UID(syntax).keyword}" for syntax in CT_SYNTAXES)
_RLE, _SV1, _LOSSLESS, _EXTENDED, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, *_HTJ2K = _CT
_SINGLE: Final = frozenset({*_CT, "slide"})  # the bases that fit one GET
# (base, mutation) pairs that decode, where pydicom's pixel_array decodes them alike;
# every other mutant is refused, MalformedDicom unless ``_REFUSED`` says otherwise
_DECODES: Final[dict[str, frozenset[str]]] = {
    "codestream-zeroed": frozenset(
        {_SV1, _LOSSLESS, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, "slide", "ranged-slide"}
    ),
    "codestream-flipped": frozenset(
        {_RLE, _SV1, _LOSSLESS, _EXTENDED, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, "ranged-slide"}
    ),
    "claims-precision": frozenset(_CT) - {_EXTENDED},  # RLE: 15 segments, 2 of them read
    "bot-not-rising": _SINGLE,  # pydicom's frames: the fragments between the offsets
    "bot-not-from-zero": _SINGLE,
    "eot-not-rising": frozenset({_RLE, _LOSSLESS, *_HTJ2K, "slide"}),  # frame 2's stream
    "eot-length-past-item": frozenset({_RLE}),  # the length is cut at the item's end
    "eot-length-huge": frozenset({_RLE, _SV1, _LOSSLESS, _JLS, _HTJ2K[2]}),
    "empty-fragment-first-basic": _SINGLE,
    # RLE has no end marker to end a frame at
    "empty-fragment-first-none": _SINGLE - {_RLE} | {"ranged-slide"},
    "empty-fragment-extra-basic": _SINGLE | {"ranged-slide"},
}
_REFUSED: Final[dict[tuple[str, str], type[IngestError]]] = {
    **{(base, "labelled-unsupported"): UnsupportedDicom for base in (*_SINGLE, "ranged-slide")},
    ("ranged-slide", "eot-length-huge"): LimitExceeded,  # a frame over the splitter's bound
    ("ranged-slide", "item-length-past-end"): LimitExceeded,
    **{(b, "header-claims-larger"): LimitExceeded for b in (*_SINGLE, "ranged-slide")},
}
# Where the worker's output differs from pixel_array on purpose: xfail(strict) in the tests
# and left out of the worker run. The worker decodes each frame as its own codestream says
# (pydicom's pixel_array(ds, index=k)); pydicom's whole-object decode carries state.
BUG_FRAME_STATE: Final = (
    "frames decode one by one, pydicom's pixel_array carries state from frame to frame"
    " (the last codestream's precision / signedness for every frame; after a frame only"
    " another plugin decodes, the following frames by that plugin): the arrays differ"
)
# a JPEG or JPEG-LS frame height of 0 once made libjpeg and CharLS grow memory until it ran
# out: these mutants decode in a process of their own, under an address-space limit
ISOLATED_MUTATIONS: Final = frozenset({"claims-height-0"})
_BUGS: Final = {
    **{(b, "claims-precision"): BUG_FRAME_STATE for b in (_JLS, _JLS_NEAR, _J2K, _J2K_LOSSY)},
    ("ranged-slide", "codestream-flipped"): BUG_FRAME_STATE,  # tiles 26-29 by Pillow
}


@dataclass(frozen=True, slots=True)
class CompressedCase:
    """A mutant of a compressed base and what must come of it (``error`` None: it decodes,
    to what pydicom's ``pixel_array`` gives)."""

    base: str
    mutation: str
    kind: str  # the mutation's family
    syntax: str
    data: bytes
    error: Outcome
    bug: str | None = None  # a known product bug: xfail(strict), not in the worker run

    @property
    def name(self) -> str:
        return f"{self.base}-{self.mutation}"


@functools.cache
def compressed_cases() -> tuple[CompressedCase, ...]:
    """Every mutant of every compressed base, in a fixed order; names are unique."""
    cases = []
    for index, base in enumerate(compressed_bases()):
        mutants = [
            *_codestream_mutants(base),
            *_structure_mutants(base),
            *_syntax_mutants(base, index),
        ]
        for mutation, kind, data in mutants:
            key = (base.name, mutation)
            bug = _BUGS.get(key)
            error: Outcome = _REFUSED.get(key, MalformedDicom)
            if base.name in _DECODES.get(mutation, ()):
                error = None
            syntax = meta_syntax(data)
            cases.append(CompressedCase(base.name, mutation, kind, syntax, data, error, bug))
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), "compressed case names must be unique"
    return tuple(cases)


def _compressed() -> Iterator[BadObject]:
    for case in compressed_cases():
        if case.error is not None and case.bug is None:
            yield BadObject(
                case.name,
                f"compressed-{case.kind}",
                case.data,
                case.error,
                case.syntax,
            )


def decode_as_worker(data: bytes) -> npt.NDArray[Any] | None:
    """What the worker's decode stage makes of a compressed object, in this process; None
    when the object is not compressed.

    The worker's own functions on the object's bytes, read from memory instead of S3:
    the first GET (``first_read``) holds an object of at most ``PART_SIZE`` whole
    (``whole_header``, ``compressed_frames``); a larger one is a header probe, grown
    while the parser asks (``header_or_more``), then its Pixel Data in ranges
    (``frame_stream``). Frames decode in the worker's groups (``frame_groups``), on
    the CPU.

    Raises:
        IngestError: what the worker would dead-letter the object with.
    """
    view, size = memoryview(data), len(data)
    first = first_read(size, PART_SIZE, MAX_HEADER_BYTES)
    frames: list[bytes | memoryview]
    if first.end == size:
        header = whole_header(view, MAX_HEADER_BYTES)
        if not _compressed_syntax(header):
            return None
        value = view[header.pixel_offset : header.pixel_offset + header.pixel_length]
        frames = list(compressed_frames(header, value))
    else:
        layout = header_or_more(view[: first.end], size, MAX_HEADER_BYTES)
        while isinstance(layout, ByteRange):
            layout = header_or_more(view[: layout.end], size, MAX_HEADER_BYTES)
        header = layout
        if not _compressed_syntax(header):
            return None
        stream = frame_stream(header, size, PART_SIZE)
        frames = [f for r in stream.ranges for f in stream.feed(view[r.start : r.end])]
        frames += stream.finish()
    codec = header.codec
    assert codec is not None
    groups = [
        decode_encapsulated(codec, [bytes(f) for f in frames[group.start : group.stop]])
        for group in frame_groups(header)
    ]
    return np.concatenate(groups)


def _compressed_syntax(header: DicomHeader) -> bool:
    codec = header.codec
    return codec is not None and is_compressed(codec.transfer_syntax_uid)


def pixel_array(data: bytes) -> npt.NDArray[Any]:
    """pydicom's ``pixel_array`` of ``data`` (palette and LUTs not applied), one axis a frame."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        arr: npt.NDArray[Any] = ds.pixel_array
    frames = int(ds.get("NumberOfFrames") or 1)
    return arr.reshape(frames, *arr.shape[-3 + (ds.SamplesPerPixel == 1) :])


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
        *deflated_cases(),
        *_compressed(),
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
    out += [
        GoodObject(f"good/pydicom/{name}", samples.example_bytes(name)) for name in DECODED_SAMPLES
    ]
    out += [GoodObject(f"good/deflated/{name}.dcm", data) for name, data in deflated_goods()]
    # the compressed bases, and their mutants that decode (to what pydicom's pixel_array gives)
    out += [GoodObject(f"good/compressed/{b.name}.dcm", b.write()) for b in compressed_bases()]
    out += [
        GoodObject(f"good/compressed/{case.name}.dcm", case.data)
        for case in compressed_cases()
        if case.error is None and case.bug is None
    ]
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


# -- mutations of compressed objects (hypothesis) --------------------------------------

_FIELD_VALUES: Final = (0, 1, 2, 3, 7, 8, 15, 16, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF)


def codestream_fields(frame: bytes) -> list[tuple[int, str]]:
    """(where, struct format) of the fields of a codestream's frame header that say what
    it decodes to: JPEG (-LS) SOF's precision, size, components and their sampling;
    JPEG 2000 SIZ's profile, sizes, offsets, tile sizes, components, their depth and
    subsampling, and COD's decomposition levels and code-block size; RLE's segment
    count and offsets."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame)
        fields = [(at + 4, ">B"), (at + 5, ">H"), (at + 7, ">H"), (at + 9, ">B")]
        return fields + [
            (at + 11 + 3 * c, ">B") for c in range(frame[at + 9]) if at + 12 + 3 * c <= len(frame)
        ]
    if frame[:2] == b"\xff\x4f":
        fields = [(6, ">H"), *((8 + 4 * i, ">I") for i in range(8)), (40, ">H"), (42, ">B")]
        fields += [(43, ">B"), (44, ">B")]
        cod = frame.find(b"\xff\x52")
        if cod > 0 and cod + 12 <= len(frame):
            fields += [(cod + 9, ">B"), (cod + 10, ">B"), (cod + 11, ">B")]
        return fields
    return [(4 * i, "<I") for i in range(min(16, len(frame) // 4))]


class Mutant:
    """A mutated object, shown by what was done to which base (never its bytes)."""

    __slots__ = ("data", "how")

    def __init__(self, how: str, data: bytes) -> None:
        self.how, self.data = how, data

    def __repr__(self) -> str:
        return f"Mutant({self.how!r}, {len(self.data)} bytes)"


@st.composite
def mutated_compressed(draw: st.DrawFn) -> Mutant:
    """A compressed base (``compressed_bases``: every syntax, and both slides) with some of
    its offset tables, then one of: 1-4 edits (``mutate``) of a frame's codestream, half of
    them in its header; a frame header field set to an edge or any value; 1-4 edits of the
    encapsulated items (their headers, the tables, the delimiter); Number of Frames, Rows or
    Columns changed (Rows and Columns at most 1024, so a claim costs at most 2 MiB a frame)."""
    base = draw(st.sampled_from(compressed_bases()))
    offsets: OffsetChoice = draw(st.sampled_from(["basic", "extended", "none"]))
    frames = list(base.frames)
    how = draw(st.sampled_from(["codestream", "codestream", "field", "items", "header"]))
    said = f"{base.name}, {offsets} table, {how}"
    if how in ("codestream", "field"):
        k = draw(st.sampled_from(sorted({0, base.target, len(frames) - 1})))
        frame = bytearray(frames[k])
        if how == "field":
            at, fmt = draw(st.sampled_from(codestream_fields(bytes(frame))))
            top = 256 ** struct.calcsize(fmt) - 1
            value = draw(st.one_of(st.sampled_from(_FIELD_VALUES), st.integers(0, top)))
            struct.pack_into(fmt, frame, at, min(value, top))
            said += f" {at} of frame {k} = {min(value, top)}"
        else:
            end = codestream_header_end(bytes(frame))
            for _ in range(draw(st.integers(1, 4))):
                limit = draw(st.sampled_from([min(len(frame), end), len(frame)]))
                mutate(draw, frame, draw(st.integers(0, limit)))
            said += f" of frame {k}"
        frames[k] = bytes(frame)
        return Mutant(said, base.write(frames, offsets))
    data = base.write(frames, offsets)
    if how == "header":
        keyword = draw(st.sampled_from(["NumberOfFrames", "Rows", "Columns"]))
        top = 2**31 - 1 if keyword == "NumberOfFrames" else 1024
        value = draw(
            st.one_of(st.sampled_from([0, 1, 2, len(frames) + 1, top]), st.integers(0, top))
        )
        return Mutant(f"{said} {keyword} = {value}", edit(data, **{keyword: value}))
    found, delimiter = items_of(data)
    heads = [at for at, _ in found] + [delimiter]
    mutable = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            at = draw(st.sampled_from(heads)) + draw(st.integers(0, 11))
        else:
            at = draw(st.integers(heads[0], len(mutable)))
        mutate(draw, mutable, min(at, len(mutable)))
    return Mutant(said, bytes(mutable))


def compressed_mutations(count: int) -> list[bytes]:
    """Distinct ``mutated_compressed`` mutants (up to ``count``), the same every run."""
    found: dict[bytes, None] = {}

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_compressed())
    def collect(mutant: Mutant) -> None:
        found[mutant.data] = None

    collect()
    return list(found)
