"""The OME-Zarr plan of a slide (pure): chunk keys, edge chunks, metadata, what is refused.

The images as written by the worker and opened by zarr-python and ome-zarr-py are
tested in tests/ingest/sink/test_zarr.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.errors import LayoutRefused
from ingest.sink.ngff import Origin, ZarrPlan, zarr_plan, zarr_root
from tests.ingest.sink import slides


def _header(data: bytes) -> DicomHeader:
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    return header


def _plan(data: bytes, dtype: str = "uint8") -> ZarrPlan:
    origin = Origin(_header(data), "src", "a/b.dcm", None, "etag-1", len(data))
    return zarr_plan(zarr_root("out/src/a/b.dcm.npy"), origin, dtype, None)


def test_tiled_full_keys_edges_and_metadata() -> None:
    data = slides.tiled_full(3, 2, 32, matrix=(50, 70))  # the last row and column cut
    plan = _plan(data)
    assert plan.root == "out/src/a/b.dcm.zarr"
    assert plan.shape == (3, 50, 70)
    assert plan.chunks == (3, 32, 32)
    keys = [plan.chunk_key(plan.cell(k)) for k in range(plan.frames)]
    assert keys == [f"out/src/a/b.dcm.zarr/0/0/{r}/{c}" for r in range(2) for c in range(3)]
    assert list(plan.empty_cells()) == []

    tile = np.arange(32 * 32 * 3, dtype=np.uint32).astype(np.uint8).reshape(32, 32, 3)
    inner = plan.chunk(0, tile)
    assert inner.shape == (3, 32, 32)
    assert inner.flags.c_contiguous
    assert np.array_equal(inner, np.moveaxis(tile, -1, 0))
    corner = plan.chunk(5, tile)  # tile row 1, column 2: 18 rows and 6 columns inside
    assert np.array_equal(corner[:, :18, :6], np.moveaxis(tile, -1, 0)[:, :18, :6])
    assert not corner[:, 18:, :].any()
    assert not corner[:, :, 6:].any()

    keys_in_order = [key for key, _ in plan.metadata()]
    assert keys_in_order[-1] == "out/src/a/b.dcm.zarr/.zattrs"  # the marker goes last
    assert plan.metadata_keys_to_clear()[0] == "out/src/a/b.dcm.zarr/.zattrs"
    array = plan.array_metadata()
    assert array["dtype"] == "|u1"
    assert array["compressor"] is None
    assert array["dimension_separator"] == "/"
    attributes = dict(plan.metadata())["out/src/a/b.dcm.zarr/.zattrs"]
    multiscale = attributes["multiscales"][0]
    assert multiscale["version"] == "0.4"
    assert [a["name"] for a in multiscale["axes"]] == ["c", "y", "x"]
    transform = multiscale["datasets"][0]["coordinateTransformations"][0]
    assert transform == {"type": "scale", "scale": [1.0, 0.25, 0.25]}  # 0.00025 mm
    assert multiscale["axes"][1]["unit"] == "micrometer"
    provenance = attributes["dicom_ingest"]
    assert provenance["sop_instance_uid"] == _header(data).sop_instance_uid
    assert provenance["source"]["etag"] == "etag-1"
    assert [c["label"] for c in attributes["omero"]["channels"]] == ["R", "G", "B"]
    json.dumps(attributes, allow_nan=False)  # plain JSON, nothing a reader would trip on


def test_float_outputs_have_a_float_fill_value() -> None:
    plan = _plan(slides.tiled_full(2, 2, 32), dtype="float32")
    assert plan.array_metadata()["dtype"] == "<f4"
    assert plan.array_metadata()["fill_value"] == 0.0
    assert plan.chunk_bytes == 3 * 32 * 32 * 4


def test_sparse_slides_are_placed_by_their_positions_and_holes_filled() -> None:
    full = slides.tiled_full(3, 2, 32)
    keep = [4, 0, 2]  # out of order; frames 1, 3 and 5 missing
    plan = _plan(slides.sparse(full, keep))
    assert plan.frames == 3
    assert [plan.cell(k) for k in range(3)] == [(0, 1, 1), (0, 0, 0), (0, 0, 2)]
    assert list(plan.empty_cells()) == [(0, 0, 1), (0, 1, 0), (0, 1, 2)]
    assert plan.fill_chunk() == bytes(3 * 32 * 32)


def test_several_optical_paths_are_channels() -> None:
    plan = _plan(slides.optical_paths(slides.tiled_full(2, 1, 32), 2))
    assert plan.shape == (6, 32, 64)
    assert [plan.cell(k) for k in range(4)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    labels = plan.attributes["dicom_ingest"]["channels"]
    assert labels == ["1:R", "1:G", "1:B", "2:R", "2:G", "2:B"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("planes", "2 focal planes"),
        ("frames", "TILED_FULL with 6 frames for 6 tiles x 2 optical paths"),
        ("off-grid", "not a tile's place"),
        ("twice", "2 frames at tile row 0, column 0"),
        ("no-order", "no Plane Position"),
    ],
)
def test_what_is_refused_says_why(change: str, reason: str) -> None:
    full = slides.tiled_full(3, 2, 32)
    if change == "planes":
        data = slides.edited(full, TotalPixelMatrixFocalPlanes=2)
    elif change == "frames":
        data = slides.optical_paths(full, 2, frames_too=False)
    elif change == "no-order":
        data = slides.edited(full, DimensionOrganizationType="3D")
    else:
        sparse = slides.sparse(full, [0, 1])
        ds = slides.read(sparse)
        position = ds.PerFrameFunctionalGroupsSequence[1].PlanePositionSlideSequence[0]
        position.ColumnPositionInTotalImagePixelMatrix = 5 if change == "off-grid" else 1
        data = slides.write(ds)
    with pytest.raises(LayoutRefused, match=reason) as refused:
        _plan(data)
    assert refused.value.reason == "layout_refused"
    assert not refused.value.retriable
    assert refused.value.step == "sink"
