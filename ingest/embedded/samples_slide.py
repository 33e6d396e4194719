"""Synthetic JPEG-tiled whole-slide images, streamed to a file whatever their size.

A VL Whole Slide Microscopy Image (TILED_FULL) holds its tiles as frames, each
one JPEG (or JPEG 2000) fragment. Real slides are 10-20 GB, so the writer never
holds the object: the header is written with pydicom, then the encapsulated
Pixel Data is written item by item (``write_fragments``).

Making every tile distinct would cost the pixels and Pillow's encode for every tile:
minutes for a 4 GiB slide, which the disk takes in seconds. Instead ``distinct``
tiles (61 by default, a prime, so rows of tiles do not line up) are made and encoded
once and reused cyclically: tile ``k`` shows ``tissue_tile(k mod distinct)``. Each
fragment still differs from every other: a comment (JPEG: a COM segment after
JFIF's; JPEG 2000: a COM marker segment after SIZ) says ``tile NNNNNNNNNNN``, so a
reader that takes the wrong fragment is caught by its bytes. Since every fragment's
length is then known before one is written, the offset tables go first without a
second pass or patching: a Basic Offset Table while the fragments take less than
4 GiB, past that an empty one plus the Extended Offset Table and its lengths
(``offsets="auto"``).
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Final, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image
from pydicom import dcmwrite
from pydicom.dataset import Dataset
from pydicom.pixels.encoders.base import get_encoder
from pydicom.uid import JPEG2000, UID, JPEGBaseline8Bit

from ingest.dicom.fragments import item_header
from ingest.embedded.sample_parts import base_dataset, uid

WSI_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.77.1.6"
TABLE_LIMIT: Final = 0xFFFFFFFF  # a Basic Offset Table holds 32-bit offsets
OffsetChoice = Literal["auto", "basic", "extended", "none"]
_DELIMITER: Final = struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)
_PIXEL_DATA: Final = struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OB", 0, 0xFFFFFFFF)
_PALETTE: Final = np.array([[242, 240, 244], [226, 150, 190], [110, 70, 160]], np.int16)
_DISKS: Final = {r: np.add.outer(*[np.arange(-r, r + 1) ** 2] * 2) <= r * r for r in range(3, 8)}


def write_fragments(
    fp: BinaryIO,
    ds: Dataset,
    fragments: Iterable[bytes],
    lengths: npt.NDArray[np.int64],
    offsets: OffsetChoice = "auto",
) -> str:
    """Write ``ds`` (its transfer syntax already set) then encapsulated Pixel Data: one
    item a frame, each ``lengths[k]`` bytes (an odd one padded to even with a zero).

    The tables are computed from ``lengths``: ``basic`` (32-bit offsets in the
    first item), ``extended`` (an empty first item; Extended Offset Table and
    Extended Offset Table Lengths, padded lengths as pydicom writes them, in
    ``ds``), ``none`` (an empty first item), ``auto`` (basic if the fragments take
    less than 4 GiB, else extended). Returns the table written.

    Raises:
        ValueError: no fragment, one not as long as ``lengths`` says, more or fewer
            of them, or ``basic`` asked for fragments past 4 GiB.
    """
    if not len(lengths):
        raise ValueError("an encapsulated object needs a frame at least")
    padded = lengths + lengths % 2
    ends = np.cumsum(padded + 8, dtype=np.int64)
    positions = ends - (padded + 8)
    if offsets == "auto":
        offsets = "basic" if int(ends[-1]) <= TABLE_LIMIT else "extended"
    if offsets == "basic" and int(ends[-1]) > TABLE_LIMIT:
        raise ValueError("the fragments take 4 GiB or more: a Basic Offset Table cannot hold them")
    if offsets == "extended":
        ds.ExtendedOffsetTable = positions.astype("<u8").tobytes()
        ds.ExtendedOffsetTableLengths = padded.astype("<u8").tobytes()
    table = positions.astype("<u4").tobytes() if offsets == "basic" else b""
    dcmwrite(fp, ds, enforce_file_format=True)
    fp.write(_PIXEL_DATA + item_header(len(table)) + table)
    count = 0
    for count, fragment in enumerate(fragments, 1):
        if count > len(lengths) or len(fragment) != lengths[count - 1]:
            raise ValueError(f"fragment {count - 1} is not as long as its table says")
        fp.write(item_header(len(fragment) + len(fragment) % 2))
        fp.write(fragment)
        if len(fragment) % 2:
            fp.write(b"\0")
    if count != len(lengths):
        raise ValueError(f"{count} fragments written, not {len(lengths)}")
    fp.write(_DELIMITER)
    return offsets


def tissue_tile(index: int, rows: int, columns: int) -> npt.NDArray[np.uint8]:
    """An H&E-like RGB tile, deterministic in ``index``: pale background, pink stroma over
    a smooth random mask, purple nuclei, a little noise. float32 and integer arithmetic:
    float64 sines alone would take longer."""
    rng = np.random.default_rng([0x57D1, index])
    y = np.linspace(0.0, 1.0, rows, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, columns, dtype=np.float32)[None, :]
    field = np.zeros((rows, columns), np.float32)
    waves = rng.uniform((0.5, 0.5, 0.0), (3.0, 3.0, 2 * np.pi), (4, 3)).astype(np.float32)
    for fy, fx, phase in waves * np.array([2 * np.pi, 2 * np.pi, 1], np.float32):
        field += np.sin(fy * y + fx * x + phase)
    label = (field > -0.8).astype(np.uint8)  # 0 background, 1 stroma, 2 nucleus
    centres = rng.integers(0, rows, 90), rng.integers(0, columns, 90), rng.integers(3, 8, 90)
    for cy, cx, r in zip(*centres, strict=True):
        top, left = max(cy - r, 0), max(cx - r, 0)
        patch = label[top : cy + r + 1, left : cx + r + 1]
        disk = _DISKS[r][top - cy + r :, left - cx + r :][: patch.shape[0], : patch.shape[1]]
        patch[disk & (patch == 1)] = 2
    rgb = _PALETTE.take(label, axis=0)
    rgb += (8 * np.tanh(field)).astype(np.int16)[..., None]
    noise = np.frombuffer(rng.bytes(rgb.size), np.uint8).reshape(rgb.shape) & 15
    rgb += noise.astype(np.int16) - 8
    return np.clip(rgb, 0, 255).astype(np.uint8)


def jpeg_rgb(pixels: npt.NDArray[np.uint8], quality: int) -> bytes:
    """Baseline JPEG (Pillow), chroma subsampled horizontally: DICOM's YBR_FULL_422."""
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality, subsampling="4:2:2")
    return out.getvalue()


