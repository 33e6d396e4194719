"""The total matrix of a tiled image (VL Whole Slide Microscopy), for the sidecar.

A whole-slide image is stored as tiles, one a frame; the sidecar reports the
whole matrix the tiles make up, the tile size, the tile count, each frame's
place in the matrix, the pixel spacing and the optical paths, so a reader of
the output (frames, tile rows, tile columns[, samples]) can place the tiles
without the DICOM file. A frame's place is its Plane Position (Slide) when
the object has per-frame values (TILED_SPARSE); with TILED_FULL the standard
fixes it: tiles in row-major order across the matrix, then focal planes, then
optical paths. Without either there is no place, and ``frame_columns`` and
``frame_rows`` are None.

``affine`` maps a pixel of the total matrix, ``[row, column, 0, 1]`` (0-based),
to the slide coordinate system in millimetres: Image Orientation (Slide) times
the pixel spacing, from the Total Pixel Matrix Origin (its Z offset 0 when
absent), its third column the unit normal (row direction x column direction).
Without the orientation, the origin or the spacing there is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ingest.dicom.geometry import numbers_of
from ingest.errors import MalformedDicom
from ingest_gpu.formats import PixelFormat


class _Values(Protocol):
    def get(self, key: str, /) -> Any: ...


class _Placed(Protocol):
    @property
    def matrix_column(self) -> int | None: ...

    @property
    def matrix_row(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Slide:
    """A tiled image's whole matrix (VL Whole Slide Microscopy): its frames are tiles."""

    total_rows: int
    total_columns: int
    tile_rows: int
    tile_columns: int
    frames: int
    dimension_organization: str | None  # TILED_FULL: tiles in row-major order, no gaps
    # 1-based column and row of each frame's top left pixel in the total matrix, as the
    # per-frame values give them (TILED_SPARSE); TILED_FULL's come from ``frame_places``
    frame_columns: tuple[int, ...] | None = None
    frame_rows: tuple[int, ...] | None = None
    pixel_spacing: tuple[float, float] | None = None  # (between rows, between columns), mm
    optical_paths: tuple[str, ...] = ()  # Optical Path Identifiers, in the sequence's order
    focal_planes: int | None = None  # Total Pixel Matrix Focal Planes
    affine: tuple[tuple[float, ...], ...] | None = None  # matrix (row, column) -> slide mm

    def frame_places(self) -> tuple[list[int], list[int]] | None:
        """Each frame's 1-based (columns, rows) in the total matrix, or None when unknown.

        TILED_FULL's are computed here, once the frames are known to exist: the
        header's frame count alone could be anything."""
        if self.frame_columns is not None and self.frame_rows is not None:
            return list(self.frame_columns), list(self.frame_rows)
        if self.dimension_organization != "TILED_FULL":
            return None
        across = self.tiles_across
        per_plane = across * self.tiles_down
        tiles = range(self.frames)
        return (
            [(k % per_plane % across) * self.tile_columns + 1 for k in tiles],
            [(k % per_plane // across) * self.tile_rows + 1 for k in tiles],
        )

    @property
    def tiles_across(self) -> int:
        return -(-self.total_columns // self.tile_columns)

    @property
    def tiles_down(self) -> int:
        return -(-self.total_rows // self.tile_rows)

    def as_json(self) -> dict[str, Any]:
        """The sidecar's ``slide`` (docs/output.md). TILED_FULL's places are not listed:
        its order fixes them (``frame_places``), and a slide of half a million tiles
        would list more than a result message may hold."""
        return {
            "total_rows": self.total_rows,
            "total_columns": self.total_columns,
            "tile_rows": self.tile_rows,
            "tile_columns": self.tile_columns,
            "frames": self.frames,
            "dimension_organization": self.dimension_organization,
            "tiles_across": self.tiles_across,
            "tiles_down": self.tiles_down,
            "frame_columns": list(self.frame_columns) if self.frame_columns else None,
            "frame_rows": list(self.frame_rows) if self.frame_rows else None,
            "pixel_spacing": list(self.pixel_spacing) if self.pixel_spacing else None,
            "optical_paths": list(self.optical_paths),
            "focal_planes": self.focal_planes,
            "affine": [list(row) for row in self.affine] if self.affine else None,
            "affine_space": "slide",
            "affine_axes": ["row", "column", "normal"],
        }


def slide_of(
    ds: _Values,
    pixel: PixelFormat,
    per_frame: Sequence[_Placed] | None = None,
    pixel_spacing: tuple[float, float] | None = None,
) -> Slide | None:
    """The total matrix of a tiled image, or None when the header has none.

    ``per_frame``: the frames' Plane Position (Slide) values, when the object has
    per-frame functional groups and they were read; ``pixel_spacing`` the image's
    (``geometry``'s).

    Raises:
        MalformedDicom: a total matrix that is not two positive integers.
    """
    rows, columns = ds.get("TotalPixelMatrixRows"), ds.get("TotalPixelMatrixColumns")
    if rows is None and columns is None:
        return None
    if not all(_positive(v) for v in (rows, columns)):
        raise MalformedDicom("Total Pixel Matrix Rows/Columns are not two positive integers")
    organization = ds.get("DimensionOrganizationType")
    kind = str(organization).strip() if isinstance(organization, str) else None
    planes = ds.get("TotalPixelMatrixFocalPlanes")
    places = _places(pixel, per_frame)
    return Slide(
        int(rows),
        int(columns),
        pixel.rows,
        pixel.columns,
        pixel.frames,
        kind,
        frame_columns=None if places is None else places[0],
        frame_rows=None if places is None else places[1],
        pixel_spacing=pixel_spacing,
        optical_paths=_optical_paths(ds),
        focal_planes=int(planes) if _positive(planes) else None,
        affine=_slide_affine(ds, pixel_spacing),
    )


def _slide_affine(
    ds: _Values, spacing: tuple[float, float] | None
) -> tuple[tuple[float, ...], ...] | None:
    orientation = numbers_of(ds.get("ImageOrientationSlide"), 6)
    origins = ds.get("TotalPixelMatrixOriginSequence")
    if spacing is None or orientation is None or not isinstance(origins, Sequence) or not origins:
        return None
    origin = origins[0]
    x = numbers_of(origin.get("XOffsetInSlideCoordinateSystem"), 1)
    y = numbers_of(origin.get("YOffsetInSlideCoordinateSystem"), 1)
    z = numbers_of(origin.get("ZOffsetInSlideCoordinateSystem"), 1) or (0.0,)
    if x is None or y is None:
        return None
    along_row, down_column = np.asarray(orientation[:3]), np.asarray(orientation[3:])
    affine = np.eye(4)
    affine[:3, 0] = down_column * spacing[0]
    affine[:3, 1] = along_row * spacing[1]
    affine[:3, 2] = np.cross(along_row, down_column)
    affine[:3, 3] = (x[0], y[0], z[0])
    return tuple(tuple(float(v) for v in row) for row in affine)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _places(
    pixel: PixelFormat, per_frame: Sequence[_Placed] | None
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Each frame's (columns, rows) in the matrix, from its own Plane Position (Slide)."""
    if not per_frame or len(per_frame) != pixel.frames:
        return None
    found_columns = [f.matrix_column for f in per_frame]
    found_rows = [f.matrix_row for f in per_frame]
    if any(c is None for c in found_columns) or any(r is None for r in found_rows):
        return None
    return tuple(c or 0 for c in found_columns), tuple(r or 0 for r in found_rows)


def _optical_paths(ds: _Values) -> tuple[str, ...]:
    paths = ds.get("OpticalPathSequence")
    if not isinstance(paths, Sequence) or isinstance(paths, str | bytes):
        return ()
    found = []
    for item in paths:
        identifier = item.get("OpticalPathIdentifier")
        if isinstance(identifier, str) and identifier.strip():
            found.append(identifier.strip())
    return tuple(found)
