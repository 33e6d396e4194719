"""Where an image's pixels lie in the patient: spacing, position, orientation, the affine.

Pure: values by pydicom keyword go in (a ``Dataset`` or the plain reader's dict),
a frozen :class:`Geometry` comes out, for the sidecar and the series assembly.
Values come from the top-level Image Plane module (CT, MR, PET slices), from
the shared and per-frame functional groups of enhanced multi-frame objects
(Pixel Measures, Plane Position, Plane Orientation), or from the Grid Frame
Offset Vector of RT Dose. A value the object lacks is named in ``missing``,
one present but unusable (a wrong count, not a number) in ``invalid``; none is
ever guessed.

The affine maps an index of the output array ``(frame, row, column)`` (the
``.npy``'s first three axes) to patient coordinates in millimetres, LPS (DICOM's:
x to the patient's left, y posterior, z head): ``[x, y, z, 1] = affine @ [f, r,
c, 1]``. Its row and column columns are Image Orientation (Patient) times Pixel
Spacing, its origin the first frame's Image Position (Patient). Its frame column
is the step between frame positions when the frames lie evenly on one line;
for one frame, the slice normal times Spacing Between Slices, else Slice
Thickness, else 1 (as nibabel's and MONAI's readers do; ``slice_step_from``
says which). Multi-frame objects whose frames do not lie evenly on one line get
no affine (``affine_note`` says why); their per-frame positions remain.
RAS (NIfTI's convention) is ``diag(-1, -1, 1, 1) @ affine``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import numpy as np
import numpy.typing as npt
from pydicom.dataset import Dataset

from ingest.dicom.frames import per_frame_planes
from ingest.dicom.image_pixel import Values
from ingest.dicom.rescale import PER_FRAME_GROUPS, raw_per_frame_groups

# Frames count as evenly spaced on one line when every position is within this many
# millimetres of where the first position and the mean step put it (scanners write
# positions rounded to a few decimals).
POSITION_TOLERANCE_MM: Final = 0.01
_ORIENTATION_TOLERANCE: Final = 1e-4


@dataclass(frozen=True, slots=True)
class FrameValues:
    """What one frame's functional groups say (None: this frame's group does not)."""

    position: tuple[float, float, float] | None = None
    orientation: tuple[float, ...] | None = None
    pixel_spacing: tuple[float, float] | None = None
    slice_thickness: float | None = None
    spacing_between_slices: float | None = None
    matrix_column: int | None = None  # slides: 1-based, in the total pixel matrix
    matrix_row: int | None = None


@dataclass(frozen=True, slots=True)
class Geometry:
    """An image's place in the patient, and what a series assembly sorts its slices by."""

    frame_of_reference_uid: str | None
    pixel_spacing: tuple[float, float] | None  # (between rows, between columns), mm
    slice_thickness: float | None
    spacing_between_slices: float | None
    image_orientation: tuple[float, ...] | None  # row direction cosines, then column's
    image_position: tuple[float, float, float] | None  # the first frame's first pixel, mm
    frame_positions: tuple[tuple[float, float, float], ...] | None  # multi-frame, per frame
    frame_orientations: tuple[tuple[float, ...], ...] | None  # only when frames differ
    affine: tuple[tuple[float, ...], ...] | None  # 4x4, (frame, row, column) -> LPS mm
    slice_step_from: str | None  # what the affine's frame column came from
    affine_note: str | None  # why there is no affine, when the geometry is otherwise there
    missing: tuple[str, ...]
    invalid: tuple[str, ...]
    instance_number: int | None
    acquisition_number: int | None
    images_in_acquisition: int | None
    # NM and PET: slices in each volume, and how many volumes (time slices of a dynamic
    # series, time slots of a gated one) the series holds besides
    number_of_slices: int | None
    number_of_time_slices: int | None
    number_of_time_slots: int | None

    @property
    def normal(self) -> tuple[float, float, float] | None:
        """The slice normal: row direction x column direction."""
        if self.image_orientation is None:
            return None
        return _cross(self.image_orientation[:3], self.image_orientation[3:])

    def as_json(self) -> dict[str, Any]:
        """The sidecar's ``geometry`` (docs/output.md)."""
        return {
            "frame_of_reference_uid": self.frame_of_reference_uid,
            "pixel_spacing": _list(self.pixel_spacing),
            "slice_thickness": self.slice_thickness,
            "spacing_between_slices": self.spacing_between_slices,
            "image_orientation_patient": _list(self.image_orientation),
            "image_position_patient": _list(self.image_position),
            "frame_positions": _lists(self.frame_positions),
            "frame_orientations": _lists(self.frame_orientations),
            "affine": _lists(self.affine),
            "affine_space": "LPS",
            "affine_axes": ["frame", "row", "column"],
            "slice_step_from": self.slice_step_from,
            "affine_note": self.affine_note,
            "missing": list(self.missing),
            "invalid": list(self.invalid),
        }


