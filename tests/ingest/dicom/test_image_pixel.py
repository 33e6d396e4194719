"""The Image Pixel module's one set of rules (``ingest.dicom.image_pixel``), and both
of the header's paths giving its one error for each violation.

Objects are written with pydicom and read by ``parse_header``: as stored
(MONOCHROME2, 16 bits: the direct reader, else pydicom and ``pixel_format``) and
decoded first (Bits Allocated 1, big endian: ``codec_from_dataset``). Bits
Allocated 1 is what pydicom's ``pixel_array`` makes of it: one ``uint8`` a pixel.
"""

from __future__ import annotations

import re
import warnings
from io import BytesIO
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydicom import dcmread, dcmwrite
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (
    UID,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    SecondaryCaptureImageStorage,
    generate_uid,
)

from ingest.dicom.codec import conversions, decode_native
from ingest.dicom.image_pixel import BITS_ALLOCATED, SAMPLES_OF, UNCONVERTED, image_pixel
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.errors import IngestError, MalformedDicom, UnsupportedDicom

NAMES = {
    "SamplesPerPixel": "Samples per Pixel",
    "Rows": "Rows",
    "Columns": "Columns",
    "BitsAllocated": "Bits Allocated",
    "BitsStored": "Bits Stored",
    "PixelRepresentation": "Pixel Representation",
}


@st.composite
def modules(draw: st.DrawFn) -> dict[str, Any]:
    """A valid Image Pixel module, as pydicom's ``Dataset.get`` gives its values."""
    photometric = draw(st.sampled_from(sorted(SAMPLES_OF)))
    samples = SAMPLES_OF[photometric]
    allocated = draw(st.sampled_from(BITS_ALLOCATED))
    module: dict[str, Any] = {
        "PhotometricInterpretation": photometric,
        "SamplesPerPixel": samples,
        "Rows": draw(st.integers(1, 65535)),
        "Columns": draw(st.integers(1, 65535)),
        "BitsAllocated": allocated,
        "BitsStored": draw(st.integers(1, allocated)),
        "PixelRepresentation": draw(st.integers(0, 1)),
        "NumberOfFrames": draw(st.sampled_from([None, "", 0, 1, 7, "3"])),
    }
    if samples == 3:
        module["PlanarConfiguration"] = draw(st.integers(0, 1))
    return module


@settings(max_examples=200, deadline=None)
@given(modules())
def test_a_valid_module_is_read_as_it_is(module: dict[str, Any]) -> None:
    image = image_pixel(module)
    frames = module["NumberOfFrames"]
    assert image.number_of_frames == (int(frames) if frames not in (None, "", 0) else 1)
    assert image.photometric_interpretation == module["PhotometricInterpretation"]
    assert image.samples_per_pixel == module["SamplesPerPixel"]
    assert (image.rows, image.columns) == (module["Rows"], module["Columns"])
    assert (image.bits_allocated, image.bits_stored) == (
        module["BitsAllocated"],
        module["BitsStored"],
    )
    assert image.pixel_representation == module["PixelRepresentation"]
    assert image.planar_configuration == module.get("PlanarConfiguration", 0)


def _violations() -> list[tuple[str, dict[str, Any], type[IngestError], str]]:
    """(id, the change to a valid MONOCHROME2 module, the error, its whole message)."""
    cases: list[tuple[str, dict[str, Any], type[IngestError], str]] = [
        (
            "photometric-missing",
            {"PhotometricInterpretation": None},
            MalformedDicom,
            "missing Photometric Interpretation",
        ),
        (
            "photometric-two-values",
            {"PhotometricInterpretation": ["MONOCHROME2", "RGB"]},
            MalformedDicom,
            "Photometric Interpretation is not a single value",
        ),
        (
            "photometric-unknown",
            {"PhotometricInterpretation": "SECRET NAME"},
            UnsupportedDicom,
            "photometric interpretation (unknown value) is not supported",
        ),
        (
            "samples",
            {"SamplesPerPixel": 3, "PlanarConfiguration": 0},
            MalformedDicom,
            "MONOCHROME2 with 3 samples per pixel",
        ),
        ("bits-64", {"BitsAllocated": 64}, UnsupportedDicom, "Bits Allocated 64 is not supported"),
        (
            "bits-12",
            {"BitsAllocated": 12, "BitsStored": 12},
            MalformedDicom,
            "Bits Allocated 12 is not 1, 8, 16 or 32",
        ),
        (
            "bits-24",
            {"BitsAllocated": 24, "BitsStored": 24},
            MalformedDicom,
            "Bits Allocated 24 is not 1, 8, 16 or 32",
        ),
        ("stored-0", {"BitsStored": 0}, MalformedDicom, "Bits Stored 0 is not within 1..16"),
        ("stored-17", {"BitsStored": 17}, MalformedDicom, "Bits Stored 17 is not within 1..16"),
        (
            "stored-over-1-bit",
            {"BitsAllocated": 1, "BitsStored": 8},
            MalformedDicom,
            "Bits Stored 8 is not within 1..1",
        ),
        (
            "representation",
            {"PixelRepresentation": 2},
            MalformedDicom,
            "Pixel Representation 2 is not 0 or 1",
        ),
        ("rows-0", {"Rows": 0}, MalformedDicom, "an image of 0 x 3 pixels"),
        ("columns-0", {"Columns": 0}, MalformedDicom, "an image of 2 x 0 pixels"),
        (
            "frames-text",
            {"NumberOfFrames": "1A"},
            MalformedDicom,
            "Number of Frames is not an integer",
        ),
        (
            "frames-negative",
            {"NumberOfFrames": -1},
            MalformedDicom,
            "Number of Frames -1 is below 1",
        ),
        (
            "planar",
            {"PhotometricInterpretation": "RGB", "SamplesPerPixel": 3, "PlanarConfiguration": 2},
            MalformedDicom,
            "Planar Configuration 2 is not 0 or 1",
        ),
    ]
    cases += [
        (
            f"unconverted-{photometric}",
            {"PhotometricInterpretation": photometric, "SamplesPerPixel": 3},
            UnsupportedDicom,
            f"photometric interpretation {photometric!r} is not supported",
        )
        for photometric in sorted(UNCONVERTED)
    ]
    for keyword, name in NAMES.items():
        cases.append((f"missing-{keyword}", {keyword: None}, MalformedDicom, f"missing {name}"))
        cases.append(
            (
                f"two-{keyword}",
                {keyword: [1, 2]},
                MalformedDicom,
                f"{name} is not a single integer",
            )
        )
    return cases


