"""ingest.embedded.samples: the objects parse with pydicom and are what they promise."""

from __future__ import annotations

import inspect
import math
import struct
import warnings
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from pydicom import dcmread
from pydicom.dataset import FileDataset
from pydicom.encaps import generate_frames

from ingest.dicom.fragments import ENCAPSULATED_UNCOMPRESSED
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded import samples
from ingest.embedded.sample_parts import OffsetTable, write_encapsulated
from ingest.embedded.samples_multiframe import synthetic_multiframe
from ingest.errors import NotDicom
from ingest.settings import Settings


def read(data: bytes) -> FileDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom's remarks on odd-but-valid test files
        return dcmread(BytesIO(data))


def test_pydicom_examples() -> None:
    examples = dict(samples.pydicom_examples())
    assert set(examples) == {*samples.EXAMPLES_SUPPORTED, *samples.EXAMPLES_DEAD_LETTERED}
    for name in samples.EXAMPLES_NATIVE:
        ds = read(examples[name])
        assert ds.file_meta.TransferSyntaxUID in ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1")
        assert "PixelData" in ds
    for name in samples.EXAMPLES_DECODED:
        if read(examples[name]).file_meta.TransferSyntaxUID.is_deflated:
            continue  # inflated before it is parsed: tests/ingest/dicom/test_deflate.py
        header = parse_header(examples[name], len(examples[name]))
        assert isinstance(header, DicomHeader), name
        assert header.codec is not None, name
    assert "image_dfl.dcm" in samples.EXAMPLES_DECODED
    assert samples.EXAMPLES_DEAD_LETTERED == {}
    assert [n for n, _ in samples.pydicom_examples(dead_lettered=False)] == list(
        samples.EXAMPLES_SUPPORTED
    )
    with pytest.raises(FileNotFoundError):
        samples.example_bytes("no-such-file.dcm")


def test_ct_series() -> None:
    series = samples.synthetic_ct_series(3, rows=64, columns=80, seed=7)
    assert [name for name, _ in series] == [f"ct-series/slice-000{i}.dcm" for i in (1, 2, 3)]
    datasets = [read(data) for _, data in series]
    assert len({ds.StudyInstanceUID for ds in datasets}) == 1
    assert len({ds.SeriesInstanceUID for ds in datasets}) == 1
    assert len({ds.SOPInstanceUID for ds in datasets}) == 3
    for index, ds in enumerate(datasets):
        assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.2"
        assert ds.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.1"
        assert (ds.BitsAllocated, ds.BitsStored, ds.PixelRepresentation) == (16, 12, 1)
        assert (ds.RescaleSlope, ds.RescaleIntercept, ds.InstanceNumber) == (1, -1024, index + 1)
        hu = ds.pixel_array.astype(np.int32) - 1024
        assert hu.shape == (64, 80)
        assert hu.min() == -3024  # outside the reconstruction circle
        assert -1100 < np.median(hu) < 100
        assert hu.max() > 500
    assert samples.synthetic_ct_series(3, rows=64, columns=80, seed=7) == series
    assert samples.synthetic_ct_series(1, rows=64, columns=80, seed=8)[0] != series[0]
    (_, full), *_ = samples.synthetic_ct_series(1)
    assert 512 * 512 * 2 < len(full) < 512 * 512 * 2 + 4096


