"""ingest.embedded.samples_compressed and samples_slide: compressed sample objects read back
with pydicom, decode to what they were made from, are deterministic, and stream."""

from __future__ import annotations

import struct
import tracemalloc
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from pydicom import dcmread
from pydicom.dataset import FileDataset
from pydicom.encaps import get_frame, parse_basic_offsets
from pydicom.pixels.utils import pixel_array
from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    JPEG2000MC,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    JPEG2000Lossless,
    JPEG2000MCLossless,
    JPEG2000TransferSyntaxes,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSTransferSyntaxes,
    JPEGTransferSyntaxes,
    RLETransferSyntaxes,
)

from ingest.dicom.syntaxes import COMPRESSED, LOSSLESS
from ingest.embedded import samples_slide
from ingest.embedded.samples_compressed import (
    CT_SYNTAXES,
    compressed_ct,
    compressed_ct_series,
    compressed_ct_volume,
    compressed_samples,
    ct_grey,
    ct_pixels,
    ct_volume,
    jpeg_baseline,
    jpeg_series_slice,
    write_ct_volume,
)
from ingest.embedded.samples_slide import (
    WSI_STORAGE,
    jpeg_slide_bytes,
    tissue_tile,
    write_fragments,
    write_jpeg_slide,
)
from tests.paths import DATA

_ITEM = struct.Struct("<HHI")
_SEGMENT = struct.Struct(">HH")  # JPEG and JPEG 2000 marker segments: marker, length
# The compressed syntaxes of pydicom's decoders, less JPEG 2000 Part 2 (multi-component)
_DECODED = {
    *JPEGTransferSyntaxes,
    *JPEGLSTransferSyntaxes,
    *JPEG2000TransferSyntaxes,
    *RLETransferSyntaxes,
} - {JPEG2000MC, JPEG2000MCLossless}


def read(data: bytes) -> FileDataset:
    return dcmread(BytesIO(data))


def psnr(decoded: npt.NDArray[Any], source: npt.NDArray[Any], peak: float) -> float:
    error = np.mean((decoded.astype(np.float64) - source.astype(np.float64)) ** 2)
    return float("inf") if error == 0 else float(10 * np.log10(peak**2 / error))


def segments(codestream: bytes, last: int) -> dict[int, bytes]:
    """The main header's marker segments (marker: contents) up to ``last``'s, included."""
    found, at = {}, 2  # after SOI / SOC
    while True:
        marker, length = _SEGMENT.unpack_from(codestream, at)
        found[marker] = codestream[at + 4 : at + 2 + length]
        if marker == last:
            return found
        at += 2 + length


def items(pixel_data: bytes) -> tuple[bytes, list[tuple[int, bytes]]]:
    """The Basic Offset Table and each (offset after it, fragment), walking the items."""
    tag, element, length = _ITEM.unpack_from(pixel_data, 0)
    assert (tag, element) == (0xFFFE, 0xE000)
    table, at, found = pixel_data[8 : 8 + length], 8 + length, []
    first = at
    while at < len(pixel_data):  # pydicom leaves the Sequence Delimiter out
        tag, element, length = _ITEM.unpack_from(pixel_data, at)
        assert (tag, element) == (0xFFFE, 0xE000)
        assert length % 2 == 0
        found.append((at - first, pixel_data[at + 8 : at + 8 + length]))
        at += 8 + length
    return table, found


@pytest.mark.parametrize("syntax", CT_SYNTAXES)
def test_ct_in_every_syntax(syntax: str) -> None:
    data = compressed_ct(syntax, index=3, rows=64, columns=96)
    assert data == compressed_ct(syntax, index=3, rows=64, columns=96)
    assert data != compressed_ct(syntax, index=4, rows=64, columns=96)
    ds = read(data)
    assert ds.file_meta.TransferSyntaxUID == syntax
    assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.2"
    assert (ds.BitsAllocated, ds.BitsStored, ds.PixelRepresentation) == (16, 12, 1)
    assert (ds.RescaleSlope, ds.RescaleIntercept) == (1, -1024)
    pixels, source = ds.pixel_array, ct_pixels(3, 64, 96)
    assert pixels.shape == (64, 96)
    assert pixels.dtype == np.int16
    if syntax in LOSSLESS:
        assert "LossyImageCompression" not in ds
        np.testing.assert_array_equal(pixels, source)
    else:
        assert ds.LossyImageCompression == "01"
        assert float(ds.LossyImageCompressionRatio) > 1
        assert psnr(pixels, source, 4095) >= 40
        # nothing wrapped around the 12-bit two's complement (an error near 4096)
        assert np.abs(pixels.astype(np.int32) - source).max() < 256


