"""How the sample objects are put together: UIDs, the common header, the Pixel Data writers.

The header is written with pydicom (``dcmwrite``); the Pixel Data element is
written here, frame by frame, so an object of any size streams to a file.
``write_native`` writes a native element (a 32-bit length: 4 GiB - 2 bytes at
most); ``write_encapsulated`` writes Encapsulated Uncompressed
(``ingest.dicom.fragments``): one item per frame, with a Basic or an Extended Offset
Table or neither, and no limit but the disk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import BinaryIO, Final, Literal

from pydicom import dcmwrite
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID, ExplicitVRLittleEndian, generate_uid

from ingest.dicom.fragments import ENCAPSULATED_UNCOMPRESSED, item_header

MAX_NATIVE_PIXEL_BYTES: Final = 0xFFFFFFFE
OffsetTable = Literal["none", "basic", "extended"]
_DELIMITER: Final = struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)


def uid(*parts: object) -> str:
    return generate_uid(entropy_srcs=["dicom-ingest", *map(str, parts)])


def file_meta(sop_class: str, sop_instance: str) -> FileMetaDataset:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(sop_class)
    meta.MediaStorageSOPInstanceUID = UID(sop_instance)
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    return meta


def base_dataset(
    sop_class: str, sop_instance: str, modality: str, study: str, series: str
) -> Dataset:
    ds = Dataset()
    ds.file_meta = file_meta(sop_class, sop_instance)
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = sop_instance
    ds.StudyDate = ds.SeriesDate = "20240101"
    ds.StudyTime = ds.SeriesTime = "120000"
    ds.Modality = modality
    ds.Manufacturer = "dicom-ingest synthetic"
    ds.PatientName = "PHANTOM^SYNTHETIC"
    ds.PatientID = "PHANTOM-0001"
    ds.StudyInstanceUID = study
    ds.SeriesInstanceUID = series
    ds.StudyID = "1"
    ds.SeriesNumber = 1
    return ds


def image_pixel(ds: Dataset, rows: int, columns: int, bits: tuple[int, int], signed: bool) -> None:
    allocated, stored = bits
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows = rows
    ds.Columns = columns
    ds.BitsAllocated = allocated
    ds.BitsStored = stored
    ds.HighBit = stored - 1
    ds.PixelRepresentation = int(signed)


def write_native(fp: BinaryIO, ds: Dataset, frames: Iterable[bytes], total: int) -> None:
    """Write ``ds`` (explicit VR LE), then a Pixel Data element of ``total`` bytes of frames."""
    dcmwrite(fp, ds, enforce_file_format=True)
    vr = b"OB" if ds.BitsAllocated == 8 else b"OW"
    fp.write(struct.pack("<HH2sHI", 0x7FE0, 0x0010, vr, 0, total + total % 2))
    for frame in frames:
        fp.write(frame)
    if total % 2:
        fp.write(b"\0")


def write_encapsulated(
    fp: BinaryIO,
    ds: Dataset,
    frames: Iterable[bytes],
    count: int,
    frame_bytes: int,
    offsets: OffsetTable = "basic",
) -> None:
    """Write ``ds`` as Encapsulated Uncompressed: ``count`` frames of ``frame_bytes``, one
    item each (padded to even), after a Basic Offset Table (``basic``), or an empty one
    with the Extended Offset Table in the data set (``extended``), or neither.

    Raises:
        ValueError: a Basic Offset Table cannot reach the last frame (past 4 GiB), or
            a frame is not ``frame_bytes`` long.
    """
    length = frame_bytes + frame_bytes % 2
    positions = [k * (8 + length) for k in range(count)]
    ds.file_meta.TransferSyntaxUID = UID(ENCAPSULATED_UNCOMPRESSED)
    if offsets == "extended":
        ds.ExtendedOffsetTable = struct.pack(f"<{count}Q", *positions)
        ds.ExtendedOffsetTableLengths = struct.pack(f"<{count}Q", *[frame_bytes] * count)
    table = b""
    if offsets == "basic":
        if positions[-1] > 0xFFFFFFFF:
            raise ValueError("a Basic Offset Table holds 32-bit offsets: use 'extended'")
        table = struct.pack(f"<{count}I", *positions)
    dcmwrite(fp, ds, enforce_file_format=True)
    fp.write(struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OB", 0, 0xFFFFFFFF))
    fp.write(item_header(len(table)) + table)
    written = 0
    for frame in frames:
        if len(frame) != frame_bytes:
            raise ValueError(f"a frame of {len(frame)} bytes, not {frame_bytes}")
        fp.write(item_header(length))
        fp.write(frame)
        if frame_bytes % 2:
            fp.write(b"\0")
        written += 1
    if written != count:
        raise ValueError(f"{written} frames written, not {count}")
    fp.write(_DELIMITER)
