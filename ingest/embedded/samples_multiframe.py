"""Synthetic Enhanced-CT-like multi-frame objects, native or Encapsulated Uncompressed.

Deterministic (same arguments, same bytes), streamed to a file one frame at a
time when a path is given, so their size is bounded by the disk: the bench's
large objects, up to 4 GiB native and past it Encapsulated Uncompressed (the
syntax for uncompressed objects as large as a whole-slide image).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO, Final, overload

import numpy as np
from pydicom.dataset import Dataset

from ingest.embedded.sample_parts import (
    MAX_NATIVE_PIXEL_BYTES,
    OffsetTable,
    base_dataset,
    image_pixel,
    uid,
    write_encapsulated,
    write_native,
)

ENHANCED_CT_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.2.1"


def frame_rescale(index: int) -> tuple[str, str]:
    return f"{0.5 + 0.25 * (index % 4)}", f"{-1024 + 8 * (index % 16)}"


def _transformation(slope: str, intercept: str) -> Dataset:
    item = Dataset()
    item.RescaleSlope, item.RescaleIntercept, item.RescaleType = slope, intercept, "US"
    return item


def _multiframe_header(
    frames: int,
    rows: int,
    columns: int,
    bits: tuple[int, int],
    signed: bool,
    per_frame: bool,
    positions: bool,
) -> Dataset:
    key = ("mf", frames, rows, columns, *bits, signed, per_frame)
    sop = uid(*key, "sop")
    ds = base_dataset(ENHANCED_CT_STORAGE, sop, "CT", uid(*key, "study"), uid(*key, "series"))
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    ds.InstanceNumber = 1
    ds.NumberOfFrames = frames
    ds.FrameOfReferenceUID = uid(*key, "frame-of-reference")
    image_pixel(ds, rows, columns, bits, signed)
    shared = Dataset()
    measures, orientation = Dataset(), Dataset()
    measures.PixelSpacing, measures.SliceThickness = ["0.5", "0.5"], "1.0"
    orientation.ImageOrientationPatient = ["1", "0", "0", "0", "1", "0"]
    shared.PixelMeasuresSequence = [measures]
    shared.PlaneOrientationSequence = [orientation]
    if not per_frame:
        shared.PixelValueTransformationSequence = [_transformation("0.5", "-100")]
    ds.SharedFunctionalGroupsSequence = [shared]
    groups = []
    for index in range(frames):
        group, content, position = Dataset(), Dataset(), Dataset()
        content.InStackPositionNumber = index + 1
        group.FrameContentSequence = [content]
        if positions:  # axial frames 1 mm apart, head to feet, as CT volumes often are
            position.ImagePositionPatient = ["-64", "-64", f"{-1.0 * index:.1f}"]
            group.PlanePositionSequence = [position]
        if per_frame:
            group.PixelValueTransformationSequence = [_transformation(*frame_rescale(index))]
        groups.append(group)
    ds.PerFrameFunctionalGroupsSequence = groups
    return ds


def _frame_bytes(index: int, base: np.ndarray, bits: tuple[int, int], signed: bool) -> bytes:
    """Frame ``index``: a cheap formula of (frame, row, column) in ``bits_stored`` bits.

    The value is ``(7 row + 3 column + 31 frame) * step mod 2**stored`` (``step``
    spreads it over the range), shifted to the signed range when signed; the
    unused high bits hold garbage that readers must mask.
    """
    allocated, stored = bits
    span = 1 << stored
    value = ((base + 31 * index) * max(1, span // 509)) % span
    if signed:
        value -= span // 2
    raw = value & (span - 1)  # two's complement in `stored` bits
    if stored < allocated:
        garbage_mask = (1 << (allocated - stored)) - 1
        rows = np.arange(base.shape[0], dtype=np.int64)[:, None]
        raw |= ((rows + index) & garbage_mask) << stored
    frame: bytes = raw.astype(f"<u{allocated // 8}").tobytes()
    return frame


@overload
def synthetic_multiframe(
    frames: int,
    rows: int,
    columns: int,
    *,
    bits_allocated: int = ...,
    bits_stored: int | None = ...,
    signed: bool = ...,
    per_frame_rescale: bool = ...,
    plane_positions: bool = ...,
    encapsulated: OffsetTable | None = ...,
    path: None = None,
) -> bytes: ...
@overload
def synthetic_multiframe(
    frames: int,
    rows: int,
    columns: int,
    *,
    bits_allocated: int = ...,
    bits_stored: int | None = ...,
    signed: bool = ...,
    per_frame_rescale: bool = ...,
    plane_positions: bool = ...,
    encapsulated: OffsetTable | None = ...,
    path: str | os.PathLike[str],
) -> Path: ...
def synthetic_multiframe(
    frames: int,
    rows: int,
    columns: int,
    *,
    bits_allocated: int = 16,
    bits_stored: int | None = None,
    signed: bool = False,
    per_frame_rescale: bool = True,
    plane_positions: bool = True,
    encapsulated: OffsetTable | None = None,
    path: str | os.PathLike[str] | None = None,
) -> bytes | Path:
    """An Enhanced-CT-like multi-frame object (explicit VR LE) with functional groups.

    ``per_frame_rescale``: each frame gets its own Pixel Value Transformation
    (slope ``0.5 + 0.25 (i mod 4)``, intercept ``-1024 + 8 (i mod 16)``); otherwise
    the shared group holds one (slope 0.5, intercept -100). ``plane_positions``: each
    frame gets its Plane Position (axial, 1 mm apart, head to feet; about 60 bytes
    of header a frame); the orientation and spacing are shared. ``bits_stored``
    defaults to 8, 12 or 24 for 8, 16 or 32 bits allocated. ``encapsulated``: the
    same frames as Encapsulated Uncompressed, with that offset table (no size
    limit); otherwise native (4 GiB - 2 bytes at most). With ``path`` the object is
    streamed to that file frame by frame and the path is returned.
    """
    if bits_allocated not in (8, 16, 32):
        raise ValueError("bits_allocated must be 8, 16 or 32")
    stored = bits_stored if bits_stored is not None else {8: 8, 16: 12, 32: 24}[bits_allocated]
    if not 1 <= stored <= bits_allocated:
        raise ValueError(f"bits_stored must be within 1..{bits_allocated}")
    total = frames * rows * columns * bits_allocated // 8
    if encapsulated is None and total > MAX_NATIVE_PIXEL_BYTES:
        raise ValueError("native Pixel Data is limited to 4 GiB - 2 bytes (32-bit length)")
    bits = (bits_allocated, stored)
    ds = _multiframe_header(frames, rows, columns, bits, signed, per_frame_rescale, plane_positions)
    base = (np.arange(rows, dtype=np.int64)[:, None] * 7) + (
        np.arange(columns, dtype=np.int64)[None, :] * 3
    )
    pixels = (_frame_bytes(index, base, bits, signed) for index in range(frames))

    def write(fp: BinaryIO) -> None:
        if encapsulated is None:
            write_native(fp, ds, pixels, total)
        else:
            write_encapsulated(fp, ds, pixels, frames, total // frames, encapsulated)

    if path is None:
        buffer = io.BytesIO()
        write(buffer)
        return buffer.getvalue()
    target = Path(path)
    with target.open("wb") as fp:
        write(fp)
    return target
