"""A whole-slide image as an OME-Zarr image, the pure part: its keys, chunks and metadata.

With ``SLIDE_LAYOUT=ome-zarr`` a tiled image (VL Whole Slide Microscopy) is
written as one array of its whole matrix, level 0 of an OME-Zarr image
(NGFF 0.4 on Zarr v2, which every OME-Zarr reader opens: zarr-python 2 and 3,
ome-zarr-py and napari, Bio-Formats and so QuPath, OMERO, Vizarr):

* ``ROOT = OUTPUT_URL + B + "/" + K + ".zarr"`` for a source ``s3://B/K``;
* ``ROOT/0`` the array, axes ``(c, y, x)``: NGFF puts the channel before space,
  so an RGB tile's interleaved samples become three planes; ``c`` holds each
  optical path's samples in turn (a fluorescence slide's paths are its channels);
* one chunk a tile, ``(samples, tile rows, tile columns)``, key
  ``ROOT/0/PATH/TILE_ROW/TILE_COLUMN`` (``dimension_separator`` ``/``), stored
  uncompressed (C order, little endian): the bytes of the decoded tile, its
  part outside the matrix (the right and bottom edge tiles) set to the fill
  value, 0, as zarr-python pads its own edge chunks;
* ``ROOT/0/.zarray``, ``ROOT/.zgroup`` and ``ROOT/.zattrs`` (``multiscales``
  with the pixel spacing in micrometres, ``omero`` channel names, and
  ``dicom_ingest``: the source object and its instance UIDs), written after
  every chunk, ``.zattrs`` last: a reader finds no image until all of it is there.

TILED_FULL places frame ``k`` by the standard's order (tiles row by row, then
focal planes, then optical paths); TILED_SPARSE by each frame's Plane Position
(Slide), when every frame starts on the tile grid and no two share a place: the
grid's cells that no frame covers are written as chunks of the fill value, so
the chunks under ``ROOT`` are the same whatever an earlier version of the
object left there. What cannot be placed so (several focal planes, frames off
the grid or on top of each other, places not known) is refused with the reason
(``LayoutRefused``), never guessed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ingest.dicom.header import DicomHeader
from ingest.dicom.slide import Slide
from ingest.errors import LayoutRefused

ZARR_SUFFIX: Final = ".zarr"
NGFF_VERSION: Final = "0.4"
LEVEL: Final = "0"  # the one resolution level written: the DICOM matrix as it is
CHUNK_TYPE: Final = "application/octet-stream"  # SeaweedFS gzips what names no type
# A sparse slide's grid cells are tracked one byte each and the empty ones written:
# 4 Mi cells (a 500k x 500k matrix of 256-pixel tiles) bound both.
MAX_GRID_CELLS: Final = 1 << 22
_RGB_COLOURS: Final = ("FF0000", "00FF00", "0000FF")


@dataclass(frozen=True, slots=True)
class Origin:
    """Which object a slide's image comes from: its header and its source version."""

    header: DicomHeader
    bucket: str
    key: str
    version_id: str | None
    etag: str
    size: int


def zarr_root(npy_key: str) -> str:
    """The image's key prefix (no trailing slash) in place of the ``.npy`` key."""
    return npy_key.removesuffix(".npy") + ZARR_SUFFIX


