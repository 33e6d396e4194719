"""Sample objects for the demo, the tests and the benchmarks.

Everything here is deterministic (same arguments, same bytes) and needs no
network: pydicom's own test files are read from its installed package, and the
synthetic objects are written with pydicom (header) plus NumPy (pixels). Big
multi-frame objects are streamed to a file one frame at a time, so their size
is bounded by the disk, not by memory.

A native Pixel Data element carries a 32-bit length, so a native object holds at
most 4 GiB - 2 bytes of pixels (``MAX_NATIVE_PIXEL_BYTES``); the writers of
``ingest.embedded.sample_parts`` also write Encapsulated Uncompressed, a frame a fragment,
with no such limit (``encapsulated=`` of ``synthetic_multiframe`` and
``synthetic_rgb``).
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from pydicom.data import get_testdata_file

from ingest.embedded.sample_parts import (
    MAX_NATIVE_PIXEL_BYTES,
    OffsetTable,
    base_dataset,
    image_pixel,
    uid,
    write_encapsulated,
    write_native,
)
from ingest.embedded.samples_multiframe import synthetic_multiframe
from ingest.errors import NotDicom

__all__ = [
    "EXAMPLES_DEAD_LETTERED",
    "EXAMPLES_DECODED",
    "EXAMPLES_NATIVE",
    "EXAMPLES_SUPPORTED",
    "MAX_NATIVE_PIXEL_BYTES",
    "Sample",
    "demo_objects",
    "example_bytes",
    "not_dicom",
    "pydicom_examples",
    "synthetic_ct_series",
    "synthetic_multiframe",
    "synthetic_rgb",
]

OK: Final = "ok"

# pydicom test files with native little-endian pixel data this version processes
# pydicom test files the demo uploads whose samples go to the device as they are stored
EXAMPLES_NATIVE: Final = (
    "CT_small.dcm",  # explicit VR, 16-bit signed, rescale slope/intercept
    "MR_small.dcm",  # explicit VR, 16-bit signed, no rescale
    "MR_small_implicit.dcm",  # the same, implicit VR
    "MR_small_padded.dcm",  # Pixel Data longer than needed; trailing padding element
    "rtdose.dcm",  # implicit VR, 15 frames, 32-bit unsigned
    "rtdose_1frame.dcm",
    "examples_overlay.dcm",  # 16 bits allocated, 12 stored
    "examples_rgb_color.dcm",  # RGB, planar 0
    "SC_rgb_small_odd.dcm",  # 3x3 RGB: odd length, one pad byte
    "SC_rgb_jpeg_dcmd.dcm",  # despite its name: implicit VR, native RGB
)
# ... and those decoded first (ingest/dicom/codec.py)
EXAMPLES_DECODED: Final = (
    "JPEG2000.dcm",  # JPEG 2000, decoded in the decoding processes
    "MR_small_RLE.dcm",  # RLE Lossless
    "JPGExtended.dcm",  # JPEG Extended, 12-bit
    "MR_small_jpeg_ls_lossless.dcm",  # JPEG-LS
    "MR_small_bigendian.dcm",  # Explicit VR Big Endian
    "examples_palette.dcm",  # PALETTE COLOR, to RGB
    "SC_ybr_full_422_uncompressed.dcm",  # native YBR_FULL_422, to RGB
    "liver_1frame.dcm",  # Bits Allocated 1
    "image_dfl.dcm",  # Deflated Explicit VR Little Endian, inflated as it is read
)
EXAMPLES_SUPPORTED: Final = EXAMPLES_NATIVE + EXAMPLES_DECODED
# pydicom test files the demo uploads to be dead-lettered, with the expected reason
EXAMPLES_DEAD_LETTERED: Final[dict[str, str]] = {}  # none now: every one is processed

_CT_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.2"
_SC_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.7"
_PET_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.128"
_MULTIFRAME_TRUE_COLOR_SC: Final = "1.2.840.10008.5.1.4.1.1.7.4"


@dataclass(frozen=True, slots=True)
class Sample:
    """One demo object: its S3 key, its bytes (or the file holding them), what should happen."""

    key: str
    data: bytes | Path
    expect: str  # "ok", or the ingest.errors reason code it is dead-lettered with

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.stat().st_size

    def read(self) -> bytes:
        return self.data if isinstance(self.data, bytes) else self.data.read_bytes()


def example_bytes(name: str) -> bytes:
    """The bytes of one of pydicom's bundled test files (never downloaded)."""
    found = get_testdata_file(name, download=False)
    if not isinstance(found, str):
        raise FileNotFoundError(f"pydicom test file {name!r} is not installed")
    return Path(found).read_bytes()


