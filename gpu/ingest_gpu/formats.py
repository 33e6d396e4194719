"""Small frozen value types shared by the DICOM parser and the preprocessing stage.

``gpu/`` never imports ``ingest/``: these types are the whole contract between
them. A *chunk* is a run of raw stored samples of one object's Pixel Data, in
stored order, starting at sample index ``first_element`` of that object's pixel
stream; its bytes are contiguous, or whole frames one every ``pitch`` bytes
(``pitched_frames``: Encapsulated Uncompressed keeps an item header between
frames). Preprocessing is elementwise, so a chunk may start and end anywhere on
a sample boundary, except for planar colour (``planar=True``), whose chunks
must hold whole frames because the output interleaves the three planes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OutDtype = Literal[
    "float32", "float16", "float64", "uint8", "int8", "uint16", "int16", "uint32", "int32"
]
# The output dtypes in the kernel's order (its OUT template argument); the integer ones
# only for transforms whose every value is an integer they hold (``narrowest_exact``).
OUT_DTYPES: tuple[OutDtype, ...] = (
    "float32",
    "float16",
    "float64",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
)
_ITEMSIZE = {"float32": 4, "float16": 2, "float64": 8, "uint8": 1, "int8": 1}
_ITEMSIZE |= {"uint16": 2, "int16": 2, "uint32": 4, "int32": 4}


@dataclass(frozen=True, slots=True)
class PixelFormat:
    """How the stored samples of an uncompressed little-endian Pixel Data are laid out."""

    rows: int
    columns: int
    frames: int
    samples: int  # samples per pixel: 1 (monochrome) or 3 (RGB)
    bits_allocated: int  # 8, 16 or 32
    bits_stored: int
    signed: bool  # Pixel Representation 1
    planar: bool  # Planar Configuration 1 (RRR..GGG..BBB.. per frame)

    @property
    def itemsize(self) -> int:
        return self.bits_allocated // 8

    @property
    def stored_dtype(self) -> str:
        """NumPy dtype string of one stored sample (little endian)."""
        return f"<{'i' if self.signed else 'u'}{self.itemsize}"

    @property
    def frame_elements(self) -> int:
        return self.rows * self.columns * self.samples

    @property
    def frame_bytes(self) -> int:
        return self.frame_elements * self.itemsize

    @property
    def total_elements(self) -> int:
        return self.frame_elements * self.frames

    @property
    def total_bytes(self) -> int:
        return self.total_elements * self.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        """Output array shape: (frames, rows, columns) or (frames, rows, columns, samples)."""
        base = (self.frames, self.rows, self.columns)
        return base if self.samples == 1 else (*base, self.samples)


@dataclass(frozen=True, slots=True)
class Transform:
    """What preprocessing does to each stored sample, in this order:

    1. Modality LUT as a rescale: ``x * slope + intercept`` in float64, with the
       slope/intercept of the sample's frame (``slopes[i]`` for frame ``i``, or
       ``slopes[0]`` for all frames when one value is given). ``rescale=False``
       leaves the stored value as it is (pydicom does the same when the file has
       no Rescale Slope/Intercept).
    2. Optional VOI window ``(center, width)``:
       ``clip((x - (center - 0.5)) / (width - 1) + 0.5, 0, 1)`` in float64.
    3. Cast to ``out_dtype``: one correctly rounded cast to a float type, or to an
       integer type that holds every value exactly (``preprocess.narrowest_exact``
       chooses one only then).
    """

    slopes: tuple[float, ...] = (1.0,)
    intercepts: tuple[float, ...] = (0.0,)
    rescale: bool = False
    window: tuple[float, float] | None = None
    out_dtype: OutDtype = "float32"

    @property
    def out_itemsize(self) -> int:
        return _ITEMSIZE[self.out_dtype]


def pitched_frames(nbytes: int, frame_bytes: int, pitch: int) -> int:
    """How many frames ``nbytes`` hold when a frame starts every ``pitch`` bytes.

    The bytes run from the first frame's first sample to the last frame's last
    one: ``(frames - 1) * pitch + frame_bytes``.

    Raises:
        ValueError: ``pitch`` is shorter than a frame, or ``nbytes`` is not such a run.
    """
    if pitch < frame_bytes or frame_bytes < 1:
        raise ValueError(f"pitch {pitch} is shorter than a frame of {frame_bytes} bytes")
    frames, rest = divmod(nbytes - frame_bytes, pitch)
    if nbytes < frame_bytes or rest:
        raise ValueError(f"{nbytes} bytes are not whole frames of {frame_bytes} every {pitch}")
    return frames + 1