def test_ct_series_and_what_cannot_be_written() -> None:
    series = compressed_ct_series(JPEG2000, 2, rows=32, columns=32)
    assert [key for key, _ in series] == [f"ct-JPEG2000/slice-000{i}.dcm" for i in (1, 2)]
    first, second = (read(data) for _, data in series)
    assert first.SeriesInstanceUID == second.SeriesInstanceUID
    assert first.SOPInstanceUID != second.SOPInstanceUID
    assert {*CT_SYNTAXES, JPEGBaseline8Bit} == _DECODED  # every one, CT or capture
    with pytest.raises(ValueError, match="no encoder here"):
        compressed_ct(JPEG2000MCLossless, rows=16, columns=16)


@pytest.mark.parametrize("syntax", [JPEG2000Lossless, HTJ2KLossless])
def test_a_ct_volume_is_its_slices_as_frames(syntax: str) -> None:
    ds = read(compressed_ct_volume(syntax, 7, rows=48, columns=32, distinct=3))
    assert (ds.SOPClassUID, ds.NumberOfFrames, ds.file_meta.TransferSyntaxUID) == (
        "1.2.840.10008.5.1.4.1.1.2.1",
        7,
        syntax,
    )
    shared = ds.SharedFunctionalGroupsSequence[0].PixelValueTransformationSequence[0]
    assert (shared.RescaleIntercept, shared.RescaleSlope) == (-1024, 1)
    positions = [
        g.PlanePositionSequence[0].ImagePositionPatient[2]
        for g in ds.PerFrameFunctionalGroupsSequence
    ]
    assert positions == [-1.25 * k for k in range(7)]
    assert len(parse_basic_offsets(ds.PixelData)) == 7
    pixels = pixel_array(ds)
    for k in range(7):
        assert np.array_equal(pixels[k], ct_pixels(k % 3, 48, 32)), k


def test_a_ct_volume_needs_lossless_frames() -> None:
    with pytest.raises(ValueError, match="lossless"):
        write_ct_volume(BytesIO(), JPEG2000, [b"x"])
    with pytest.raises(ValueError, match="lossless"):
        write_ct_volume(BytesIO(), HTJ2KLossless, [])
    with pytest.raises(ValueError, match="one or more slices"):
        ct_volume([], 3)


