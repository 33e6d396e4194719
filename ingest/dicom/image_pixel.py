"""The Image Pixel module, read and checked in one place for both of the header's paths.

The header is read straight from its bytes (``direct``) or by pydicom; its
Pixel Data then goes to the device as stored (``header.pixel_format``) or is
decoded first (``codec_read.codec_from_dataset``). All of them take the Image
Pixel module from ``image_pixel`` here, so a value means the same, and is
refused with the same error, whichever way the object goes.

The rules are what pydicom 3's ``pixel_array`` decodes, narrowed where the
worker refuses more:

- Photometric Interpretation: one pydicom converts or returns as it is stored,
  with its number of samples per pixel. Those pydicom returns unconverted (YBR
  partial, HSV, ARGB, CMYK, XYB) are refused: the output could not be labelled.
- Bits Allocated 1, 8, 16 or 32. 1 is bit-packed data, which pydicom unpacks to
  one ``uint8`` a pixel (Pixel Representation has no say); the device takes only
  whole bytes, so such an image is decoded first (``needs_codec``). pydicom also
  decodes 64, which the worker does not support; other values are malformed.
- Bits Stored within 1 .. Bits Allocated; Pixel Representation 0 or 1; Rows and
  Columns within 1 .. 65535; Planar Configuration 0 or 1 (read only for three
  samples per pixel).
- Number of Frames as pydicom reads it: absent, empty or 0 is one frame; a text
  value is read as an integer.

Errors name elements and numbers, never text values (they could be patient data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from ingest.errors import MalformedDicom, UnsupportedDicom

# The Photometric Interpretations pydicom decodes, and their samples per pixel
SAMPLES_OF: Final = {
    **{"MONOCHROME1": 1, "MONOCHROME2": 1, "PALETTE COLOR": 1, "RGB": 3},
    **{"YBR_FULL": 3, "YBR_FULL_422": 3, "YBR_ICT": 3, "YBR_RCT": 3},
}
# pydicom returns these as stored: not an image the worker can label
UNCONVERTED: Final = frozenset({"YBR_PARTIAL_422", "YBR_PARTIAL_420", "HSV", "ARGB", "CMYK", "XYB"})
BITS_ALLOCATED: Final = (1, 8, 16, 32)


class Values(Protocol):
    """Element values by pydicom keyword (a ``Dataset``, or a dict of the same values)."""

    def get(self, key: str, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class ImagePixel:
    """An Image Pixel module that passed ``image_pixel``'s checks."""

    photometric_interpretation: str
    samples_per_pixel: int
    rows: int
    columns: int
    bits_allocated: int  # one of BITS_ALLOCATED
    bits_stored: int
    pixel_representation: int
    planar_configuration: int  # 0 when samples_per_pixel is 1
    number_of_frames: int


def image_pixel(values: Values) -> ImagePixel:
    """The Image Pixel module of ``values``, checked with the rules above.

    Raises:
        MalformedDicom: an element missing, not a single value, or out of range.
        UnsupportedDicom: a Photometric Interpretation the worker does not decode,
            Bits Allocated 64.
    """
    photometric = _text(values, "PhotometricInterpretation", "Photometric Interpretation")
    samples = _int(values, "SamplesPerPixel", "Samples per Pixel")
    rows = _int(values, "Rows", "Rows")
    columns = _int(values, "Columns", "Columns")
    allocated = _int(values, "BitsAllocated", "Bits Allocated")
    stored = _int(values, "BitsStored", "Bits Stored")
    representation = _int(values, "PixelRepresentation", "Pixel Representation")
    frames = _frames(values.get("NumberOfFrames"))
    if photometric in UNCONVERTED or photometric not in SAMPLES_OF:
        shown = repr(photometric) if photometric in UNCONVERTED else "(unknown value)"
        raise UnsupportedDicom(f"photometric interpretation {shown} is not supported")
    if samples != SAMPLES_OF[photometric]:
        raise MalformedDicom(f"{photometric} with {samples} samples per pixel")
    if allocated == 64:
        raise UnsupportedDicom("Bits Allocated 64 is not supported")
    if allocated not in BITS_ALLOCATED:
        raise MalformedDicom(f"Bits Allocated {allocated} is not 1, 8, 16 or 32")
    if not 1 <= stored <= allocated:
        raise MalformedDicom(f"Bits Stored {stored} is not within 1..{allocated}")
    if representation not in (0, 1):
        raise MalformedDicom(f"Pixel Representation {representation} is not 0 or 1")
    if not (1 <= rows <= 65535 and 1 <= columns <= 65535):
        raise MalformedDicom(f"an image of {rows} x {columns} pixels")
    planar = _int(values, "PlanarConfiguration", "Planar Configuration") if samples == 3 else 0
    if planar not in (0, 1):
        raise MalformedDicom(f"Planar Configuration {planar} is not 0 or 1")
    return ImagePixel(
        photometric_interpretation=photometric,
        samples_per_pixel=samples,
        rows=rows,
        columns=columns,
        bits_allocated=allocated,
        bits_stored=stored,
        pixel_representation=representation,
        planar_configuration=planar,
        number_of_frames=frames,
    )


def _text(values: Values, keyword: str, name: str) -> str:
    value = values.get(keyword)
    if value is None or value == "":
        raise MalformedDicom(f"missing {name}")
    if not isinstance(value, str):
        raise MalformedDicom(f"{name} is not a single value")
    return value.strip()


def _int(values: Values, keyword: str, name: str) -> int:
    value = values.get(keyword)
    if value is None or value == "":
        raise MalformedDicom(f"missing {name}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedDicom(f"{name} is not a single integer")
    return int(value)


def _frames(value: object) -> int:
    """Number of Frames as pydicom reads it: absent, empty or 0 is one frame."""
    if isinstance(value, str) and value.strip():
        try:
            value = int(value)
        except ValueError:
            raise MalformedDicom("Number of Frames is not an integer") from None
    if value is None or value == "" or value == 0:
        return 1
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedDicom("Number of Frames is not a single integer")
    if value < 1:
        raise MalformedDicom(f"Number of Frames {value} is below 1")
    return int(value)
