"""The total matrix of a tiled image (VL Whole Slide Microscopy), for the sidecar.

A whole-slide image is stored as tiles, one a frame; the sidecar reports the
whole matrix the tiles make up, the tile size and the tile count, so a reader
of the output (frames, tile rows, tile columns[, samples]) can place them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gpu.formats import PixelFormat
from ingest.errors import MalformedDicom


class _Values(Protocol):
    def get(self, key: str, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class Slide:
    """A tiled image's whole matrix (VL Whole Slide Microscopy): its frames are tiles."""

    total_rows: int
    total_columns: int
    tile_rows: int
    tile_columns: int
    frames: int
    dimension_organization: str | None  # TILED_FULL: tiles in row-major order, no gaps


def slide_of(ds: _Values, pixel: PixelFormat) -> Slide | None:
    """The total matrix of a tiled image, or None when the header has none.

    Raises:
        MalformedDicom: a total matrix that is not two positive integers.
    """
    rows, columns = ds.get("TotalPixelMatrixRows"), ds.get("TotalPixelMatrixColumns")
    if rows is None and columns is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rows, columns)):
        raise MalformedDicom("Total Pixel Matrix Rows/Columns are not two positive integers")
    organization = ds.get("DimensionOrganizationType")
    return Slide(
        int(rows),
        int(columns),
        pixel.rows,
        pixel.columns,
        pixel.frames,
        str(organization).strip() if isinstance(organization, str) else None,
    )
