"""Bad objects in a native (uncompressed) syntax: not DICOM, truncated, lying headers,
Encapsulated Uncompressed items that lie, nested sequences, limits, unsupported data."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import numpy as np

from ingest.embedded import samples
from ingest.errors import LimitExceeded, MalformedDicom, NotDicom, UnsupportedDicom
from tests.bad_inputs.bases import (
    MAX_HEADER_BYTES,
    MIB,
    PART_SIZE,
    BadObject,
    ct_small,
    encapsulated_large,
    encapsulated_small,
    large_base,
    small_base,
)
from tests.bad_inputs.edits import (
    edit,
    fragment_at,
    insert_before_pixels,
    meta_with_private_information,
    nested_sequences,
    padded,
    patch_short,
    pixel_tag_at,
    private_ob,
    set_pixel_length,
    set_u32,
)


def png_bytes() -> bytes:
    return samples.not_dicom()[1]


def tiny_png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


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
    for name in ("test-SR.dcm",):  # no Pixel Data at all
        yield BadObject(
            f"pydicom-{name}", "unsupported", samples.example_bytes(name), UnsupportedDicom
        )
    small = small_base()
    at = pixel_tag_at(small)
    floats = small[:at] + struct.pack("<HH2sHI", 0x7FE0, 0x0008, b"OF", 0, 8) + bytes(8)
    yield BadObject("float-pixel-data", "unsupported", floats, UnsupportedDicom)
