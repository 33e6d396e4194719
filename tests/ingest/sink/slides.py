"""Slides for the OME-Zarr tests: the sample writer's TILED_FULL slide, and variants of it
made with pydicom (TILED_SPARSE with frames left out and shuffled, several focal planes
or optical paths), and the whole matrix pydicom's decode of their tiles makes."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from pydicom import dcmread
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate, generate_frames

from ingest.embedded.samples_slide import jpeg_slide_bytes
from tests.reference import reference_array


def tiled_full(across: int, down: int, tile: int, matrix: tuple[int, int] | None = None) -> bytes:
    return jpeg_slide_bytes(tiles_across=across, tiles_down=down, tile=tile, matrix=matrix)


def read(data: bytes) -> Dataset:
    return dcmread(io.BytesIO(data))


def write(ds: Dataset) -> bytes:
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def sparse(data: bytes, keep: Sequence[int]) -> bytes:
    """``data``'s TILED_FULL slide as TILED_SPARSE: only frames ``keep`` of it, in that
    order, each placed by its own Plane Position (Slide)."""
    ds = dcmread(io.BytesIO(data))
    frames = list(generate_frames(ds.PixelData, number_of_frames=int(ds.NumberOfFrames)))
    across = -(-int(ds.TotalPixelMatrixColumns) // int(ds.Columns))
    groups = []
    for k in keep:
        position = Dataset()
        position.ColumnPositionInTotalImagePixelMatrix = (k % across) * int(ds.Columns) + 1
        position.RowPositionInTotalImagePixelMatrix = (k // across) * int(ds.Rows) + 1
        position.XOffsetInSlideCoordinateSystem = "20"
        position.YOffsetInSlideCoordinateSystem = "40"
        position.ZOffsetInSlideCoordinateSystem = "0"
        group = Dataset()
        group.PlanePositionSlideSequence = [position]
        groups.append(group)
    ds.PerFrameFunctionalGroupsSequence = groups
    ds.DimensionOrganizationType = "TILED_SPARSE"
    ds.NumberOfFrames = len(keep)
    ds.PixelData = encapsulate([frames[k] for k in keep])
    return write(ds)


def edited(data: bytes, **values: object) -> bytes:
    """``data`` with top-level attributes set (by keyword)."""
    ds = dcmread(io.BytesIO(data))
    for keyword, value in values.items():
        setattr(ds, keyword, value)
    return write(ds)


def optical_paths(data: bytes, count: int, frames_too: bool = True) -> bytes:
    """``data`` with ``count`` optical paths (identifiers 1..count), its tiles repeated for
    each (TILED_FULL: every tile of path 1, then of path 2 ...); ``frames_too`` False:
    the paths only, the frames as they were."""
    ds = dcmread(io.BytesIO(data))
    items = []
    for n in range(count):
        item = Dataset()
        item.update(ds.OpticalPathSequence[0])
        item.OpticalPathIdentifier = str(n + 1)
        items.append(item)
    ds.OpticalPathSequence = items
    ds.NumberOfOpticalPaths = count
    if frames_too:
        frames = list(generate_frames(ds.PixelData, number_of_frames=int(ds.NumberOfFrames)))
        ds.PixelData = encapsulate(frames * count)
        ds.NumberOfFrames = len(frames) * count
    return write(ds)


def expected_matrix(data: bytes, places: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
    """The whole matrix, ``(samples, rows, columns)`` uint8, that pydicom's decode of the
    slide's tiles makes when tile ``k`` goes to its place: TILED_FULL's order (row by
    row), or ``places[k]`` (tile row, tile column); 0 where no tile goes."""
    ds = dcmread(io.BytesIO(data))
    tiles = reference_array(data, None, "uint8")
    tiles = tiles.reshape(*tiles.shape[:3], -1)
    rows, columns = int(ds.TotalPixelMatrixRows), int(ds.TotalPixelMatrixColumns)
    th, tw = int(ds.Rows), int(ds.Columns)
    across = -(-columns // tw)
    down = -(-rows // th)
    full = np.zeros((down * th, across * tw, tiles.shape[-1]), dtype=np.uint8)
    for k, tile in enumerate(tiles):
        r, c = places[k] if places is not None else divmod(k, across)
        full[r * th : (r + 1) * th, c * tw : (c + 1) * tw] = tile
    return np.ascontiguousarray(np.moveaxis(full[:rows, :columns], -1, 0))
