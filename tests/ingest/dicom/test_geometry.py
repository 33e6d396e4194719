"""ingest/dicom/geometry.py: the affine and the geometry of every sample with one.

Each affine is checked two ways: against nibabel's DICOM reader (an independent
implementation: its row and column axes and origin are ours in another axis
order, and its frames lie on the same points as ours), and against the
standard's equation (PS3.3 C.7.6.2.1.1) evaluated for every frame's corners
from the values pydicom reads. A slide's matrix affine is checked against
highdicom's. The raw per-frame reader must agree with
pydicom's reading of the same groups; what an object lacks is named.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import highdicom
import numpy as np
import numpy.typing as npt
import pydicom
import pytest
from pydicom.dataset import Dataset
from pydicom.uid import RLELossless

from ingest.dicom.frames import per_frame_planes
from ingest.dicom.geometry import Geometry, flat_group, geometry_of, lps_to_ras, per_frame_values
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.dicom.rescale import PER_FRAME_GROUPS
from ingest.dicom.slide import slide_of
from ingest.dicom.walk import Walker
from ingest.embedded import samples
from ingest.embedded.samples_compressed import compressed_ct
from ingest.embedded.samples_slide import jpeg_slide_bytes
from ingest_gpu.formats import PixelFormat

with warnings.catch_warnings():  # nibabel warns at import that its DICOM reader is young
    warnings.simplefilter("ignore", UserWarning)
    from nibabel.nicom import dicomwrappers

# pydicom's and pydicom-data's files with an Image Plane module or plane functional groups
WITH_GEOMETRY = (
    "CT_small.dcm",
    "MR_small.dcm",
    "MR_small_implicit.dcm",
    "MR_small_bigendian.dcm",
    "MR_small_RLE.dcm",
    "MR2_UNCR.dcm",
    "MR2_UNCI.dcm",
    "693_UNCR.dcm",
    "693_UNCI.dcm",
    "examples_overlay.dcm",
    "rtdose.dcm",
    "rtdose_1frame.dcm",
    "eCT_Supplemental.dcm",
    "liver.dcm",
)


def header(data: bytes) -> DicomHeader:
    parsed = parse_header(data, len(data))
    assert isinstance(parsed, DicomHeader)
    return parsed


def geometry_of_bytes(data: bytes) -> Geometry:
    found = header(data).geometry
    assert found is not None
    return found


def the_samples() -> list[tuple[str, bytes]]:
    out = [(name, samples.example_bytes(name)) for name in WITH_GEOMETRY]
    out += [(key, data) for key, data in samples.synthetic_ct_series(3, rows=16, columns=24)]
    out.append(("enhanced-ct", samples.synthetic_multiframe(6, 8, 12)))
    out.append(("ct-rle", compressed_ct(RLELossless, 3, rows=16, columns=16)))
    return out


def nibabel_affine(ds: Dataset) -> npt.NDArray[np.float64] | None:
    """nibabel's affine, which maps (row, column, frame) in its own frame order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the DICOM readers are highly experimental"
        wrapper: Any
        if "PerFrameFunctionalGroupsSequence" in ds:
            wrapper = dicomwrappers.MultiframeWrapper(ds)  # type: ignore[no-untyped-call]
        else:
            wrapper = dicomwrappers.wrapper_from_data(ds)  # type: ignore[no-untyped-call]
        return np.asarray(wrapper.affine, dtype=np.float64)


def frame_positions(ds: Dataset) -> list[npt.NDArray[np.float64]]:
    """Each frame's Image Position (Patient), read with pydicom as the standard places it."""
    frames = int(ds.get("NumberOfFrames") or 1)
    if "PerFrameFunctionalGroupsSequence" in ds:
        return [
            np.asarray(group.PlanePositionSequence[0].ImagePositionPatient, dtype=np.float64)
            for group in ds.PerFrameFunctionalGroupsSequence
        ]
    first = np.asarray(ds.ImagePositionPatient, dtype=np.float64)
    if frames == 1:
        return [first]
    iop = np.asarray(ds.ImageOrientationPatient, dtype=np.float64)
    normal = np.cross(iop[:3], iop[3:])
    offsets = np.asarray(ds.GridFrameOffsetVector, dtype=np.float64)  # RT Dose
    return [first + normal * (k - offsets[0]) for k in offsets]


