"""A plain DICOM header read straight from its bytes, without pydicom.

pydicom reads a CT slice's header holding the lock that keeps its warning
filters sane: a large share of a slice's CPU in the worker
(``.venv/bin/python -m ingest.bench.diagnostics.header_cost`` measures it), and
one parse at a time across its GET threads. Most headers are plain: a file meta
with a little-endian transfer syntax, uncompressed or compressed, then a data set
whose image attributes are values in their dictionary VR. Pixel Data that is
decoded before the device gets its ``Codec`` as ``codec_read.codec_from_image``
makes it from pydicom's reading (a palette is read by pydicom). For those,
``read_plain_header`` walks the elements (``walk``), converts the values
the pipeline needs (``_WANTED``: the image's and its geometry's) as pydicom
converts them, and gives them to the same checks
as the pydicom path (``header``), in a tenth of the time.

It returns None for anything else, and pydicom reads the header instead
(and words the error, if there is one): no 'DICM'; a missing, repeated or
unsupported Transfer Syntax UID; a data set that does not open in the
encoding the meta names (pydicom would switch); a wanted value in another
VR or form than expected (several values, characters outside what the
attribute holds, an empty number); a wanted tag twice; functional groups or
a Modality LUT Sequence; a Specific Character Set with a term pydicom does not
know (it reads that one at once, and fails on some); a prefix that ends
before the Pixel Data; or any check that fails. The tests read every sample,
bad input and mutant both ways and compare (``tests/ingest/dicom/test_direct.py``; its slow
test counts how many of 3,000 mutants this reader takes).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Final

from pydicom.charset import python_encoding

from ingest.dicom.codec import decoded_format
from ingest.dicom.codec_read import Codec, codec_from_image, needs_codec
from ingest.dicom.fragments import ENCAPSULATED_UNCOMPRESSED
from ingest.dicom.header import (
    PIXEL_TAG,
    DicomHeader,
    ShortPrefix,
    header_of,
    locate_pixels,
    locate_stored,
    pixel_format,
)
from ingest.dicom.image_pixel import ImagePixel, image_pixel
from ingest.dicom.rescale import slope_intercept
from ingest.dicom.syntaxes import EXPLICIT_VR_BE as EXPLICIT_VR_BE_UID
from ingest.dicom.syntaxes import IMPLICIT_VR_LE, READABLE, is_compressed
from ingest.dicom.walk import Unsure, Walker
from ingest.errors import IngestError

_TRANSFER_SYNTAX: Final = 0x00020010
# Read here: little endian, native or compressed (a Deflated data set is inflated first)
_SYNTAXES: Final = frozenset(READABLE - {EXPLICIT_VR_BE_UID})
_LAST_BEFORE_PIXELS: Final = 0x7FDFFFFF  # a tag past this, before the Pixel Data: pydicom
# Their presence changes what the Modality LUT is (rescale.py reads them with pydicom), or
# makes the object a tiled slide whose total matrix the sidecar reports (header.slide_of).
_DECLINED: Final = frozenset({0x00283000, 0x52009229, 0x52009230, 0x00480006, 0x00480007})
_UID: Final = re.compile(rb"[0-9.]*")
_CODE: Final = re.compile(rb"[A-Z0-9_ ]*")
# One long string of printable ASCII with no padding inside or backslash: what pydicom reads
# the same in any character set; anything else goes to pydicom
_PLAIN_LO: Final = re.compile(rb"(?:[!-\[\]-~](?:[ -\[\]-~]{0,62}[!-\[\]-~])?)?")
_INTEGER: Final = re.compile(rb" *[0-9]{1,9}")
_DECIMAL: Final = re.compile(rb" *[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def _us(raw: bytes) -> int | str:
    if not raw:
        return ""
    if len(raw) != 2:
        raise Unsure  # several values, or a broken one
    return int.from_bytes(raw, "little")


def _text_of(pattern: re.Pattern[bytes], padding: bytes) -> Callable[[bytes], str]:
    def convert(raw: bytes) -> str:  # pydicom: padding stripped on the right, split on '\'
        value = raw.rstrip(padding)
        if not pattern.fullmatch(value):
            raise Unsure
        return value.decode("ascii")

    return convert


def _is(raw: bytes) -> int | str:
    value = raw.rstrip(b" \0")
    if not value:
        return ""
    if not _INTEGER.fullmatch(value):
        raise Unsure
    return int(value)


def _ds(raw: bytes) -> float | str:
    value = raw.rstrip(b" \0")
    if not value:
        return ""  # "missing or empty": the check says so, pydicom words it
    if len(value) > 16 or not _DECIMAL.fullmatch(value):
        raise Unsure
    return float(value)


def _ds_values(raw: bytes) -> float | tuple[float, ...] | str:
    """A DS of one or more numbers: one is a number (as pydicom gives it), several a tuple."""
    if b"\\" not in raw:
        return _ds(raw)
    parts = [_ds(part) for part in raw.split(b"\\")]
    if any(isinstance(part, str) for part in parts):  # an empty one: pydicom decides
        raise Unsure
    return tuple(float(part) for part in parts)


_CONVERT: Final[dict[bytes, Callable[[bytes], object]]] = {
    b"US": _us,
    b"IS": _is,
    b"DS": _ds,
    b"DS*": _ds_values,
    b"CS": _text_of(_CODE, b" \0"),
    b"UI": _text_of(_UID, b"\0 "),
    b"LO": _text_of(_PLAIN_LO, b" "),
}
_WANTED: Final = {
    0x00080016: ("SOPClassUID", b"UI"),
    0x00080018: ("SOPInstanceUID", b"UI"),
    0x00080060: ("Modality", b"CS"),
    0x00100020: ("PatientID", b"LO"),
    0x0020000D: ("StudyInstanceUID", b"UI"),
    0x0020000E: ("SeriesInstanceUID", b"UI"),
    0x00280002: ("SamplesPerPixel", b"US"),
    0x00280004: ("PhotometricInterpretation", b"CS"),
    0x00280006: ("PlanarConfiguration", b"US"),
    0x00280008: ("NumberOfFrames", b"IS"),
    0x00280010: ("Rows", b"US"),
    0x00280011: ("Columns", b"US"),
    0x00280100: ("BitsAllocated", b"US"),
    0x00280101: ("BitsStored", b"US"),
    0x00280103: ("PixelRepresentation", b"US"),
    0x00281052: ("RescaleIntercept", b"DS"),
    0x00281053: ("RescaleSlope", b"DS"),
    # the geometry (ingest.dicom.geometry)
    0x00180050: ("SliceThickness", b"DS"),
    0x00180088: ("SpacingBetweenSlices", b"DS"),
    0x00200012: ("AcquisitionNumber", b"IS"),
    0x00200013: ("InstanceNumber", b"IS"),
    0x00200032: ("ImagePositionPatient", b"DS*"),
    0x00200037: ("ImageOrientationPatient", b"DS*"),
    0x00200052: ("FrameOfReferenceUID", b"UI"),
    0x00201002: ("ImagesInAcquisition", b"IS"),
    0x00280030: ("PixelSpacing", b"DS*"),
    0x00540071: ("NumberOfTimeSlots", b"US"),
    0x00540081: ("NumberOfSlices", b"US"),
    0x00540101: ("NumberOfTimeSlices", b"US"),
    0x3004000C: ("GridFrameOffsetVector", b"DS*"),
}
_TAG: Final = struct.Struct("<HH")
_CHARACTER_SET: Final = 0x00080005
_META_VRS: Final = frozenset((b"UL", b"OB", b"UI", b"SH", b"AE", b"UR"))  # PS3.10 table 7.1-1


def _known_character_set(raw: bytes) -> bool:
    """Every term of a Specific Character Set value is one pydicom knows (or empty)."""
    terms = raw.rstrip(b" \0").split(b"\\")
    return all(t.strip(b" ").decode("latin-1") in python_encoding or not t.strip() for t in terms)


def read_plain_header(data: bytes, object_size: int, max_pixel_bytes: int) -> DicomHeader | None:
    """The header of ``data`` (the object's first bytes) if it is plain, else None."""
    try:
        return _read(data, object_size, max_pixel_bytes)
    except (Unsure, IngestError, ShortPrefix, struct.error, ValueError, UnicodeDecodeError):
        return None


def _read(data: bytes, object_size: int, max_pixel_bytes: int) -> DicomHeader:
    if data[128:132] != b"DICM":
        raise Unsure
    syntax, pos = _file_meta(data)
    implicit = syntax == IMPLICIT_VR_LE
    if pos + 6 > len(data):
        raise Unsure
    looks_explicit = 0x40 < data[pos + 4] < 0x5B and 0x40 < data[pos + 5] < 0x5B
    if looks_explicit == implicit:  # pydicom would read the data set the other way
        raise Unsure
    values, pos = _data_set(Walker(data, implicit), pos)
    image = image_pixel(values)
    photometric = image.photometric_interpretation
    complete = len(data) == object_size
    rescaled: tuple[tuple[float, ...], tuple[float, ...], bool] = ((1.0,), (0.0,), False)
    if "RescaleSlope" in values and "RescaleIntercept" in values:  # as ``rescale`` decides
        slope, intercept = slope_intercept(values)
        rescaled = (slope,), (intercept,), True
    if needs_codec(syntax, photometric, image.bits_allocated, False):
        codec = _codec(data, pos, implicit, syntax, image)
        stored = locate_stored(
            data,
            pos,
            implicit,
            True,
            complete,
            codec.stored_bytes,
            is_compressed(syntax),
            object_size,
        )
        return header_of(
            values, syntax, decoded_format(codec), photometric, stored, rescaled, codec
        )
    pixel = pixel_format(image)
    encapsulated = syntax == ENCAPSULATED_UNCOMPRESSED  # an Extended Offset Table: pydicom
    place = locate_pixels(
        data, pos, implicit, complete, pixel, object_size, max_pixel_bytes, encapsulated
    )
    return header_of(values, syntax, pixel, photometric, place, rescaled)


def _codec(data: bytes, pos: int, implicit: bool, syntax: str, image: ImagePixel) -> Codec:
    """The codec of Pixel Data that is decoded before the device, as ``codec_from_dataset``
    makes it; a palette (read with pydicom) is not read here."""
    if image.photometric_interpretation == "PALETTE COLOR":
        raise Unsure
    if implicit:  # the VR pydicom gives implicit Pixel Data
        vr = "OW" if image.bits_allocated > 8 else "OB"
    else:
        vr = data[pos + 4 : pos + 6].decode("latin-1")
    return codec_from_image(image, syntax, vr)


def _file_meta(data: bytes) -> tuple[str, int]:
    """The Transfer Syntax UID, and where the data set starts (group 0002 is explicit VR)."""
    walker, pos, syntax = Walker(data, implicit_vr=False), 132, None
    while pos + 4 <= len(data) and _TAG.unpack_from(data, pos)[0] == 0x0002:
        element = walker.element(pos, len(data))
        # pydicom converts meta values as it reads them: only the meta's own VRs,
        # whose conversion cannot fail (a UL of another length could)
        if element.vr not in _META_VRS or (
            element.vr == b"UL" and element.end - element.start != 4
        ):
            raise Unsure
        if element.tag == _TRANSFER_SYNTAX:
            if syntax is not None or element.vr != b"UI":
                raise Unsure
            syntax = _CONVERT[b"UI"](data[element.start : element.end])
        pos = element.next
    if syntax is None or syntax not in _SYNTAXES:
        raise Unsure
    return syntax, pos


def _data_set(walker: Walker, pos: int) -> tuple[dict[str, object], int]:
    """The wanted values as pydicom gives them, and where the Pixel Data tag is."""
    data, values, end = walker.data, dict[str, object](), len(walker.data)
    while data[pos : pos + 4] != PIXEL_TAG:
        tag, found_vr, start, stop, pos = walker.span(pos, end)
        if tag > _LAST_BEFORE_PIXELS or tag in _DECLINED:
            raise Unsure
        if (
            tag == _CHARACTER_SET
            and (  # pydicom converts it at once, and can fail
                found_vr not in (None, b"CS") or not _known_character_set(data[start:stop])
            )
        ):
            raise Unsure
        wanted = _WANTED.get(tag)
        if wanted is not None:
            keyword, vr = wanted
            if keyword in values or found_vr not in (None, vr[:2]):
                raise Unsure
            values[keyword] = _CONVERT[vr](data[start:stop])
    return values, pos
