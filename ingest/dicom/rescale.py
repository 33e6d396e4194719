"""The Modality LUT of a header: Rescale Slope and Intercept, per frame where the file has them.

The output is rescaled per frame where the file has per-frame values
(docs/output.md): a frame's own Pixel Value Transformation (Per-Frame Functional
Groups) wins over the shared one; without functional groups, Rescale Slope and
Intercept apply when both are present, as pydicom's ``apply_modality_lut`` does.
Per-frame values are read from the raw sequence by ``frames`` when it can
(pydicom's own reading, a ``Dataset`` an item, is far slower), by pydicom
otherwise. Values that are missing, empty, several, or not finite are
``MalformedDicom``.
"""

from __future__ import annotations

import math
from typing import Final

from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset

from ingest.dicom.frames import per_frame_rescale
from ingest.dicom.image_pixel import Values
from ingest.errors import MalformedDicom, UnsupportedDicom

PER_FRAME_GROUPS: Final = 0x52009230
_UNDEFINED_LENGTH: Final = 0xFFFFFFFF


def modality_rescale(
    ds: Dataset, frames: int, per_frame: bool
) -> tuple[tuple[float, ...], tuple[float, ...], bool] | None:
    """(slopes, intercepts, rescale): per frame from functional groups, else pydicom's rule;
    None when ``per_frame`` is False and there are per-frame groups to read.

    A frame's own Pixel Value Transformation wins over the shared one; without
    functional groups, Rescale Slope and Intercept apply when both are present.
    """
    if ds.get("ModalityLUTSequence"):
        raise UnsupportedDicom("Modality LUT Sequence is not supported")
    if not per_frame and PER_FRAME_GROUPS in ds:
        return None
    shared_groups = ds.get("SharedFunctionalGroupsSequence")
    shared = _transformation(shared_groups[0]) if shared_groups else None
    own = _own_rescales(ds)
    if any(item is not None for item in own):
        if len(own) != frames:
            raise MalformedDicom(f"{len(own)} per-frame functional groups for {frames} frames")
        pairs = []
        for index, item in enumerate(own):
            chosen = item if item is not None else shared
            if chosen is None:
                raise MalformedDicom(f"frame {index} has no Pixel Value Transformation")
            pairs.append(slope_intercept(chosen) if isinstance(chosen, Dataset) else chosen)
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), True
    if shared is not None:
        slope, intercept = slope_intercept(shared)
        return (slope,), (intercept,), True
    if "RescaleSlope" in ds and "RescaleIntercept" in ds:
        slope, intercept = slope_intercept(ds)
        return (slope,), (intercept,), True
    return (1.0,), (0.0,), False


def raw_per_frame_groups(ds: Dataset) -> tuple[bytes, bool] | None:
    """The Per-Frame Functional Groups Sequence's value and whether it is implicit VR, while
    pydicom has not read its items yet (a raw, little-endian, defined-length element), for
    the raw walkers of ``frames``; else None (pydicom reads the items)."""
    raw = ds.get_item(PER_FRAME_GROUPS) if PER_FRAME_GROUPS in ds else None
    if (
        isinstance(raw, RawDataElement)
        and isinstance(raw.value, bytes)
        and raw.is_little_endian
        and raw.length != _UNDEFINED_LENGTH
    ):
        return raw.value, raw.is_implicit_VR
    return None


def _own_rescales(ds: Dataset) -> list[tuple[float, float] | Dataset | None]:
    """Per frame: its own (slope, intercept), or its Pixel Value Transformation item, or None.

    The raw bytes are read by ``frames`` when pydicom has not converted
    them yet (a defined-length sequence); otherwise, or when that walker is
    unsure, pydicom reads the items.
    """
    raw = raw_per_frame_groups(ds)
    if raw is not None:
        fast = per_frame_rescale(*raw)
        if fast is not None:
            return list(fast)
    return [_transformation(group) for group in ds.get("PerFrameFunctionalGroupsSequence") or []]


def _transformation(group: Dataset) -> Dataset | None:
    sequence = group.get("PixelValueTransformationSequence")
    return sequence[0] if sequence else None


def slope_intercept(item: Values) -> tuple[float, float]:
    return _number(item, "RescaleSlope"), _number(item, "RescaleIntercept")


def _number(item: Values, keyword: str) -> float:
    value = item.get(keyword)
    if value is None or value == "":
        raise MalformedDicom(f"{keyword} is missing or empty")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise MalformedDicom(f"{keyword} is not a single number")
    if not math.isfinite(number := float(value)):
        raise MalformedDicom(f"{keyword} is not finite")
    return number