@dataclass(frozen=True, slots=True, eq=False)
class ZarrPlan:
    """Where each tile of one slide goes in its OME-Zarr image, and the image's metadata."""

    root: str  # key prefix, no trailing slash
    frames: int
    samples: int  # per pixel of a tile: 1 or 3
    paths: int  # optical paths: the channel axis holds samples x paths
    tile_rows: int
    tile_columns: int
    total_rows: int
    total_columns: int
    dtype: str  # NumPy's name of the output type
    attributes: dict[str, Any] = field(repr=False)  # ``.zattrs``
    # TILED_SPARSE: each frame's cell (tile row x tiles across + tile column); None:
    # TILED_FULL's order places them
    frame_cells: npt.NDArray[np.int64] | None = field(default=None, repr=False)

    @property
    def tiles_across(self) -> int:
        return -(-self.total_columns // self.tile_columns)

    @property
    def tiles_down(self) -> int:
        return -(-self.total_rows // self.tile_rows)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.samples * self.paths, self.total_rows, self.total_columns)

    @property
    def chunks(self) -> tuple[int, int, int]:
        return (self.samples, self.tile_rows, self.tile_columns)

    @property
    def chunk_bytes(self) -> int:
        return self.samples * self.tile_rows * self.tile_columns * np.dtype(self.dtype).itemsize

    def cell(self, frame: int) -> tuple[int, int, int]:
        """Frame ``frame``'s chunk index: (optical path, tile row, tile column)."""
        if not 0 <= frame < self.frames:
            raise IndexError(f"frame {frame} of {self.frames}")
        per_path = self.tiles_across * self.tiles_down
        if self.frame_cells is not None:
            path, place = 0, int(self.frame_cells[frame])
        else:
            path, place = divmod(frame, per_path)
        return path, place // self.tiles_across, place % self.tiles_across

    def chunk_key(self, cell: tuple[int, int, int]) -> str:
        return f"{self.root}/{LEVEL}/{cell[0]}/{cell[1]}/{cell[2]}"

    def empty_cells(self) -> Iterator[tuple[int, int, int]]:
        """The grid's cells no frame covers (a sparse slide's), in key order."""
        if self.frame_cells is None:
            return
        covered = np.zeros(self.tiles_across * self.tiles_down, dtype=np.bool_)
        covered[self.frame_cells] = True
        for place in np.flatnonzero(~covered).tolist():
            yield 0, place // self.tiles_across, place % self.tiles_across

    def chunk(self, frame: int, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Frame ``frame``'s output values, ``(rows, columns[, samples])``, as its chunk:
        C-order ``(samples, rows, columns)``, the part outside the matrix set to 0 (a
        copy then; an inner monochrome tile is returned as it is, no copy)."""
        tile = values.reshape(self.tile_rows, self.tile_columns, self.samples)
        _, down, across = self.cell(frame)
        rows_in = min(self.tile_rows, self.total_rows - down * self.tile_rows)
        columns_in = min(self.tile_columns, self.total_columns - across * self.tile_columns)
        planes = np.moveaxis(tile, -1, 0)
        if rows_in == self.tile_rows and columns_in == self.tile_columns:
            return np.ascontiguousarray(planes)  # no copy for a monochrome tile
        out = np.empty(self.chunks, dtype=self.dtype)
        out[:, :rows_in, :columns_in] = planes[:, :rows_in, :columns_in]
        out[:, rows_in:, :] = 0
        out[:, :rows_in, columns_in:] = 0
        return out

    def fill_chunk(self) -> bytes:
        return bytes(self.chunk_bytes)

    def array_metadata(self) -> dict[str, Any]:
        """``0/.zarray`` (Zarr v2)."""
        dtype = np.dtype(self.dtype)
        return {
            "zarr_format": 2,
            "shape": list(self.shape),
            "chunks": list(self.chunks),
            "dtype": dtype.str,
            "compressor": None,
            "fill_value": 0.0 if dtype.kind == "f" else 0,
            "order": "C",
            "filters": None,
            "dimension_separator": "/",
        }

    def metadata(self) -> list[tuple[str, dict[str, Any]]]:
        """The image's JSON documents, keyed, in the order they are written: the array's,
        the group's, then ``.zattrs``, which makes it an OME-Zarr image."""
        return [
            (f"{self.root}/{LEVEL}/.zarray", self.array_metadata()),
            (f"{self.root}/.zgroup", {"zarr_format": 2}),
            (f"{self.root}/.zattrs", self.attributes),
        ]

    def metadata_keys_to_clear(self) -> list[str]:
        """The metadata keys to delete before the chunks are (re)written, ``.zattrs``
        first: while they change, the image is not complete."""
        return [key for key, _ in reversed(self.metadata())]


def zarr_plan(
    root: str, origin: Origin, dtype: str, window: tuple[float, float] | None
) -> ZarrPlan:
    """The OME-Zarr plan of a slide's output in ``dtype``.

    Raises:
        LayoutRefused: the object is not a slide, or its tiles do not make one grid of
            one focal plane (the message says which and why).
    """
    header = origin.header
    slide = header.slide
    if slide is None:
        raise LayoutRefused("not a tiled image: no Total Pixel Matrix")
    pixel = header.pixel
    refuse = "cannot be one OME-Zarr array; write it with SLIDE_LAYOUT=tiles"
    if (slide.focal_planes or 1) > 1:
        raise LayoutRefused(f"{slide.focal_planes} focal planes {refuse}")
    paths = max(1, len(slide.optical_paths))
    per_path = slide.tiles_across * slide.tiles_down
    cells: npt.NDArray[np.int64] | None = None
    if slide.dimension_organization == "TILED_FULL":  # the order places the frames
        if slide.frames != per_path * paths:
            raise LayoutRefused(
                f"TILED_FULL with {slide.frames} frames for {per_path} tiles x {paths} "
                f"optical paths {refuse}"
            )
    else:
        cells = _sparse_cells(slide, paths, refuse)
    attributes = _attributes(origin, slide, paths, pixel.samples, dtype, window)
    return ZarrPlan(
        root=root,
        frames=slide.frames,
        samples=pixel.samples,
        paths=paths,
        tile_rows=slide.tile_rows,
        tile_columns=slide.tile_columns,
        total_rows=slide.total_rows,
        total_columns=slide.total_columns,
        dtype=str(np.dtype(dtype)),
        attributes=attributes,
        frame_cells=cells,
    )


def _sparse_cells(slide: Slide, paths: int, refuse: str) -> npt.NDArray[np.int64]:
    """Each frame's grid cell from its own Plane Position (Slide) (TILED_SPARSE)."""
    if slide.frame_columns is None or slide.frame_rows is None:
        kind = slide.dimension_organization or "no Dimension Organization Type"
        raise LayoutRefused(f"{kind} and no Plane Position (Slide) a frame: its tiles {refuse}")
    if paths > 1:
        raise LayoutRefused(f"TILED_SPARSE with {paths} optical paths {refuse}")
    grid = slide.tiles_across * slide.tiles_down
    if grid > MAX_GRID_CELLS:
        raise LayoutRefused(f"TILED_SPARSE over {grid} grid cells (at most {MAX_GRID_CELLS})")
    columns = np.asarray(slide.frame_columns, dtype=np.int64) - 1
    rows = np.asarray(slide.frame_rows, dtype=np.int64) - 1
    off_grid = (columns % slide.tile_columns != 0) | (rows % slide.tile_rows != 0)
    outside = (columns < 0) | (rows < 0)
    outside |= (columns >= slide.total_columns) | (rows >= slide.total_rows)
    if off_grid.any() or outside.any():
        k = int(np.flatnonzero(off_grid | outside)[0])
        raise LayoutRefused(
            f"frame {k} starts at column {columns[k] + 1}, row {rows[k] + 1}: not a tile's"
            f" place on the {slide.tile_columns} x {slide.tile_rows} grid of the matrix;"
            f" its tiles {refuse}"
        )
    cells = rows // slide.tile_rows * slide.tiles_across + columns // slide.tile_columns
    unique, counts = np.unique(cells, return_counts=True)
    if (counts > 1).any():
        twice = int(unique[np.argmax(counts > 1)])
        down, across = divmod(twice, slide.tiles_across)
        raise LayoutRefused(
            f"{int(counts.max())} frames at tile row {down}, column {across} (several focal"
            f" planes or optical paths, or overlapping tiles): its tiles {refuse}"
        )
    return cells


def _attributes(
    origin: Origin,
    slide: Slide,
    paths: int,
    samples: int,
    dtype: str,
    window: tuple[float, float] | None,
) -> dict[str, Any]:
    """``.zattrs``: NGFF 0.4 ``multiscales`` (level 0 only) and ``omero`` channels, and the
    provenance under ``dicom_ingest``. Nothing in it varies between runs: idempotent."""
    header = origin.header
    spacing = slide.pixel_spacing
    space: dict[str, str] = {"type": "space"}
    if spacing is not None:
        space["unit"] = "micrometer"
    axes = [{"name": "c", "type": "channel"}, {"name": "y", **space}, {"name": "x", **space}]
    # DICOM's Pixel Spacing is (between rows, between columns) in mm: y then x, in um
    scale = [1.0, *(_micrometres(v) for v in spacing)] if spacing else [1.0, 1.0, 1.0]
    labels = _channel_labels(slide, paths, samples, header.photometric_interpretation)
    multiscale = {
        "version": NGFF_VERSION,
        "name": header.sop_instance_uid or origin.key,
        "axes": axes,
        "datasets": [
            {"path": LEVEL, "coordinateTransformations": [{"type": "scale", "scale": scale}]}
        ],
    }
    eight_bit = header.pixel.bits_stored == 8 and not header.rescale and window is None
    channels = []
    for index, label in enumerate(labels):
        channel: dict[str, Any] = {
            "label": label,
            "color": _RGB_COLOURS[index % 3] if samples == 3 else "FFFFFF",
            "active": True,
        }
        if eight_bit:
            channel["window"] = {"min": 0, "max": 255, "start": 0, "end": 255}
        channels.append(channel)
    provenance = {
        "source": {
            "bucket": origin.bucket,
            "key": origin.key,
            "version_id": origin.version_id,
            "etag": origin.etag,
            "size": origin.size,
        },
        "study_instance_uid": header.study_instance_uid,
        "series_instance_uid": header.series_instance_uid,
        "sop_instance_uid": header.sop_instance_uid,
        "sop_class_uid": header.sop_class_uid,
        "modality": header.modality,
        "transfer_syntax_uid": header.transfer_syntax_uid,
        "photometric_interpretation": header.photometric_interpretation,
        "dtype": str(np.dtype(dtype)),
        "window": list(window) if window else None,
        "channels": labels,
        "slide": _slide_summary(slide),
    }
    return {
        "multiscales": [multiscale],
        "omero": {"version": NGFF_VERSION, "channels": channels},
        "dicom_ingest": provenance,
    }


def _micrometres(mm: float) -> float:
    return round(mm * 1000.0, 9)  # 0.00025 mm is 0.25 um, not 0.25000000000000006


def _channel_labels(slide: Slide, paths: int, samples: int, photometric: str) -> list[str]:
    """One name a channel: R, G, B for colour; an optical path's identifier for each of
    its channels when there are several (``PATH:R`` ...), else the photometric
    interpretation for a monochrome slide's one channel."""
    ids = list(slide.optical_paths) + [str(n + 1) for n in range(len(slide.optical_paths), paths)]
    labels = []
    for path in range(paths):
        prefix = ids[path] if paths > 1 else ""
        if samples == 3:
            labels += [f"{prefix}:{name}" if prefix else name for name in ("R", "G", "B")]
        else:
            labels.append(prefix or photometric)
    return labels


def _slide_summary(slide: Slide) -> dict[str, Any]:
    """The sidecar's ``slide`` less each frame's place (TILED_SPARSE's list of them)."""
    summary = slide.as_json()
    summary.pop("frame_columns")
    summary.pop("frame_rows")
    return summary