def test_codestreams_are_what_their_syntax_says() -> None:
    def frame(syntax: str, rows: int = 64, columns: int = 96) -> bytes:
        ds = read(compressed_ct(syntax, rows=rows, columns=columns))
        return get_frame(ds.PixelData, 0, number_of_frames=1)

    for syntax, sof, predictor in [(JPEGLosslessSV1, 0xFFC3, 1), (JPEGLossless, 0xFFC3, 6)]:
        found = segments(frame(syntax), 0xFFDA)
        assert found[sof][0] == 12  # precision
        assert found[0xFFDA][3] == predictor  # Ss after Ns and one component's two bytes
    assert segments(frame(JPEGExtended12Bit), 0xFFDA)[0xFFC1][0] == 12  # Process 4: SOF1
    for syntax, wavelet in [(HTJ2KLossless, 1), (HTJ2KLosslessRPCL, 1), (HTJ2K, 0)]:
        found = segments(frame(syntax), 0xFF90)  # up to the first tile-part
        assert 0xFF50 in found  # CAP: Part 15 (HT) block coding
        assert found[0xFF52][9] == wavelet  # COD: 1 = reversible 5-3, 0 = irreversible 9-7
    for rows, columns in [(64, 96), (32, 4160)]:  # the second needs more than 5 levels
        found = segments(frame(HTJ2KLosslessRPCL, rows, columns), 0xFF90)
        assert found[0xFF52][1] == 2  # COD progression order: RPCL
        assert 0xFF55 in found  # TLM
        levels = found[0xFF52][5]
        assert -(-max(rows, columns) // (1 << levels)) <= 64  # a thumbnail of at most 64


def test_jpeg_baseline_captures() -> None:
    grey = read(jpeg_baseline("MONOCHROME2", rows=64, columns=48))
    assert grey.file_meta.TransferSyntaxUID == JPEGBaseline8Bit
    assert (grey.PhotometricInterpretation, grey.LossyImageCompressionMethod) == (
        "MONOCHROME2",
        "ISO_10918_1",
    )
    assert grey.pixel_array.shape == (64, 48)
    assert grey.pixel_array.dtype == np.uint8
    data = jpeg_baseline("YBR_FULL_422", index=2, rows=64, columns=48)
    assert data == jpeg_baseline("YBR_FULL_422", index=2, rows=64, columns=48)
    colour = read(data)
    assert (colour.PhotometricInterpretation, colour.SamplesPerPixel) == ("YBR_FULL_422", 3)
    rgb = colour.pixel_array  # pydicom converts YBR_FULL_422 to RGB
    assert rgb.shape == (64, 48, 3)
    assert rgb.dtype == np.uint8
    assert psnr(rgb, tissue_tile(2, 64, 48), 255) > 25  # the picture it was made from


def test_a_jpeg_baseline_series() -> None:
    """One series of 8-bit MONOCHROME2 captures, a slice an object, each its CT slice
    windowed to 8 bits, lossy and saying so."""
    data = [jpeg_series_slice(index, rows=64, columns=48) for index in (0, 1)]
    assert data[0] == jpeg_series_slice(0, rows=64, columns=48)
    first, second = (read(d) for d in data)
    assert first.SeriesInstanceUID == second.SeriesInstanceUID
    assert first.StudyInstanceUID == second.StudyInstanceUID
    assert first.SOPInstanceUID != second.SOPInstanceUID
    assert (first.InstanceNumber, second.InstanceNumber) == (1, 2)
    assert first.file_meta.TransferSyntaxUID == JPEGBaseline8Bit
    assert (first.PhotometricInterpretation, first.SamplesPerPixel) == ("MONOCHROME2", 1)
    assert (first.BitsAllocated, first.BitsStored, first.PixelRepresentation) == (8, 8, 0)
    assert (first.LossyImageCompression, first.LossyImageCompressionMethod) == (
        "01",
        "ISO_10918_1",
    )
    assert "RescaleSlope" not in first  # no Modality LUT: the output is the stored values
    for index, ds in enumerate((first, second)):
        pixels = ds.pixel_array
        assert pixels.shape == (64, 48)
        assert pixels.dtype == np.uint8
        assert psnr(pixels, ct_grey(index, 64, 48), 255) > 35


def _check_slide(ds: FileDataset, across: int, down: int, tile: int, distinct: int) -> None:
    """Header, tables against the fragments, every fragment named, first and last decoded."""
    count = across * down
    assert ds.SOPClassUID == WSI_STORAGE
    assert (ds.DimensionOrganizationType, ds.NumberOfFrames) == ("TILED_FULL", count)
    assert (ds.Rows, ds.Columns) == (tile, tile)
    table, fragments = items(ds.PixelData)
    assert len(fragments) == count
    extended = None
    if table:
        assert list(parse_basic_offsets(BytesIO(ds.PixelData))) == [o for o, _ in fragments]
        assert "ExtendedOffsetTable" not in ds
    else:
        offsets = np.frombuffer(ds.ExtendedOffsetTable, "<u8").tolist()
        lengths = np.frombuffer(ds.ExtendedOffsetTableLengths, "<u8").tolist()
        assert offsets == [o for o, _ in fragments]
        assert lengths == [len(f) for _, f in fragments]
        extended = (ds.ExtendedOffsetTable, ds.ExtendedOffsetTableLengths)
    for k, (_, fragment) in enumerate(fragments):
        frame = get_frame(ds.PixelData, k, number_of_frames=count, extended_offsets=extended)
        assert frame == fragment
        assert b"tile %011d" % k in fragment[:80]  # each fragment is its own tile
    for k in (0, count - 1):
        pixels = pixel_array(ds, index=k)  # pydicom's own decode of one frame
        assert pixels.shape == (tile, tile, 3)
        assert pixels.dtype == np.uint8
        assert psnr(pixels, tissue_tile(k % distinct, tile, tile), 255) > 25


def test_jpeg_slide_in_memory() -> None:
    data = jpeg_slide_bytes(tile=64, distinct=7)
    assert data == jpeg_slide_bytes(tile=64, distinct=7)
    ds = read(data)
    assert ds.file_meta.TransferSyntaxUID == JPEGBaseline8Bit
    assert ds.PhotometricInterpretation == "YBR_FULL_422"
    assert (ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns) == (5 * 64, 6 * 64)
    _check_slide(ds, 6, 5, 64, 7)
    assert ds.pixel_array.shape == (30, 64, 64, 3)


def test_slide_offset_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    extended = read(jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32, offsets="extended"))
    _check_slide(extended, 3, 2, 32, 61)
    j2k = read(jpeg_slide_bytes(tiles_across=2, tiles_down=2, tile=32, syntax=JPEG2000))
    assert (j2k.file_meta.TransferSyntaxUID, j2k.PhotometricInterpretation) == (JPEG2000, "YBR_ICT")
    _check_slide(j2k, 2, 2, 32, 61)
    partial = read(jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32, matrix=(40, 70)))
    assert (partial.TotalPixelMatrixRows, partial.TotalPixelMatrixColumns) == (40, 70)
    with pytest.raises(ValueError, match="matrix"):
        jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32, matrix=(40, 100))
    monkeypatch.setattr(samples_slide, "TABLE_LIMIT", 1000)  # "auto" past what a BOT holds
    auto = read(jpeg_slide_bytes(tiles_across=2, tiles_down=2, tile=32))
    assert "ExtendedOffsetTable" in auto
    with pytest.raises(ValueError, match="Basic Offset Table"):
        jpeg_slide_bytes(tiles_across=2, tiles_down=2, tile=32, offsets="basic")