def _list(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else list(values)


def _lists(rows: Sequence[Sequence[float]] | None) -> list[list[float]] | None:
    return None if rows is None else [list(row) for row in rows]


class _Reader:
    """Reads numbers from values as pydicom or the plain reader gives them, noting
    what is missing or unusable under the name it has in the standard."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.invalid: list[str] = []

    def numbers(self, source: Values | None, keyword: str, count: int) -> tuple[float, ...] | None:
        value = None if source is None else source.get(keyword)
        if value is None or value == "" or (isinstance(value, Sequence) and len(value) == 0):
            return None
        found = numbers_of(value, count)
        if found is None and keyword not in self.invalid:
            self.invalid.append(keyword)
        return found

    def note_missing(self, keyword: str) -> None:
        if keyword not in self.missing and keyword not in self.invalid:
            self.missing.append(keyword)


def numbers_of(value: object, count: int) -> tuple[float, ...] | None:
    """``count`` finite numbers from a value (one number, or a sequence of them); else None."""
    items: Sequence[object]
    if isinstance(value, float | int):  # one number (the plain reader's and pydicom's)
        items = (value,)
    elif isinstance(value, tuple | list) or (
        isinstance(value, Sequence) and not isinstance(value, str | bytes)
    ):
        items = value  # several (a tuple, or pydicom's MultiValue)
    else:
        return None
    if len(items) != count:
        return None
    out = []
    for item in items:
        if type(item) is bool or not isinstance(item, float | int):
            return None
        number = float(item)
        if not math.isfinite(number):
            return None
        out.append(number)
    return tuple(out)


def integer_of(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return int(value)


def _text(values: Values, keyword: str) -> str | None:
    value = values.get(keyword)
    return (str(value).strip() or None) if isinstance(value, str) else None


def _first(values: Values | None, keyword: str) -> Values | None:
    """The first item of a sequence (a functional group's macro), or None."""
    sequence = None if values is None else values.get(keyword)
    if not isinstance(sequence, Sequence) or isinstance(sequence, str | bytes) or not sequence:
        return None
    item: Values = sequence[0]
    return item


_MACROS: Final = (
    ("PixelMeasuresSequence", ("PixelSpacing", "SliceThickness", "SpacingBetweenSlices")),
    ("PlanePositionSequence", ("ImagePositionPatient",)),
    ("PlaneOrientationSequence", ("ImageOrientationPatient",)),
    (
        "PlanePositionSlideSequence",
        ("ColumnPositionInTotalImagePixelMatrix", "RowPositionInTotalImagePixelMatrix"),
    ),
)


def flat_group(group: Values) -> dict[str, object]:
    """A functional group item's plane values by keyword, out of their macros (the form
    ``frames.per_frame_planes`` reads straight from the bytes)."""
    out: dict[str, object] = {}
    for macro, keywords in _MACROS:
        item = _first(group, macro)
        if item is None:
            continue
        for keyword in keywords:
            value = item.get(keyword)
            if value is not None:
                out[keyword] = value
    return out


def frame_values(flat: Values, reader: _Reader) -> FrameValues:
    """One functional group's plane values, from ``flat_group``'s form."""
    position = reader.numbers(flat, "ImagePositionPatient", 3)
    spacing = reader.numbers(flat, "PixelSpacing", 2)
    thickness = reader.numbers(flat, "SliceThickness", 1)
    between = reader.numbers(flat, "SpacingBetweenSlices", 1)
    return FrameValues(
        position=None if position is None else (position[0], position[1], position[2]),
        orientation=reader.numbers(flat, "ImageOrientationPatient", 6),
        pixel_spacing=None if spacing is None else (spacing[0], spacing[1]),
        slice_thickness=None if thickness is None else thickness[0],
        spacing_between_slices=None if between is None else between[0],
        matrix_column=integer_of(flat.get("ColumnPositionInTotalImagePixelMatrix")),
        matrix_row=integer_of(flat.get("RowPositionInTotalImagePixelMatrix")),
    )


def per_frame_values(groups: Sequence[Values]) -> list[FrameValues]:
    """Each Per-Frame Functional Groups item's plane values (``flat_group``'s form)."""
    reader = _Reader()
    return [frame_values(group, reader) for group in groups]


def has_per_frame_groups(values: Values) -> TypeGuard[Dataset]:
    """Whether the header has a Per-Frame Functional Groups Sequence (its items unread)."""
    return isinstance(values, Dataset) and PER_FRAME_GROUPS in values


def read_per_frame(values: Values) -> list[FrameValues] | None:
    """The Per-Frame Functional Groups' plane values, one per item, or None without them.

    Read straight from the sequence's bytes (``frames.per_frame_planes``) while pydicom
    has not converted them (for thousands of frames pydicom's reading takes longer
    than the frames' pixels take to arrive); by pydicom otherwise, or when that
    walker is unsure.
    """
    if not has_per_frame_groups(values):
        return None
    raw = raw_per_frame_groups(values)
    if raw is not None:
        fast = per_frame_planes(*raw)
        if fast is not None:
            return per_frame_values(fast)
    groups = values.get("PerFrameFunctionalGroupsSequence") or []
    return per_frame_values([flat_group(group) for group in groups])


def geometry_of(
    values: Values, frames: int, per_frame: Sequence[FrameValues] | None = None
) -> Geometry:
    """The geometry of an image of ``frames`` frames.

    ``per_frame``: the Per-Frame Functional Groups' values, one per frame, when the
    object has them and they were read (``read_per_frame``); a frame's own value
    wins over the shared group's, which wins over the top-level attribute.
    """
    reader = _Reader()
    if per_frame is not None and len(per_frame) != frames:
        reader.invalid.append("PerFrameFunctionalGroupsSequence")  # not one item a frame
        per_frame = None
    shared = _first(values, "SharedFunctionalGroupsSequence")
    common = frame_values(flat_group(shared), reader) if shared is not None else FrameValues()
    first = per_frame[0] if per_frame else FrameValues()

    def pick(keyword: str, count: int, *found: tuple[float, ...] | float | None) -> Any:
        for value in found:
            if value is not None:
                return value
        top = reader.numbers(values, keyword, count)
        if top is None:
            reader.note_missing(keyword)
        return top if top is None or count > 1 else top[0]

    spacing = pick("PixelSpacing", 2, first.pixel_spacing, common.pixel_spacing)
    thickness = pick("SliceThickness", 1, first.slice_thickness, common.slice_thickness)
    between = pick(
        "SpacingBetweenSlices", 1, first.spacing_between_slices, common.spacing_between_slices
    )
    orientation = pick("ImageOrientationPatient", 6, first.orientation, common.orientation)
    position = pick("ImagePositionPatient", 3, first.position)
    frame_of_reference = _text(values, "FrameOfReferenceUID")
    if frame_of_reference is None:
        reader.note_missing("FrameOfReferenceUID")

    positions: list[tuple[float, float, float]] | None = None
    orientations: list[tuple[float, ...]] | None = None
    if per_frame:
        if all(f.position is not None for f in per_frame):
            positions = [f.position for f in per_frame if f.position is not None]
        if any(f.orientation is not None for f in per_frame):
            orientations = [f.orientation or common.orientation or () for f in per_frame]
    elif frames > 1 and position is not None and orientation is not None:
        offsets = reader.numbers(values, "GridFrameOffsetVector", frames)
        if offsets is not None:  # RT Dose: offsets along the normal from the first position
            normal = np.cross(orientation[:3], orientation[3:])
            base = np.asarray(position) - normal * offsets[0] if offsets[0] != 0.0 else position
            positions = [_point(np.asarray(base) + normal * k) for k in offsets]
    orientation_varies = orientations is not None and any(
        not _close(o, orientations[0], _ORIENTATION_TOLERANCE) for o in orientations
    )
    if orientations is not None and orientations[0]:
        orientation = orientations[0]
    if positions:
        position = positions[0]

    affine, step_from, note = _affine(
        frames, spacing, orientation, position, positions, between, thickness, orientation_varies
    )
    return Geometry(
        frame_of_reference_uid=frame_of_reference,
        pixel_spacing=spacing,
        slice_thickness=thickness,
        spacing_between_slices=between,
        image_orientation=orientation,
        image_position=position,
        frame_positions=tuple(positions) if positions and frames > 1 else None,
        frame_orientations=tuple(orientations) if orientations and orientation_varies else None,
        affine=affine,
        slice_step_from=step_from,
        affine_note=note,
        missing=tuple(reader.missing),
        invalid=tuple(reader.invalid),
        instance_number=integer_of(values.get("InstanceNumber")),
        acquisition_number=integer_of(values.get("AcquisitionNumber")),
        images_in_acquisition=integer_of(values.get("ImagesInAcquisition")),
        number_of_slices=integer_of(values.get("NumberOfSlices")),
        number_of_time_slices=integer_of(values.get("NumberOfTimeSlices")),
        number_of_time_slots=integer_of(values.get("NumberOfTimeSlots")),
    )


def _point(values: npt.NDArray[np.float64]) -> tuple[float, float, float]:
    return (float(values[0]), float(values[1]), float(values[2]))


def _close(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def _affine(
    frames: int,
    spacing: tuple[float, float] | None,
    orientation: tuple[float, ...] | None,
    position: tuple[float, float, float] | None,
    positions: Sequence[tuple[float, float, float]] | None,
    between: float | None,
    thickness: float | None,
    orientation_varies: bool,
) -> tuple[tuple[tuple[float, ...], ...] | None, str | None, str | None]:
    """(affine, where its frame step came from, why there is none)."""
    if spacing is None or orientation is None or position is None:
        return None, None, None  # ``missing`` names what is lacking
    # plain floats, not NumPy: a slice's geometry is read for every object, and NumPy's
    # per-call overhead on 3-vectors was most of a CT slice's header time
    along_row, down_column = orientation[:3], orientation[3:]
    normal = _cross(along_row, down_column)
    if orientation_varies:
        return None, None, "the frames' orientations differ"
    if frames > 1 and positions is not None and len(positions) == frames:
        points = np.asarray(positions, dtype=np.float64)
        mean_step = (points[-1] - points[0]) / (frames - 1)
        expected = points[0] + np.arange(frames)[:, None] * mean_step
        if not np.all(np.abs(points - expected) <= POSITION_TOLERANCE_MM):
            return None, None, "the frames do not lie evenly spaced on one line"
        step, step_from = tuple(float(v) for v in mean_step), "frame positions"
    elif frames > 1:
        if between is None:
            return None, None, "a multi-frame object without frame positions or spacing"
        step, step_from = _scaled(normal, between), "SpacingBetweenSlices"
    elif between is not None:
        step, step_from = _scaled(normal, between), "SpacingBetweenSlices"
    elif thickness is not None:
        step, step_from = _scaled(normal, thickness), "SliceThickness"
    else:
        step, step_from = normal, "unit normal (one frame)"
    rows = _scaled(down_column, spacing[0])  # down the rows: the column direction
    columns = _scaled(along_row, spacing[1])  # along a row: the row direction
    affine = tuple((step[i], rows[i], columns[i], float(position[i])) for i in range(3))
    return (*affine, (0.0, 0.0, 0.0, 1.0)), step_from, None


def _cross(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])


def _scaled(v: Sequence[float], by: float) -> tuple[float, ...]:
    return tuple(float(x) * by for x in v)


def lps_to_ras(affine: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The same affine in RAS (NIfTI's): x and y negated."""
    flip: npt.NDArray[np.float64] = np.diag([-1.0, -1.0, 1.0, 1.0])
    return flip @ np.asarray(affine, dtype=np.float64)