def pydicom_examples(*, dead_lettered: bool = True) -> list[tuple[str, bytes]]:
    """pydicom's test files we process, plus (by default) the ones we dead-letter."""
    names: Sequence[str] = EXAMPLES_SUPPORTED
    if dead_lettered:
        names = (*names, *EXAMPLES_DEAD_LETTERED)
    return [(name, example_bytes(name)) for name in names]


def _ct_phantom(rows: int, columns: int, z: float, rng: np.random.Generator) -> np.ndarray:
    """A chest-like slice in Hounsfield units; ``z`` in [0, 1] moves through the body."""
    y, x = np.ogrid[-1.0 : 1.0 : rows * 1j, -1.0 : 1.0 : columns * 1j]

    def ellipse(cx: float, cy: float, ax: float, ay: float) -> np.ndarray:
        inside: np.ndarray = ((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2 <= 1.0
        return inside

    hu = np.full((rows, columns), -1000.0)  # air
    hu[ellipse(0, 0, 0.80, 0.60)] = -100.0  # fat
    hu[ellipse(0, 0, 0.75, 0.55)] = 40.0  # soft tissue
    lung = 0.25 + 0.08 * np.sin(np.pi * z)
    hu[ellipse(-0.35, -0.05, lung, 0.38)] = -850.0
    hu[ellipse(0.35, -0.05, lung, 0.38)] = -850.0
    hu[ellipse(0.05, 0.05, 0.16 * (1 - 0.5 * z), 0.14)] = 60.0  # heart, shrinking with z
    hu[ellipse(0, 0.40, 0.09, 0.08)] = 900.0  # vertebra
    hu[ellipse(0, 0.40, 0.05, 0.045)] = 250.0  # its marrow
    hu += rng.normal(0.0, 12.0, hu.shape)
    hu[x**2 + y**2 > 1.0] = -3024.0  # outside the reconstruction circle
    return hu


def synthetic_ct_series(
    count: int, rows: int = 512, columns: int = 512, seed: int = 0
) -> list[tuple[str, bytes]]:
    """``count`` CT Image Storage slices of one series (explicit VR LE, ~0.5 MB at 512x512).

    16 bits allocated, 12 stored, signed; Rescale Slope 1, Intercept -1024; a
    chest-like phantom plus seeded noise. One study and series, unique SOP UIDs.
    """
    study, series = uid("ct", seed, "study"), uid("ct", seed, "series")
    out = []
    for index in range(count):
        sop = uid("ct", seed, "slice", index)
        ds = base_dataset(_CT_STORAGE, sop, "CT", study, series)
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.InstanceNumber = index + 1
        ds.FrameOfReferenceUID = uid("ct", seed, "frame-of-reference")
        ds.ImagesInAcquisition = count
        ds.SliceThickness = "1.25"
        ds.ImagePositionPatient = ["-179.2", "-179.2", f"{-1.25 * index:.2f}"]
        ds.ImageOrientationPatient = ["1", "0", "0", "0", "1", "0"]
        ds.PixelSpacing = ["0.7", "0.7"]
        ds.KVP = "120"
        image_pixel(ds, rows, columns, (16, 12), signed=True)
        ds.WindowCenter, ds.WindowWidth = "40", "400"
        ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = "-1024", "1", "HU"
        rng = np.random.default_rng([seed, index])
        hu = _ct_phantom(rows, columns, index / max(count - 1, 1), rng)
        stored = np.clip(np.rint(hu) + 1024, -2048, 2047).astype("<i2")
        buffer = io.BytesIO()
        write_native(buffer, ds, [stored.tobytes()], stored.nbytes)
        out.append((f"ct-series/slice-{index + 1:04d}.dcm", buffer.getvalue()))
    return out


def synthetic_pet_series(
    count: int, rows: int = 128, columns: int = 128, seed: int = 0, time_slices: int = 1
) -> list[tuple[str, bytes]]:
    """``count`` PET Image Storage slices a time slice (``time_slices`` of them: dynamic).

    As PET writes them: Number of Slices (0054,0081) says how many slices each volume
    has, Number of Time Slices (0054,0101) how many volumes a dynamic series holds,
    and there is no Images in Acquisition. 16 bits unsigned, Rescale Slope 0.25; the
    phantom's soft tissue takes up the tracer. Instance Number is the Image Index.
    """
    study, series = uid("pt", seed, "study"), uid("pt", seed, "series")
    out = []
    for frame in range(time_slices):
        for index in range(count):
            sop = uid("pt", seed, "slice", frame, index)
            ds = base_dataset(_PET_STORAGE, sop, "PT", study, series)
            ds.ImageType = ["ORIGINAL", "PRIMARY"]
            ds.SeriesType = ["DYNAMIC" if time_slices > 1 else "STATIC", "IMAGE"]
            ds.Units = "BQML"
            ds.NumberOfSlices = count
            if time_slices > 1:
                ds.NumberOfTimeSlices = time_slices
            ds.ImageIndex = ds.InstanceNumber = frame * count + index + 1
            ds.FrameOfReferenceUID = uid("pt", seed, "frame-of-reference")
            ds.SliceThickness = "3.27"
            ds.ImagePositionPatient = ["-350", "-350", f"{-3.27 * index:.2f}"]
            ds.ImageOrientationPatient = ["1", "0", "0", "0", "1", "0"]
            ds.PixelSpacing = ["4", "4"]
            image_pixel(ds, rows, columns, (16, 16), signed=False)
            ds.RescaleIntercept, ds.RescaleSlope = "0", "0.25"
            rng = np.random.default_rng([seed, frame, index])
            hu = _ct_phantom(rows, columns, index / max(count - 1, 1), rng)
            uptake = np.clip((hu + 200.0) * (1 + frame), 0, 65535)
            stored = np.rint(uptake).astype("<u2")
            buffer = io.BytesIO()
            write_native(buffer, ds, [stored.tobytes()], stored.nbytes)
            out.append((f"pt-series/{frame + 1:02d}-slice-{index + 1:04d}.dcm", buffer.getvalue()))
    return out


def synthetic_rgb(
    frames: int,
    rows: int,
    columns: int,
    planar: bool = False,
    encapsulated: OffsetTable | None = None,
) -> bytes:
    """An 8-bit RGB secondary capture (multi-frame true colour when ``frames`` > 1).

    The same pixels whatever ``planar`` is, so both layouts decode identically.
    ``encapsulated``: Encapsulated Uncompressed with that offset table, as a
    whole-slide image's tiles are (``synthetic_slide``).
    """
    sop_class = _MULTIFRAME_TRUE_COLOR_SC if frames > 1 else _SC_STORAGE
    key = ("rgb", frames, rows, columns, planar) + ((encapsulated,) if encapsulated else ())
    ds = base_dataset(sop_class, uid(*key, "sop"), "OT", uid(*key, "study"), uid(*key, "series"))
    ds.NumberOfFrames = frames
    ds.SamplesPerPixel = 3
    ds.PhotometricInterpretation = "RGB"
    ds.PlanarConfiguration = int(planar)
    ds.Rows, ds.Columns = rows, columns
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    f = np.arange(frames, dtype=np.int64)[:, None, None]
    r = np.arange(rows, dtype=np.int64)[None, :, None]
    c = np.arange(columns, dtype=np.int64)[None, None, :]
    red, green, blue = (r * 4 + f * 16), (c * 4 + 0 * r), ((r + c) * 2 + f)
    pixels = np.stack(np.broadcast_arrays(red, green, blue), axis=-1).astype(np.uint8)
    if planar:
        pixels = pixels.transpose(0, 3, 1, 2)
    pixels = np.ascontiguousarray(pixels)
    buffer = io.BytesIO()
    if encapsulated is None:
        write_native(buffer, ds, [pixels.tobytes()], pixels.nbytes)
    else:
        tiles = (frame.tobytes() for frame in pixels)
        write_encapsulated(buffer, ds, tiles, frames, pixels[0].nbytes, encapsulated)
    return buffer.getvalue()


def not_dicom() -> tuple[str, bytes]:
    """A small grey-gradient PNG: clearly not DICOM."""
    width = height = 32
    raw = b"".join(b"\0" + bytes((x * 8 + y) % 256 for x in range(width)) for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    return "misc/not-dicom.png", png


def demo_objects(
    directory: str | os.PathLike[str],
    *,
    ct_slices: int = 20,
    multiframe_shape: tuple[int, int, int] = (200, 512, 512),
) -> list[Sample]:
    """The demo's mixed set: pydicom's examples, a CT series, a big multi-frame, a slide's
    tiles (Encapsulated Uncompressed), a PNG.

    The multi-frame object (16-bit, per-frame rescale; 200 x 512 x 512 makes
    ~105 MB) is written to ``directory``; everything else stays in memory (~11 MB,
    and 35 MB of tiles: 180 of 256 x 256 RGB, larger than a default part).
    """
    samples = [
        Sample(f"pydicom/{name}", data, EXAMPLES_DEAD_LETTERED.get(name, OK))
        for name, data in pydicom_examples()
    ]
    samples += [Sample(key, data, OK) for key, data in synthetic_ct_series(ct_slices)]
    frames, rows, columns = multiframe_shape
    name = f"enhanced-ct-{frames}x{rows}x{columns}.dcm"
    path = synthetic_multiframe(frames, rows, columns, path=Path(directory) / name)
    samples.append(Sample(f"multiframe/{name}", path, OK))
    slide = synthetic_rgb(180, 256, 256, encapsulated="basic")
    samples.append(Sample("slide/tiles-180x256x256-encapsulated-uncompressed.dcm", slide, OK))
    key, png = not_dicom()
    samples.append(Sample(key, png, NotDicom.reason))
    return samples
