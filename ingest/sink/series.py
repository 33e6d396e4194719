"""Series volumes, the pure part: which instances make a volume, in what order, with what affine.

Each single-frame instance of a series that has a geometry leaves a *member record*
beside the outputs (``member_of``: its SOP Instance UID, output key, shape,
dtype, position, orientation, spacing, Instance/Acquisition Number, Images in
Acquisition, and NM's and PET's Number of Slices, Time Slices and Time Slots).
A volume is planned from the member records of one series and frame of
reference alone (``plan_volume``), so whoever lists them, after any restart,
plans the same volume:

- sorted along the slice normal (the cross product of the orientation's row and
  column cosines), by each position's distance along it;
- checked: every member has the same rows, columns, samples, orientation and
  pixel spacing (else no volume: ``refused``); two members at one position are
  duplicates, the first by (Acquisition Number, Instance Number, SOP Instance
  UID) is kept and the rest named; members of several acquisitions are named;
  the steps between positions must be equal within ``tolerance`` of the smallest
  (a step of about twice the smallest is a missing slice, named with where it is),
  else no volume;
- complete when the data says so (every member names the same Images in
  Acquisition and that many distinct positions are there; or, where no count of
  Images in Acquisition completes it, every member names the same Number of
  Slices, of a series that holds one volume, and that many distinct positions are
  there), when a series
  manifest names the instances and every one of them is there (the volume is
  then made of those alone; the others are named), or, by the caller's clock,
  after a quiet period;
- versioned by its content: ``version`` is a digest of the members' SOP
  Instance UIDs and output digests, so planning the same members gives the same
  keys and bytes (idempotent), and a late slice makes a new version beside the
  old, never a change to it.

The volume's affine maps (slice, row, column) to LPS millimetres as each
instance's does (``ingest.dicom.geometry``), its slice column the mean step from
the first slice to the last.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

# Steps between slice positions count as equal within this fraction of their median.
DEFAULT_TOLERANCE: Final = 0.01
_SAME_POSITION_MM: Final = 1e-3
_ORIENTATION_TOLERANCE: Final = 1e-4


@dataclass(frozen=True, slots=True)
class SeriesId:
    """One volume's instances: a series within one frame of reference."""

    study: str
    series: str
    frame_of_reference: str

    @property
    def path(self) -> str:
        return f"{self.study}/{self.series}/{self.frame_of_reference}"


@dataclass(frozen=True, slots=True)
class Member:
    """One single-frame instance of a series, as its member record says."""

    sop_instance_uid: str
    npy: str  # the instance's output key
    content: str  # what identifies its bytes: the source's digest or ETag
    shape: tuple[int, ...]  # (1, rows, columns[, samples])
    dtype: str
    position: tuple[float, float, float]
    orientation: tuple[float, ...]
    pixel_spacing: tuple[float, float]
    instance_number: int | None
    acquisition_number: int | None
    images_in_acquisition: int | None
    number_of_slices: int | None = None  # NM, PET: slices in each of the series' volumes
    number_of_time_slices: int | None = None  # PET: a dynamic series' volumes, one a time
    number_of_time_slots: int | None = None  # a gated series' volumes, one a cardiac phase
    held: bool = False  # its own output is not written: its values are in a worker's memory

    @property
    def volume_slices(self) -> int | None:
        """How many slices its volume has by Number of Slices, where that applies: the
        series holds one volume (no more than one time slice or time slot), else None."""
        if (self.number_of_time_slices or 1) > 1 or (self.number_of_time_slots or 1) > 1:
            return None
        return self.number_of_slices

    def as_json(self) -> dict[str, Any]:
        return {
            "sop_instance_uid": self.sop_instance_uid,
            "npy": self.npy,
            "content": self.content,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "position": list(self.position),
            "orientation": list(self.orientation),
            "pixel_spacing": list(self.pixel_spacing),
            "instance_number": self.instance_number,
            "acquisition_number": self.acquisition_number,
            "images_in_acquisition": self.images_in_acquisition,
            "number_of_slices": self.number_of_slices,
            "number_of_time_slices": self.number_of_time_slices,
            "number_of_time_slots": self.number_of_time_slots,
            "held": self.held,
        }