def _j2k_rgb(pixels: npt.NDArray[np.uint8], quality: int) -> bytes:
    """Lossy JPEG 2000 (openjpeg through pydicom) with the irreversible colour transform,
    aiming at ``quality / 2`` dB PSNR (42.5 dB at the default 85)."""
    rows, columns, _ = pixels.shape
    return get_encoder(JPEG2000).encode(
        pixels,
        encoding_plugin="pylibjpeg",
        rows=rows,
        columns=columns,
        samples_per_pixel=3,
        number_of_frames=1,
        bits_allocated=8,
        bits_stored=8,
        pixel_representation=0,
        photometric_interpretation="RGB",
        planar_configuration=0,
        use_mct=True,
        j2k_psnr=[quality / 2],
    )


def _tagged(image: bytes, index: int) -> bytes:
    """``image`` with a comment naming the tile (as long whatever ``index`` is): in JPEG
    a COM segment after the JFIF one, in JPEG 2000 a COM marker segment after SIZ."""
    if image[:2] == b"\xff\x4f":  # JPEG 2000 codestream: SOC, then SIZ
        at = 4 + int.from_bytes(image[4:6], "big")
        return image[:at] + b"\xff\x64\x00\x14\x00\x01tile %011d" % index + image[at:]
    at = 2
    if image[2:4] == b"\xff\xe0":
        at = 4 + int.from_bytes(image[4:6], "big")
    return image[:at] + b"\xff\xfe\x00\x12tile %011d" % index + image[at:]