VIOLATIONS = _violations()
PLAIN: dict[str, Any] = {
    "PhotometricInterpretation": "MONOCHROME2",
    "SamplesPerPixel": 1,
    "Rows": 2,
    "Columns": 3,
    "BitsAllocated": 16,
    "BitsStored": 12,
    "PixelRepresentation": 0,
}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [case[1:] for case in VIOLATIONS],
    ids=[c[0] for c in VIOLATIONS],
)
def test_each_violation_has_its_one_error(
    change: dict[str, Any], error: type[IngestError], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        image_pixel({**PLAIN, **change})


def _object(module: dict[str, Any], syntax: UID, pixel_data: bytes) -> bytes:
    """A Secondary Capture object of ``module``, written by pydicom in ``syntax``."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = syntax
    ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = generate_uid()
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.Modality = "OT"
    for keyword, value in module.items():
        if value is not None and value != "":
            setattr(ds, keyword, value)
    ds.PixelData = pixel_data
    allocated = module.get("BitsAllocated")
    ds["PixelData"].VR = "OW" if isinstance(allocated, int) and allocated > 8 else "OB"
    out = BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns of the values under test
        dcmwrite(out, ds, enforce_file_format=True)
    return out.getvalue()


# The header's paths: as stored (the direct reader, then pydicom) and decoded first
PATHS = {
    "as-stored": ({}, ExplicitVRLittleEndian),
    "1-bit": ({"BitsAllocated": 1, "BitsStored": 1}, ExplicitVRLittleEndian),
    "big-endian": ({}, ExplicitVRBigEndian),
}
# what pydicom cannot write as a valid element: image_pixel's own test covers them
UNWRITTEN = {"frames-text", "photometric-two-values"}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [case[1:] for case in VIOLATIONS if case[0] not in UNWRITTEN],
    ids=[c[0] for c in VIOLATIONS if c[0] not in UNWRITTEN],
)
def test_every_path_through_the_header_gives_the_same_error(
    path: str, change: dict[str, Any], error: type[IngestError], message: str
) -> None:
    base, syntax = PATHS[path]
    module = {**PLAIN, **base, **change}
    with pytest.raises(IngestError) as expected:
        image_pixel(module)
    data = _object(module, syntax, bytes(64))
    with pytest.raises(error) as raised:
        parse_header(data, len(data))
    assert str(raised.value) == str(expected.value)


def _parse(data: bytes) -> DicomHeader:
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    return header


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(1, 4),
    st.sampled_from([("MONOCHROME2", 1, 0), ("MONOCHROME1", 1, 0), ("RGB", 3, 0), ("RGB", 3, 1)]),
    st.integers(0, 1),
    st.sampled_from([ExplicitVRLittleEndian, ExplicitVRBigEndian]),
    st.integers(0, 2**32 - 1),
)
def test_one_bit_pixels_are_pydicoms(
    rows: int,
    columns: int,
    frames: int,
    colour: tuple[str, int, int],
    representation: int,
    syntax: UID,
    seed: int,
) -> None:
    """Bits Allocated 1, frames that start inside a byte included: one uint8 a pixel,
    as pydicom's ``pixel_array``, whatever Pixel Representation says."""
    photometric, samples, planar = colour
    module: dict[str, Any] = {
        **PLAIN,
        "PhotometricInterpretation": photometric,
        "SamplesPerPixel": samples,
        "Rows": rows,
        "Columns": columns,
        "BitsAllocated": 1,
        "BitsStored": 1,
        "PixelRepresentation": representation,
        "NumberOfFrames": frames,
    }
    if samples == 3:
        module["PlanarConfiguration"] = planar
    bits = rows * columns * samples * frames
    packed = np.random.default_rng(seed).bytes(-(-bits // 8))
    data = _object(module, syntax, packed + b"\0" * (len(packed) % 2))
    header = _parse(data)
    assert header.codec is not None
    assert "bits_allocated_1->uint8" in conversions(header.codec)
    value = data[header.pixel_offset : header.pixel_offset + header.pixel_length]
    got = decode_native(header.codec, value, 0, frames)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = dcmread(BytesIO(data)).pixel_array
    assert got.dtype == want.dtype == np.uint8
    assert np.array_equal(got, want.reshape(got.shape))
    assert header.pixel.shape == got.shape