def test_write_fragments_refuses_a_mismatch() -> None:
    ds = read(jpeg_slide_bytes(tiles_across=1, tiles_down=1, tile=16))
    del ds.PixelData
    lengths = np.array([4, 3], dtype=np.int64)
    with pytest.raises(ValueError, match="fragment 1"):
        write_fragments(BytesIO(), ds, [b"abcd", b"ab"], lengths)
    with pytest.raises(ValueError, match="1 fragments written, not 2"):
        write_fragments(BytesIO(), ds, [b"abcd"], lengths)
    with pytest.raises(ValueError, match="fragment 2"):
        write_fragments(BytesIO(), ds, [b"abcd", b"abc", b"x"], lengths)
    with pytest.raises(ValueError, match="a frame at least"):
        write_fragments(BytesIO(), ds, [], np.array([], dtype=np.int64))
    out = BytesIO()
    assert write_fragments(out, ds, [b"abcd", b"abc"], lengths, "none") == "none"
    table, fragments = items(read(out.getvalue()).PixelData)
    assert (table, fragments) == (b"", [(0, b"abcd"), (12, b"abc\0")])


def test_streamed_slide_memory_stays_small(tmp_path: Path) -> None:
    def peak_writing(name: str, across: int, down: int) -> tuple[samples_slide.SlideInfo, int]:
        tracemalloc.start()
        try:
            info = write_jpeg_slide(
                tmp_path / name, tiles_across=across, tiles_down=down, distinct=8
            )
            return info, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, small_peak = peak_writing("small.dcm", 10, 5)
    info, peak = peak_writing("slide.dcm", 25, 20)
    assert info.path is not None
    assert info.size == info.path.stat().st_size > 8 * small.size
    # ten times the tiles, the same peak: the encoded tiles, one tile's arrays, 16 B a tile
    assert peak < small_peak + 16 * info.frames + 100_000, (small_peak, peak)
    assert peak < info.size / 4, f"peak {peak} B for a {info.size} B slide"
    assert (info.frames, info.offset_table, info.distinct) == (500, "basic", 8)
    ds = dcmread(info.path)
    _check_slide(ds, 25, 20, 256, 8)
    with info.path.open("rb") as fp:
        fp.seek(info.first_fragment - 8 - 4 * info.frames)  # the Basic Offset Table item
        assert _ITEM.unpack(fp.read(8)) == (0xFFFE, 0xE000, 4 * info.frames)
        fp.seek(info.size - 8)
        assert _ITEM.unpack(fp.read(8)) == (0xFFFE, 0xE0DD, 0)


def test_the_demo_set() -> None:
    found = compressed_samples(ct_size=64, slide_tiles=(3, 2))
    keys = [key for key, _ in found]
    assert len(set(keys)) == len(keys) == len(CT_SYNTAXES) + 3
    syntaxes = set()
    for key, data in found:
        ds = read(data)
        assert ds.file_meta.TransferSyntaxUID.is_compressed, key
        assert ds.pixel_array.size > 0
        syntaxes.add(ds.file_meta.TransferSyntaxUID)
    assert syntaxes == _DECODED
    assert keys[-1] == "slide/jpeg-tiled-3x2x256.dcm"


@pytest.mark.parametrize("syntax", CT_SYNTAXES)
def test_the_device_test_slices_are_what_the_writer_writes(syntax: str) -> None:
    """``tests/data/compressed`` (read by the device's decode tests, where the encoders
    are missing) holds ``compressed_ct``'s current output."""
    path = DATA / "compressed" / f"ct-{COMPRESSED[syntax]}.dcm"
    assert path.read_bytes() == compressed_ct(syntax, index=3, rows=128, columns=96)


@pytest.mark.parametrize("syntax", [JPEG2000Lossless, HTJ2KLossless])
def test_the_device_volume_slices_are_what_the_writer_writes(syntax: str) -> None:
    """``tests/data/volume``: 256 x 256 slices (large enough for the device's decoder),
    whose codestreams the device's worker test makes volumes of."""
    path = DATA / "volume" / f"ct-{COMPRESSED[syntax]}-256.dcm"
    assert path.read_bytes() == compressed_ct(syntax, index=3, rows=256, columns=256)