@dataclass(frozen=True, slots=True)
class SlideInfo:
    """What a slide writer wrote: enough for a test or the bench to check the result."""

    path: Path | None
    size: int  # bytes of the whole object
    tile: int
    tiles_across: int
    tiles_down: int
    total_rows: int
    total_columns: int
    syntax: str
    offset_table: str  # "basic" or "extended" (or "none" when asked for)
    fragment_bytes: int  # the items after the Basic Offset Table, headers included
    distinct: int  # different tile images, reused cyclically
    sop_instance_uid: str

    @property
    def frames(self) -> int:
        return self.tiles_across * self.tiles_down

    @property
    def first_fragment(self) -> int:
        """Where the first tile's item starts in the object: offsets count from here."""
        return self.size - self.fragment_bytes - 8  # the Sequence Delimiter comes last


def _slide_header(key: tuple[object, ...], info: dict[str, int], ratio: float) -> Dataset:
    """The VL Whole Slide Microscopy header of a single-focal-plane, brightfield slide."""
    sop = uid(*key, "sop")
    ds = base_dataset(WSI_STORAGE, sop, "SM", uid(*key, "study"), uid(*key, "series"))
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    ds.InstanceNumber = 1
    ds.ContentDate, ds.ContentTime, ds.AcquisitionDateTime = "20240101", "120000", "20240101120000"
    ds.FrameOfReferenceUID = uid(*key, "frame-of-reference")
    ds.PositionReferenceIndicator = "SLIDE_CORNER"
    ds.DimensionOrganizationType = "TILED_FULL"
    ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns = info["rows"], info["columns"]
    ds.TotalPixelMatrixFocalPlanes = 1
    origin = Dataset()
    origin.XOffsetInSlideCoordinateSystem, origin.YOffsetInSlideCoordinateSystem = "20", "40"
    ds.TotalPixelMatrixOriginSequence = [origin]
    ds.ImageOrientationSlide = ["0", "-1", "0", "-1", "0", "0"]
    spacing = 0.00025  # mm: 0.25 um a pixel, a 40x scan
    ds.ImagedVolumeWidth, ds.ImagedVolumeHeight = info["columns"] * spacing, info["rows"] * spacing
    ds.ImagedVolumeDepth = 0.004
    ds.NumberOfFrames = info["frames"]
    ds.Rows = ds.Columns = info["tile"]
    ds.SamplesPerPixel, ds.PlanarConfiguration = 3, 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.LossyImageCompression = "01"
    ds.LossyImageCompressionRatio = f"{ratio:.2f}"
    ds.VolumetricProperties, ds.SpecimenLabelInImage = "VOLUME", "NO"
    ds.BurnedInAnnotation, ds.FocusMethod, ds.ExtendedDepthOfField = "NO", "AUTO", "NO"
    ds.ContainerIdentifier = "SLIDE-0001"
    specimen = Dataset()
    specimen.SpecimenIdentifier, specimen.SpecimenUID = "SPECIMEN-0001", uid(*key, "specimen")
    ds.SpecimenDescriptionSequence = [specimen]
    ds.AcquisitionContextSequence = []
    ds.NumberOfOpticalPaths = 1
    path = Dataset()
    path.OpticalPathIdentifier = "1"
    path.IlluminationTypeCodeSequence = [_code("111744", "DCM", "Brightfield illumination")]
    path.IlluminationColorCodeSequence = [_code("414298005", "SCT", "Full Spectrum")]
    ds.OpticalPathSequence = [path]
    shared, measures, frame_type, path_id = Dataset(), Dataset(), Dataset(), Dataset()
    measures.PixelSpacing, measures.SliceThickness = [f"{spacing}", f"{spacing}"], "0.004"
    frame_type.FrameType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    path_id.OpticalPathIdentifier = "1"
    shared.PixelMeasuresSequence = [measures]
    shared.WholeSlideMicroscopyImageFrameTypeSequence = [frame_type]
    shared.OpticalPathIdentificationSequence = [path_id]
    ds.SharedFunctionalGroupsSequence = [shared]
    return ds


def _code(value: str, scheme: str, meaning: str) -> Dataset:
    item = Dataset()
    item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = value, scheme, meaning
    return item