def plane_values(ds: Dataset) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(Image Orientation (Patient), Pixel Spacing) wherever the object keeps them."""
    shared = ds.get("SharedFunctionalGroupsSequence")
    if shared:
        group = shared[0]
        iop = group.PlaneOrientationSequence[0].ImageOrientationPatient
        spacing = group.PixelMeasuresSequence[0].PixelSpacing
    else:
        iop, spacing = ds.ImageOrientationPatient, ds.PixelSpacing
    return np.asarray(iop, dtype=np.float64), np.asarray(spacing, dtype=np.float64)


@pytest.mark.parametrize(("name", "data"), the_samples(), ids=lambda v: str(v)[:40])
def test_affine_agrees_with_the_standard_and_with_nibabel(name: str, data: bytes) -> None:
    found = geometry_of_bytes(data)
    assert found.affine is not None, (found.missing, found.affine_note)
    affine = np.asarray(found.affine)
    ds = pydicom.dcmread(io.BytesIO(data), force=True)
    rows, columns = int(ds.Rows), int(ds.Columns)

    # PS3.3 C.7.6.2.1.1: P(r, c) = S + c * Δc * X + r * Δr * Y, for every frame's corners
    iop, (row_spacing, column_spacing) = plane_values(ds)
    along_row, down_column = iop[:3], iop[3:]
    positions = frame_positions(ds)
    assert len(positions) == int(ds.get("NumberOfFrames") or 1)
    for f, start in enumerate(positions):
        for r, c in ((0, 0), (rows - 1, 0), (0, columns - 1), (rows - 1, columns - 1)):
            expected = start + c * column_spacing * along_row + r * row_spacing * down_column
            np.testing.assert_allclose(affine @ [f, r, c, 1], [*expected, 1], atol=1e-4)

    theirs = nibabel_affine(ds)
    assert theirs is not None
    np.testing.assert_allclose(affine[:3, 1], theirs[:3, 0], atol=1e-6)  # down the rows
    np.testing.assert_allclose(affine[:3, 2], theirs[:3, 1], atol=1e-6)  # along a row
    frames = len(positions)
    if frames == 1:  # one slice: the same origin; the slice axis differs in sign by convention
        np.testing.assert_allclose(affine[:3, 3], theirs[:3, 3], atol=1e-6)
        np.testing.assert_allclose(abs(affine[:3, 0]), abs(theirs[:3, 2]), atol=1e-6)
        return
    ours = sorted(tuple(np.round(affine @ [k, 0, 0, 1], 4)) for k in range(frames))
    if "GridFrameOffsetVector" in ds:  # nibabel reads RT Dose as one plane
        assert ours[0] == tuple(np.round(theirs[:, 3], 4)) or ours[-1] == tuple(
            np.round(theirs[:, 3], 4)
        )
        return
    nib = sorted(tuple(np.round(theirs @ [0, 0, k, 1], 4)) for k in range(frames))
    assert ours == nib  # nibabel orders frames its own way: the same points


def test_sidecar_geometry_is_json_and_names_what_is_missing() -> None:
    ds = pydicom.dcmread(io.BytesIO(samples.synthetic_ct_series(1, 8, 8)[0][1]))
    del ds.PixelSpacing
    ds.ImageOrientationPatient = ["1", "0", "0", "0", "1"]  # five numbers
    buffer = io.BytesIO()
    ds.save_as(buffer)
    found = geometry_of_bytes(buffer.getvalue())
    assert found.affine is None
    assert "PixelSpacing" in found.missing
    assert found.invalid == ("ImageOrientationPatient",)
    assert found.image_orientation is None  # never guessed
    shown = found.as_json()
    assert shown["affine"] is None
    assert shown["missing"] == list(found.missing)
    assert shown["image_position_patient"] == list(found.image_position or ())


def test_secondary_capture_has_no_affine_and_says_why() -> None:
    found = geometry_of_bytes(samples.example_bytes("examples_rgb_color.dcm"))
    assert found.affine is None
    assert set(found.missing) >= {"PixelSpacing", "ImageOrientationPatient", "ImagePositionPatient"}


def test_uneven_frames_get_no_affine_but_keep_their_positions() -> None:
    ds = Dataset()
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    ds.PixelSpacing = [0.5, 0.5]
    groups = [{"ImagePositionPatient": (0.0, 0.0, z)} for z in (0.0, 1.0, 3.0)]
    found = geometry_of(ds, 3, per_frame_values(groups))
    assert found.affine is None
    assert found.affine_note is not None
    assert found.frame_positions == ((0.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.0, 0.0, 3.0))


def test_ras_flips_x_and_y() -> None:
    found = geometry_of_bytes(samples.example_bytes("CT_small.dcm"))
    ras = lps_to_ras(found.affine or ())
    lps = np.asarray(found.affine)
    np.testing.assert_array_equal(ras[:2], -lps[:2])
    np.testing.assert_array_equal(ras[2:], lps[2:])


@pytest.mark.parametrize("name", ["eCT_Supplemental.dcm", "liver.dcm", "enhanced-ct"])
def test_raw_per_frame_reader_agrees_with_pydicom(name: str) -> None:
    if name == "enhanced-ct":
        data = samples.synthetic_multiframe(5, 4, 4)
    else:
        data = samples.example_bytes(name)  # sequences of undefined length
    ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    assert ds.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.1"
    (value,) = Walker(data, implicit_vr=False).find_any(132, len(data), (PER_FRAME_GROUPS,))
    assert value is not None
    fast = per_frame_planes(data[value[0] : value[1]], implicit_vr=False)
    assert fast is not None
    slow = [flat_group(group) for group in ds.PerFrameFunctionalGroupsSequence]
    assert per_frame_values(fast) == per_frame_values(slow)
    assert all(v.position is not None for v in per_frame_values(fast))


def test_slide_places_from_tiled_full_and_from_per_frame_positions() -> None:
    data = jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32)
    slide = header(data).slide
    assert slide is not None
    assert slide.pixel_spacing == (0.00025, 0.00025)
    assert slide.optical_paths == ("1",)
    places = slide.frame_places()
    assert places == ([1, 33, 65, 1, 33, 65], [1, 1, 1, 33, 33, 33])
    shown = slide.as_json()  # TILED_FULL: the order places the tiles, none are listed
    assert (shown["tiles_across"], shown["tiles_down"], shown["frame_columns"]) == (3, 2, None)
    frames = np.arange(slide.frames)  # docs/output.md's formula
    c = (frames % (3 * 2) % 3) * slide.tile_columns + 1
    r = (frames % (3 * 2) // 3) * slide.tile_rows + 1
    assert (c.tolist(), r.tolist()) == places
    # the same tiles stored TILED_SPARSE, in another order, each with its Plane Position
    ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    ds.DimensionOrganizationType = "TILED_SPARSE"
    order = [5, 0, 4, 1, 3, 2]
    groups = []
    for k in order:
        group, position = Dataset(), Dataset()
        position.ColumnPositionInTotalImagePixelMatrix = places[0][k]
        position.RowPositionInTotalImagePixelMatrix = places[1][k]
        group.PlanePositionSlideSequence = [position]
        groups.append(flat_group(group))
    pixel = PixelFormat(32, 32, 6, 3, 8, 8, False, False)
    sparse = slide_of(ds, pixel, per_frame_values(groups))
    assert sparse is not None
    assert sparse.frame_places() == ([places[0][k] for k in order], [places[1][k] for k in order])
    assert sparse.as_json()["frame_columns"] == [places[0][k] for k in order]


def test_slide_affine_agrees_with_highdicom() -> None:
    data = jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32)
    slide = header(data).slide
    assert slide is not None
    assert slide.affine is not None
    ours = np.asarray(slide.affine)
    ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    theirs = highdicom.spatial.PixelToReferenceTransformer.for_image(
        ds, for_total_pixel_matrix=True
    ).affine  # maps (column, row)
    np.testing.assert_allclose(ours[:, [1, 0, 3]], theirs[:, [0, 1, 3]], atol=1e-12)
    corner = ours @ [slide.total_rows - 1, slide.total_columns - 1, 0, 1]
    np.testing.assert_allclose(
        corner, theirs @ [slide.total_columns - 1, slide.total_rows - 1, 0, 1], atol=1e-12
    )
