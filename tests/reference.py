"""The output contract (docs/output.md) computed the plain way, with pydicom and NumPy.

Deliberately independent of ``ingest``: it reads the whole object with
``dcmread``, takes pydicom 3's ``pixel_array`` with its default options (which
mask or sign-extend the unused high bits, and turn YBR colour into RGB), maps
PALETTE COLOR through ``apply_color_lut``, applies the Modality LUT (per frame
from the functional groups where the object has them, otherwise pydicom's
``apply_modality_lut``: rescale, or the Modality LUT Sequence), then the
optional window, then the cast.
"""

from __future__ import annotations

import functools
import importlib.util
import struct
import warnings
from io import BytesIO
from pathlib import Path

import numpy as np
from pydicom import dcmread
from pydicom.data import get_charset_files, get_palette_files, get_testdata_files
from pydicom.dataset import Dataset
from pydicom.encaps import generate_frames
from pydicom.pixels.processing import apply_color_lut, apply_modality_lut
from pydicom.uid import UID, ExplicitVRLittleEndian, ImplicitVRLittleEndian

ENCAPSULATED_UNCOMPRESSED = UID("1.2.840.10008.1.2.1.98")

__all__ = ["as_native", "frame_rescale", "reference_array"]


def frame_rescale(ds: Dataset) -> list[tuple[float, float]] | None:
    """(slope, intercept) per frame from the functional groups, or None when they have none.

    A frame's own Pixel Value Transformation wins over the shared one; with only
    a shared one, every frame gets it.
    """
    shared_groups = ds.get("SharedFunctionalGroupsSequence") or []
    shared = None
    if shared_groups and shared_groups[0].get("PixelValueTransformationSequence"):
        shared = shared_groups[0].PixelValueTransformationSequence[0]
    own = [
        group.PixelValueTransformationSequence[0]
        if group.get("PixelValueTransformationSequence")
        else None
        for group in ds.get("PerFrameFunctionalGroupsSequence") or []
    ]
    if any(item is not None for item in own):
        items = [item if item is not None else shared for item in own]
    elif shared is not None:
        items = [shared] * int(ds.get("NumberOfFrames") or 1)
    else:
        return None
    pairs = []
    for item in items:
        if item is None:
            raise ValueError("a frame has no Pixel Value Transformation")
        pairs.append((float(item.RescaleSlope), float(item.RescaleIntercept)))
    return pairs


def as_native(ds: Dataset) -> None:
    """Encapsulated Uncompressed as the native Explicit VR Little Endian it stands for.

    pydicom 3.0 has no decoder for this syntax; its frames are the native bytes,
    one per fragment (padded to even), so they are taken out of the fragments
    with pydicom's own ``generate_frames`` and decoded as native.
    """
    frames = int(ds.get("NumberOfFrames") or 1)
    frame_bytes = (
        int(ds.Rows) * int(ds.Columns) * int(ds.SamplesPerPixel) * int(ds.BitsAllocated) // 8
    )
    extended = ds.get("ExtendedOffsetTable")
    offsets = None
    if extended is not None:
        offsets = (
            list(struct.unpack(f"<{frames}Q", extended)),
            list(struct.unpack(f"<{frames}Q", ds.ExtendedOffsetTableLengths)),
        )
    pieces = generate_frames(ds.PixelData, number_of_frames=frames, extended_offsets=offsets)
    ds.PixelData = b"".join(frame[:frame_bytes] for frame in pieces)
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian


def reference_array(data: bytes, window: tuple[float, float] | None, out_dtype: str) -> np.ndarray:
    """The array the worker must write for the object ``data``.

    Shape (frames, rows, columns) or (frames, rows, columns, samples).
    """
    with warnings.catch_warnings():
        # pydicom warns about odd-but-readable objects (excess padding ...)
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data), force=True)  # force: objects without file meta
        if not ds.file_meta.get("TransferSyntaxUID"):
            # no file meta: pydicom reads the data set but cannot decode without one
            implicit = ds.original_encoding[0]
            ds.file_meta.TransferSyntaxUID = (
                ImplicitVRLittleEndian if implicit else ExplicitVRLittleEndian
            )
        if ds.file_meta.TransferSyntaxUID == ENCAPSULATED_UNCOMPRESSED:
            as_native(ds)
        arr = ds.pixel_array
        samples = int(ds.SamplesPerPixel)
        if ds.get("PhotometricInterpretation") == "PALETTE COLOR":
            arr, samples = apply_color_lut(arr, ds), 3
    shape = (-1, int(ds.Rows), int(ds.Columns)) + ((samples,) if samples > 1 else ())
    arr = arr.reshape(shape)

    values: np.ndarray
    per_frame = frame_rescale(ds)
    if per_frame is not None:
        values = np.empty(arr.shape, dtype=np.float64)
        for index, (slope, intercept) in enumerate(per_frame):
            values[index] = arr[index].astype(np.float64) * slope
            values[index] += intercept
    else:
        values = apply_modality_lut(arr, ds)

    if window is not None:
        center, width = window
        x = values.astype(np.float64)
        values = np.clip((x - (center - 0.5)) / (width - 1) + 0.5, 0.0, 1.0)
    return values.astype(out_dtype)


def psnr(got: np.ndarray, want: np.ndarray) -> float:
    """Peak signal-to-noise ratio of ``got`` against ``want``, in dB, the peak being
    ``want``'s range (1 when it is flat); infinite when they are equal."""
    error = np.mean((got.astype(np.float64) - want.astype(np.float64)) ** 2)
    if error == 0:
        return float("inf")
    peak = float(np.max(want)) - float(np.min(want)) or 1.0
    return float(10 * np.log10(peak * peak / error))


def _files() -> tuple[list[Path], list[str]]:
    """Every file with pixel data in pydicom's package and pydicom-data, and the unreadable."""
    spec = importlib.util.find_spec("data_store")  # what pydicom-data installs
    assert spec is not None, "pydicom-data is not installed"
    assert spec.submodule_search_locations
    store = Path(next(iter(spec.submodule_search_locations))) / "data"
    paths = [*get_testdata_files(), *get_charset_files(), *get_palette_files()]
    candidates = {p.resolve() for p in [*map(Path, paths), *store.iterdir()] if p.is_file()}
    found, unreadable = [], []
    for path in sorted(candidates):
        # a scan for pixel data only: each file's warnings are checked in its own test
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ds = dcmread(path, force=True, defer_size=1024)
            except Exception:
                unreadable.append(path.name)
                continue
        if any(kw in ds for kw in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
            found.append(path)
    return found, unreadable


@functools.cache
def pydicom_samples() -> tuple[list[Path], list[str]]:
    """The files with pixel data of pydicom and pydicom-data, and the unreadable ones (found
    once, when a test module asks: a machine without pydicom-data runs the others)."""
    return _files()