def _write_slide(
    fp: BinaryIO,
    tile: int,
    across: int,
    down: int,
    quality: int,
    distinct: int,
    offsets: OffsetChoice,
    matrix: tuple[int, int] | None,
    syntax: str,
) -> SlideInfo:
    if syntax not in (JPEGBaseline8Bit, JPEG2000):
        raise ValueError(f"tiles are JPEG baseline or JPEG 2000, not {syntax}")
    rows, columns = matrix or (tile * down, tile * across)
    if -(-rows // tile) != down or -(-columns // tile) != across:
        raise ValueError(f"a {rows} x {columns} matrix is not {down} x {across} tiles of {tile}")
    count, distinct = across * down, max(1, min(distinct, across * down))
    encode = jpeg_rgb if syntax == JPEGBaseline8Bit else _j2k_rgb
    images = [encode(tissue_tile(k, tile, tile), quality) for k in range(distinct)]
    lengths = np.array([len(_tagged(image, 0)) for image in images], dtype=np.int64)
    lengths = lengths[np.arange(count, dtype=np.int64) % distinct]
    fragments = (_tagged(images[k % distinct], k) for k in range(count))
    key = ("wsi", tile, across, down, quality, distinct, rows, columns, syntax)
    size = {"rows": rows, "columns": columns, "frames": count, "tile": tile}
    ds = _slide_header(key, size, count * tile * tile * 3 / float(lengths.sum()))
    ds.PhotometricInterpretation = "YBR_FULL_422" if syntax == JPEGBaseline8Bit else "YBR_ICT"
    method = "ISO_10918_1" if syntax == JPEGBaseline8Bit else "ISO_15444_1"
    ds.LossyImageCompressionMethod = method
    ds.file_meta.TransferSyntaxUID = UID(syntax)
    start = fp.tell()
    table = write_fragments(fp, ds, fragments, lengths, offsets)
    padded = lengths + lengths % 2
    return SlideInfo(
        path=None,
        size=fp.tell() - start,
        tile=tile,
        tiles_across=across,
        tiles_down=down,
        total_rows=rows,
        total_columns=columns,
        syntax=syntax,
        offset_table=table,
        fragment_bytes=int((padded + 8).sum()),
        distinct=distinct,
        sop_instance_uid=ds.SOPInstanceUID,
    )


def write_jpeg_slide(
    path: str | os.PathLike[str],
    *,
    tiles_across: int,
    tiles_down: int,
    tile: int = 256,
    quality: int = 85,
    distinct: int = 61,
    offsets: OffsetChoice = "auto",
    matrix: tuple[int, int] | None = None,
    syntax: str = JPEGBaseline8Bit,
) -> SlideInfo:
    """Stream a TILED_FULL whole-slide image of ``tiles_across`` x ``tiles_down`` tiles to
    ``path``; memory stays at the ``distinct`` encoded tiles and 16 bytes a tile for the
    tables, whatever the size.

    ``syntax``: JPEG Baseline (YBR_FULL_422, Pillow at ``quality``) or JPEG 2000
    (lossy, YBR_ICT, openjpeg, ``quality / 2`` dB PSNR). ``matrix``: the Total Pixel
    Matrix (rows, columns) when the last column or row of tiles is only partly inside
    it (default: whole tiles). ``offsets``: see ``write_fragments``.

    At 256 x 256 and quality 85 a JPEG tile takes ~19 KB: 500 x 500 tiles make a
    4.3 GiB slide (with an Extended Offset Table), written in seconds.
    """
    target = Path(path)
    with target.open("wb") as fp:
        info = _write_slide(
            fp, tile, tiles_across, tiles_down, quality, distinct, offsets, matrix, syntax
        )
    return replace(info, path=target)


def jpeg_slide_bytes(
    *,
    tiles_across: int = 6,
    tiles_down: int = 5,
    tile: int = 256,
    quality: int = 85,
    distinct: int = 61,
    offsets: OffsetChoice = "auto",
    matrix: tuple[int, int] | None = None,
    syntax: str = JPEGBaseline8Bit,
) -> bytes:
    """A small slide in memory (``write_jpeg_slide``'s object, as bytes)."""
    out = io.BytesIO()
    _write_slide(out, tile, tiles_across, tiles_down, quality, distinct, offsets, matrix, syntax)
    return out.getvalue()