def member_from_json(doc: Mapping[str, Any]) -> Member:
    """A member record read back (``Member.as_json``'s form).

    Raises:
        KeyError, TypeError, ValueError: not a member record.
    """
    position = tuple(float(v) for v in doc["position"])
    spacing = tuple(float(v) for v in doc["pixel_spacing"])
    if len(position) != 3 or len(spacing) != 2:
        raise ValueError("a member record's position or spacing has the wrong length")
    return Member(
        sop_instance_uid=str(doc["sop_instance_uid"]),
        npy=str(doc["npy"]),
        content=str(doc["content"]),
        shape=tuple(int(v) for v in doc["shape"]),
        dtype=str(doc["dtype"]),
        position=(position[0], position[1], position[2]),
        orientation=tuple(float(v) for v in doc["orientation"]),
        pixel_spacing=(spacing[0], spacing[1]),
        instance_number=_optional_int(doc.get("instance_number")),
        acquisition_number=_optional_int(doc.get("acquisition_number")),
        images_in_acquisition=_optional_int(doc.get("images_in_acquisition")),
        number_of_slices=_optional_int(doc.get("number_of_slices")),
        number_of_time_slices=_optional_int(doc.get("number_of_time_slices")),
        number_of_time_slots=_optional_int(doc.get("number_of_time_slots")),
        held=doc.get("held") is True,
    )


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def member_of(sidecar: Mapping[str, Any]) -> tuple[SeriesId, Member] | None:
    """The series and member record of an instance's sidecar, or None when it is not
    a slice of a volume: no output, more than one frame, or no study, series, frame
    of reference, position, orientation or pixel spacing."""
    geometry = sidecar.get("geometry") or {}
    output = sidecar.get("output") or {}
    instance = sidecar.get("instance") or {}
    shape = sidecar.get("shape") or []
    study, series = sidecar.get("study_instance_uid"), sidecar.get("series_instance_uid")
    frame_of_reference = geometry.get("frame_of_reference_uid")
    sop = sidecar.get("sop_instance_uid")
    position = geometry.get("image_position_patient")
    orientation = geometry.get("image_orientation_patient")
    spacing = geometry.get("pixel_spacing")
    needed = (study, series, frame_of_reference, sop, position, orientation, spacing)
    if any(v is None for v in needed) or not output.get("npy") or not shape or shape[0] != 1:
        return None
    source = sidecar.get("source") or {}
    content = next(
        (str(source[k]) for k in ("crc64nvme", "sha256", "sha256_tree", "etag") if source.get(k)),
        "",
    )
    member = member_from_json(
        {
            "sop_instance_uid": sop,
            "npy": output["npy"],
            "content": content,
            "shape": shape,
            "dtype": sidecar.get("dtype"),
            "position": position,
            "orientation": orientation,
            "pixel_spacing": spacing,
            **instance,
        }
    )
    return SeriesId(str(study), str(series), str(frame_of_reference)), member


@dataclass(frozen=True, slots=True)
class VolumePlan:
    """A volume to write, or (``refused``) why there is none."""

    series: SeriesId
    members: tuple[Member, ...]  # the slices, sorted along the normal
    shape: tuple[int, ...]  # (slices, rows, columns[, samples])
    dtype: str  # every member's values exactly (NumPy's promotion of their types)
    affine: tuple[tuple[float, ...], ...] | None
    step_mm: float | None  # between consecutive slices
    version: str
    # "images_in_acquisition", "number_of_slices" or "manifest": every slice is here
    complete_by: str | None
    duplicates: tuple[str, ...]  # SOP Instance UIDs left out: a kept slice has their position
    acquisitions: tuple[int, ...]  # more than one: the series mixes acquisitions
    refused: tuple[str, ...]  # why no volume is written (gaps, uneven steps, mixed sizes)
    not_in_manifest: tuple[str, ...] = ()  # SOP Instance UIDs left out: the manifest omits them

    @property
    def complete_by_data(self) -> bool:
        return self.complete_by is not None

    def as_json(self, npy: str | None, nifti: str | None = None) -> dict[str, Any]:
        """The volume's sidecar (docs/output.md, "Series volumes")."""
        return {
            "study_instance_uid": self.series.study,
            "series_instance_uid": self.series.series,
            "frame_of_reference_uid": self.series.frame_of_reference,
            "version": self.version,
            "npy": npy,
            "nifti": nifti,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "affine": [list(row) for row in self.affine] if self.affine else None,
            "affine_space": "LPS",
            "affine_axes": ["slice", "row", "column"],
            "slice_step_mm": self.step_mm,
            "complete_by_data": self.complete_by_data,
            "complete_by": self.complete_by,
            "slices": [
                {
                    "sop_instance_uid": m.sop_instance_uid,
                    "npy": None if m.held else m.npy,
                    "position": list(m.position),
                }
                for m in self.members
            ],
            "duplicates": list(self.duplicates),
            "acquisitions": list(self.acquisitions),
            "refused": list(self.refused),
            "not_in_manifest": list(self.not_in_manifest),
        }


def version_of(members: Sequence[Member]) -> str:
    """A digest of which instances, with which bytes, a volume is made of."""
    digest = hashlib.sha256()
    for member in sorted(members, key=lambda m: m.sop_instance_uid):
        digest.update(json.dumps([member.sop_instance_uid, member.content]).encode())
    return digest.hexdigest()[:16]