@pytest.mark.parametrize(
    ("bits", "signed"), [((8, 8), False), ((8, 6), True), ((16, 12), False), ((32, 24), True)]
)
def test_multiframe_values(bits: tuple[int, int], signed: bool) -> None:
    allocated, stored = bits
    data = samples.synthetic_multiframe(
        5, 6, 7, bits_allocated=allocated, bits_stored=stored, signed=signed
    )
    ds = read(data)
    assert (ds.NumberOfFrames, ds.Rows, ds.Columns) == (5, 6, 7)
    assert (ds.BitsAllocated, ds.BitsStored, ds.PixelRepresentation) == (*bits, int(signed))
    decoded = ds.pixel_array
    assert decoded.shape == (5, 6, 7)
    f, r, c = np.ogrid[0:5, 0:6, 0:7]
    span = 1 << stored
    expected = ((7 * r + 3 * c + 31 * f) * max(1, span // 509)) % span - (span // 2) * signed
    np.testing.assert_array_equal(decoded, expected)
    raw = np.frombuffer(ds.PixelData, f"<u{allocated // 8}")
    assert bool(np.any(raw >> stored)) == (stored < allocated)  # garbage in the unused bits
    groups = ds.PerFrameFunctionalGroupsSequence
    assert len(groups) == 5
    slopes = [float(g.PixelValueTransformationSequence[0].RescaleSlope) for g in groups]
    assert slopes == [0.5, 0.75, 1.0, 1.25, 0.5]


def test_multiframe_shared_rescale_and_file(tmp_path: Path) -> None:
    data = samples.synthetic_multiframe(3, 4, 5, per_frame_rescale=False)
    ds = read(data)
    shared = ds.SharedFunctionalGroupsSequence[0].PixelValueTransformationSequence[0]
    assert (shared.RescaleSlope, shared.RescaleIntercept) == (0.5, -100)
    assert all(
        "PixelValueTransformationSequence" not in g for g in ds.PerFrameFunctionalGroupsSequence
    )
    path = samples.synthetic_multiframe(3, 4, 5, per_frame_rescale=False, path=tmp_path / "mf.dcm")
    assert path.read_bytes() == data
    odd = samples.synthetic_multiframe(1, 3, 3, bits_allocated=8)
    assert len(read(odd).PixelData) == 10  # 9 bytes and the pad
    with pytest.raises(ValueError, match="4 GiB"):
        samples.synthetic_multiframe(20_000, 512, 512, path=tmp_path / "never.dcm")
    assert not (tmp_path / "never.dcm").exists()
    with pytest.raises(ValueError, match="bits_stored"):
        samples.synthetic_multiframe(1, 2, 2, bits_stored=17)


def test_rgb_planar_layouts_decode_the_same() -> None:
    interleaved = read(samples.synthetic_rgb(2, 3, 5))
    planar = read(samples.synthetic_rgb(2, 3, 5, planar=True))
    assert (interleaved.PlanarConfiguration, planar.PlanarConfiguration) == (0, 1)
    assert interleaved.SOPClassUID == "1.2.840.10008.5.1.4.1.1.7.4"
    assert interleaved.pixel_array.shape == (2, 3, 5, 3)
    np.testing.assert_array_equal(interleaved.pixel_array, planar.pixel_array)
    assert interleaved.PixelData != planar.PixelData
    single = read(samples.synthetic_rgb(1, 3, 3))
    assert single.pixel_array.shape == (3, 3, 3)
    assert len(single.PixelData) == 28


@pytest.mark.parametrize("offsets", ["basic", "extended", "none"])
def test_encapsulated_uncompressed_holds_the_native_frames(offsets: OffsetTable) -> None:
    """The same frames in both syntaxes: pydicom finds them in the fragments (with each
    offset table), one per fragment, padded to even."""
    for native, encapsulated in (
        (samples.synthetic_rgb(5, 17, 9), samples.synthetic_rgb(5, 17, 9, encapsulated=offsets)),
        (
            synthetic_multiframe(4, 20, 24, bits_allocated=32, signed=True),
            synthetic_multiframe(4, 20, 24, bits_allocated=32, signed=True, encapsulated=offsets),
        ),
    ):
        ds = read(encapsulated)
        assert str(ds.file_meta.TransferSyntaxUID) == ENCAPSULATED_UNCOMPRESSED
        assert ("ExtendedOffsetTable" in ds) == (offsets == "extended")
        frames = int(ds.NumberOfFrames)
        table = None
        if offsets == "extended":
            table = (
                list(struct.unpack(f"<{frames}Q", ds.ExtendedOffsetTable)),
                list(struct.unpack(f"<{frames}Q", ds.ExtendedOffsetTableLengths)),
            )
        pieces = list(
            generate_frames(ds.PixelData, number_of_frames=frames, extended_offsets=table)
        )
        assert len(pieces) == frames
        frame = len(read(native).PixelData.rstrip(b"\0")) // frames  # no pad in these
        # the Extended Offset Table's lengths are the frames' (the fragments may be padded)
        assert all(len(p) in (frame, frame + frame % 2) for p in pieces)
        assert b"".join(p[:frame] for p in pieces) == read(native).PixelData[: frames * frame]


def test_encapsulated_writer_refuses_what_it_cannot_write() -> None:
    ds = read(samples.synthetic_rgb(2, 4, 4))
    del ds.PixelData
    with pytest.raises(ValueError, match="not 48"):
        write_encapsulated(BytesIO(), ds, [bytes(48), bytes(47)], 2, 48)
    with pytest.raises(ValueError, match="1 frames written, not 2"):
        write_encapsulated(BytesIO(), ds, [bytes(48)], 2, 48)
    with pytest.raises(ValueError, match="Basic Offset Table"):
        write_encapsulated(BytesIO(), ds, iter(()), 2**20, 4096 + 1)  # past 4 GiB


def test_not_dicom() -> None:
    name, data = samples.not_dicom()
    assert name.endswith(".png")
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert b"DICM" not in data


def test_demo_objects(tmp_path: Path) -> None:
    objects = samples.demo_objects(tmp_path, ct_slices=2, multiframe_shape=(3, 16, 16))
    keys = [o.key for o in objects]
    assert len(keys) == len(set(keys)) == len(samples.pydicom_examples()) + 2 + 1 + 1 + 1
    (slide,) = [o for o in objects if o.key.startswith("slide/")]
    assert str(read(slide.read()).file_meta.TransferSyntaxUID) == ENCAPSULATED_UNCOMPRESSED
    part_size = inspect.signature(Settings).parameters["part_size"].default
    assert slide.size > part_size  # the demo's ranged Encapsulated Uncompressed
    expect = {o.key: o.expect for o in objects}
    assert expect["pydicom/CT_small.dcm"] == "ok"
    assert expect["pydicom/image_dfl.dcm"] == "ok"  # Deflated: inflated as it is read
    assert expect["misc/not-dicom.png"] == NotDicom.reason
    (big,) = [o for o in objects if o.key.startswith("multiframe/")]
    assert isinstance(big.data, Path)
    assert big.data.parent == tmp_path
    assert big.size == big.data.stat().st_size == len(big.read())
    assert read(big.read()).NumberOfFrames == 3
    # the default multi-frame object is the >= 100 MB one the demo promises
    default = inspect.signature(samples.demo_objects).parameters["multiframe_shape"].default
    assert math.prod(default) * 2 >= 100_000_000