def plan_volume(
    series: SeriesId,
    members: Sequence[Member],
    tolerance: float = DEFAULT_TOLERANCE,
    manifest: frozenset[str] | None = None,
) -> VolumePlan:
    """The volume the member records make (see the module's docstring for the rules).

    ``manifest``: the SOP Instance UIDs a series manifest names; the volume is then
    made of those members alone, and complete once every one of them is there."""
    not_in_manifest: tuple[str, ...] = ()
    if manifest is not None:
        not_in_manifest = tuple(
            sorted(m.sop_instance_uid for m in members if m.sop_instance_uid not in manifest)
        )
        members = [m for m in members if m.sop_instance_uid in manifest]
    refused: list[str] = []
    version = version_of(members)
    if not members:
        return _refused(series, version, ("no slices",), not_in_manifest)
    first = members[0]
    if len({m.shape[1:] for m in members}) > 1:
        refused.append("the slices' sizes differ")
    if len({m.pixel_spacing for m in members}) > 1:
        refused.append("the slices' pixel spacings differ")
    reference = np.asarray(first.orientation, dtype=np.float64)
    if any(
        len(m.orientation) != 6
        or np.abs(np.asarray(m.orientation) - reference).max() > _ORIENTATION_TOLERANCE
        for m in members
    ):
        refused.append("the slices' orientations differ")
    if refused:
        return _refused(series, version, tuple(refused), not_in_manifest)
    orientation = np.asarray(first.orientation, dtype=np.float64)
    normal = np.cross(orientation[:3], orientation[3:])
    order = sorted(
        members,
        key=lambda m: (
            float(np.dot(m.position, normal)),
            m.acquisition_number if m.acquisition_number is not None else 0,
            m.instance_number if m.instance_number is not None else 0,
            m.sop_instance_uid,
        ),
    )
    kept: list[Member] = []
    duplicates: list[str] = []
    for member in order:
        at = float(np.dot(member.position, normal))
        if kept and abs(at - float(np.dot(kept[-1].position, normal))) <= _SAME_POSITION_MM:
            duplicates.append(member.sop_instance_uid)
            continue
        kept.append(member)
    distances = [float(np.dot(m.position, normal)) for m in kept]
    steps = [b - a for a, b in itertools.pairwise(distances)]
    step = min(steps) if steps else None
    if step is not None:
        for index, gap in enumerate(steps):
            if abs(gap - step) > tolerance * step:
                missing = round(gap / step) - 1
                what = f"{missing} missing slice(s)" if missing >= 1 else "an uneven step"
                refused.append(
                    f"{what} after slice {index} ({gap:.4g} mm where the smallest step is"
                    f" {step:.4g} mm)"
                )
    complete_by = None
    if manifest is not None and manifest <= {m.sop_instance_uid for m in members}:
        complete_by = "manifest"
    elif _one_count({m.images_in_acquisition for m in members}) == len(kept):
        complete_by = "images_in_acquisition"
    elif _one_count({m.volume_slices for m in members}) == len(kept):
        complete_by = "number_of_slices"
    acquisitions = sorted({m.acquisition_number for m in kept if m.acquisition_number is not None})
    dtype = str(np.result_type(*{np.dtype(m.dtype) for m in kept}))
    affine = None
    if not refused:
        matrix = np.eye(4)
        matrix[:3, 0] = normal * (step if step is not None else 1.0)
        matrix[:3, 1] = orientation[3:] * first.pixel_spacing[0]
        matrix[:3, 2] = orientation[:3] * first.pixel_spacing[1]
        matrix[:3, 3] = kept[0].position
        if steps:  # the step along the positions, not only its length along the normal
            matrix[:3, 0] = (np.asarray(kept[-1].position) - kept[0].position) / len(steps)
        affine = tuple(tuple(float(v) for v in row) for row in matrix)
    return VolumePlan(
        series=series,
        members=tuple(kept),
        shape=(len(kept), *first.shape[1:]),
        dtype=dtype,
        affine=affine,
        step_mm=step,
        version=version,
        complete_by=complete_by,
        duplicates=tuple(duplicates),
        acquisitions=tuple(acquisitions) if len(acquisitions) > 1 else (),
        refused=tuple(refused),
        not_in_manifest=not_in_manifest,
    )


def _one_count(counts: set[int | None]) -> int | None:
    """The count every member names alike, else None."""
    return next(iter(counts)) if len(counts) == 1 else None


def _refused(
    series: SeriesId, version: str, why: tuple[str, ...], not_in_manifest: tuple[str, ...]
) -> VolumePlan:
    return VolumePlan(
        series, (), (0,), "float32", None, None, version, None, (), (), why, not_in_manifest
    )


def manifest_of(doc: Mapping[str, Any]) -> frozenset[str]:
    """The SOP Instance UIDs a series manifest names (docs/output.md, "Series volumes").

    Raises:
        ValueError: not a manifest: no non-empty list of strings ``sop_instance_uids``.
    """
    uids = doc.get("sop_instance_uids") if isinstance(doc, Mapping) else None
    if not isinstance(uids, list) or not uids or not all(isinstance(u, str) and u for u in uids):
        raise ValueError("a series manifest needs a non-empty list `sop_instance_uids`")
    return frozenset(uids)
