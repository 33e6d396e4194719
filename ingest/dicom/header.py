"""What a DICOM header gives the pipeline, and the checks both of its readers share.

``dicom.parse_header`` reads a header with pydicom, or first straight from its
bytes (``direct``) when it is plain; both then hand the values they
found to ``image_pixel`` (the Image Pixel module's checks), ``text`` and
``locate_pixels`` here, so a header means the same whichever reader read it.
``Values`` is what both offer: a ``get`` by pydicom keyword that returns what
pydicom's ``Dataset.get`` would.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Final

from ingest.dicom.codec import Codec
from ingest.dicom.fragments import (
    ITEM_HEADER,
    check_offset_tables,
    fragment_length,
    fragment_pitch,
    read_item,
)
from ingest.dicom.geometry import Geometry, geometry_of, has_per_frame_groups, read_per_frame
from ingest.dicom.image_pixel import ImagePixel, Values
from ingest.dicom.slide import Slide, slide_of
from ingest.dicom.syntaxes import NATIVE_LE
from ingest.errors import LimitExceeded, MalformedDicom, NotDicom
from ingest_gpu.formats import OutDtype, PixelFormat, Transform

SUPPORTED_TRANSFER_SYNTAXES: Final = NATIVE_LE  # what the direct reader and the ring path take

PIXEL_TAG: Final = b"\xe0\x7f\x10\x00"
PIXEL_TAG_BE: Final = b"\x7f\xe0\x00\x10"
FLOAT_TAGS: Final = {b"\xe0\x7f\x08\x00": "Float", b"\xe0\x7f\x09\x00": "Double Float"}
UNDEFINED_LENGTH: Final = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class DicomHeader:
    """What the pipeline needs from one DICOM object's header."""

    transfer_syntax_uid: str  # from the file meta, or the encoding pydicom found
    study_instance_uid: str | None
    series_instance_uid: str | None
    sop_instance_uid: str | None
    modality: str | None
    photometric_interpretation: str
    pixel: PixelFormat
    transform_slopes: tuple[float, ...]  # one value for all frames, or one per frame
    transform_intercepts: tuple[float, ...]
    rescale: bool  # False: pydicom's Modality LUT leaves stored values as they are
    pixel_offset: int  # byte offset of the first sample within the object
    pixel_length: int  # == pixel.total_bytes; the element may hold more (a pad byte)
    # parse_header(per_frame=False) left the per-frame functional groups unread: the
    # rescale fields above are empty until the header is parsed again in full
    per_frame_pending: bool = False
    # Encapsulated Uncompressed (ingest.dicom.fragments): frame k's samples start at
    # pixel_offset + k * frame_pitch, an item header before each; 0: native, contiguous
    frame_pitch: int = 0
    # Pixel Data that is decoded before the device (compressed, big endian, palette,
    # YBR, 1-bit, Modality LUT Sequence): ``pixel`` is then the decoded layout, and
    # pixel_offset/pixel_length the stored element value (fragments and delimiter
    # included when encapsulated)
    codec: Codec | None = None
    # the Extended Offset Table and its lengths, when an encapsulated object has them
    offset_table: tuple[bytes, bytes] | None = None
    slide: Slide | None = None  # a tiled whole-slide image's total matrix
    # for the audit trail's DICOM audit message only (encrypted there), never logged
    sop_class_uid: str | None = None
    patient_id: str | None = field(default=None, repr=False)
    # spacing, position, orientation, the affine; None while per_frame_pending
    geometry: Geometry | None = None

    def transform(self, window: tuple[float, float] | None, out_dtype: OutDtype) -> Transform:
        """The preprocessing of this object's samples, with the worker's window and dtype."""
        if self.per_frame_pending:
            raise RuntimeError("the per-frame rescale values were not read: parse in full")
        return Transform(
            self.transform_slopes, self.transform_intercepts, self.rescale, window, out_dtype
        )


@dataclass(frozen=True, slots=True)
class NeedMoreBytes:
    """The prefix ended before the Pixel Data element header; try again with more."""

    at_least: int  # bytes of prefix to fetch next (never more than the object)


class ShortPrefix(Exception):
    """Internal: the prefix ran out; ``need`` is a lower bound of what suffices."""

    def __init__(self, need: int = 0) -> None:
        self.need = need


def pixel_element(
    data: bytes, pos: int, implicit: bool, complete: bool, little: bool = True
) -> tuple[int, int]:
    """(value offset, value length) of the Pixel Data element whose tag is at ``pos``."""
    size = 8 if implicit else 12
    if pos + size > len(data):
        if not complete:
            raise ShortPrefix(pos + size)
        raise MalformedDicom("truncated: the object ends inside the Pixel Data element header")
    if not implicit and data[pos + 4 : pos + 6] not in (b"OB", b"OW"):
        raise MalformedDicom(f"Pixel Data has VR {data[pos + 4 : pos + 6]!r}, not OB or OW")
    order = "<I" if little else ">I"
    return pos + size, int(struct.unpack_from(order, data, pos + size - 4)[0])


def missing(keyword: str, has_dicm: bool) -> Exception:
    if not has_dicm:
        return NotDicom(f"no 'DICM' prefix and no {keyword}: not a DICOM image")
    return MalformedDicom(f"missing {keyword}")


def pixel_format(image: ImagePixel) -> PixelFormat:
    """The layout of an image whose samples the device takes as stored: one that
    ``needs_codec`` leaves to the native path (whole bytes, MONOCHROME1/2 or RGB)."""
    return PixelFormat(
        rows=image.rows,
        columns=image.columns,
        frames=image.number_of_frames,
        samples=image.samples_per_pixel,
        bits_allocated=image.bits_allocated,
        bits_stored=image.bits_stored,
        signed=image.pixel_representation == 1,
        planar=image.planar_configuration == 1,
    )


def text(ds: Values, keyword: str) -> str | None:
    value = ds.get(keyword)
    return (str(value) or None) if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class PixelPlace:
    offset: int  # of the first sample in the object
    length: int  # the pixels' bytes (the element may hold one more, a pad byte)
    pitch: int = 0  # encapsulated: from one frame's first sample to the next's


def locate_pixels(
    data: bytes,
    pos: int,
    implicit: bool,
    complete: bool,
    pixel: PixelFormat,
    object_size: int,
    max_pixel_bytes: int,
    encapsulated: bool = False,
    tables: tuple[object, object] = (None, None),
) -> PixelPlace:
    """Check the Pixel Data element whose tag is at ``pos`` against the image's format.

    ``encapsulated``: Encapsulated Uncompressed, whose Extended Offset Table and its
    lengths (values, or None) are ``tables``.

    Raises:
        ShortPrefix: ``data`` is a prefix that ends inside the element header (or,
            encapsulated, before the first fragment's item header).
        MalformedDicom, LimitExceeded: lengths that contradict the format or the object.
    """
    offset, length = pixel_element(data, pos, implicit, complete)
    expected = pixel.total_bytes
    if expected > max_pixel_bytes:
        raise LimitExceeded(f"pixel data of {expected} bytes exceeds the limit ({max_pixel_bytes})")
    if encapsulated:
        return _locate_fragments(data, offset, length, complete, pixel, object_size, tables)
    if length == UNDEFINED_LENGTH:
        raise MalformedDicom("Pixel Data has undefined length in a native transfer syntax")
    if length < expected:
        raise MalformedDicom(f"Pixel Data holds {length} bytes but the header needs {expected}")
    if offset + expected > object_size:
        raise MalformedDicom(f"truncated: Pixel Data ends past the {object_size}-byte object")
    if offset + length > object_size:
        raise MalformedDicom(f"Pixel Data length runs past the {object_size}-byte object")
    if length // pixel.frame_bytes > pixel.frames:  # pydicom would return the extra frames
        raise MalformedDicom("Pixel Data holds more frames than Number of Frames says")
    return PixelPlace(offset, expected)


def _locate_fragments(
    data: bytes,
    offset: int,
    length: int,
    complete: bool,
    pixel: PixelFormat,
    object_size: int,
    tables: tuple[object, object],
) -> PixelPlace:
    """Frames one per fragment after the Basic Offset Table item at ``offset``."""

    def have(end: int, what: str) -> None:
        if end > len(data):
            if not complete:
                raise ShortPrefix(end)
            raise MalformedDicom(f"truncated: the object ends inside {what}")

    if length != UNDEFINED_LENGTH:
        raise MalformedDicom("Pixel Data has a defined length in an encapsulated transfer syntax")
    extended, lengths = (_binary(value, name) for value, name in zip(tables, _TABLES, strict=True))
    have(offset + ITEM_HEADER, "the Basic Offset Table")
    basic = read_item(data, offset, "Basic Offset Table")
    if basic % 4 or basic > 4 * pixel.frames:
        raise MalformedDicom(f"Basic Offset Table of {basic} bytes for {pixel.frames} frames")
    first_item = offset + ITEM_HEADER + basic
    have(first_item + ITEM_HEADER, "the first fragment's item header")
    check_offset_tables(data[offset + ITEM_HEADER : first_item], extended, lengths, pixel)
    fragment = read_item(data, first_item, "the first fragment")
    if fragment != fragment_length(pixel):
        raise MalformedDicom(
            f"the first fragment holds {fragment} bytes; one frame is {pixel.frame_bytes}"
            " (Encapsulated Uncompressed: a frame a fragment)"
        )
    pitch = fragment_pitch(pixel)
    if first_item + pixel.frames * pitch + ITEM_HEADER > object_size:
        raise MalformedDicom(
            f"truncated: {pixel.frames} frames of a fragment each run past the"
            f" {object_size}-byte object"
        )
    return PixelPlace(first_item + ITEM_HEADER, pixel.total_bytes, pitch)


def locate_stored(
    data: bytes,
    pos: int,
    implicit: bool,
    little: bool,
    complete: bool,
    stored_bytes: int,
    encapsulated: bool,
    object_size: int,
) -> PixelPlace:
    """The stored value of a Pixel Data element that is decoded before the device.

    Native (big endian, palette, YBR, 1-bit, a Modality LUT Sequence): the value
    must hold ``stored_bytes``; a larger object's frames are read in ranges
    (``ingest/pipeline/decoded.py``). Encapsulated, whole object: the items are walked up
    to the Sequence Delimiter, each checked against the object, and the place
    spans them all. Encapsulated, a prefix: the place runs from the value's first
    byte to the end of the object; the frames are split out of it as its ranges
    arrive (``ingest/dicom/encapsulated.py``), which checks the items then.

    Raises:
        ShortPrefix: ``data`` ends inside the element header.
        MalformedDicom: lengths that contradict the format or the object.
    """
    offset, length = pixel_element(data, pos, implicit, complete, little)
    if encapsulated:
        if length != UNDEFINED_LENGTH:
            raise MalformedDicom("Pixel Data has a defined length in an encapsulated syntax")
        if not complete:
            return PixelPlace(offset, object_size - offset)
        return PixelPlace(offset, _items_end(data, offset) - offset)
    if length == UNDEFINED_LENGTH:
        raise MalformedDicom("Pixel Data has undefined length in a native transfer syntax")
    if length < stored_bytes:
        raise MalformedDicom(f"Pixel Data holds {length} bytes but the header needs {stored_bytes}")
    if offset + stored_bytes > object_size:
        raise MalformedDicom(f"truncated: Pixel Data ends past the {object_size}-byte object")
    if offset + length > object_size:
        raise MalformedDicom(f"Pixel Data length runs past the {object_size}-byte object")
    # the whole value: odd 8-bit big endian OW data needs its pad byte (pairs are swapped)
    return PixelPlace(offset, length)


_ITEM_TAG: Final = b"\xfe\xff\x00\xe0"
_DELIMITER_TAG: Final = b"\xfe\xff\xdd\xe0"


def _items_end(data: bytes, offset: int) -> int:
    """The end of an encapsulated Pixel Data value in a whole object: past its Sequence
    Delimiter."""
    pos = offset
    while True:
        if pos + ITEM_HEADER > len(data):
            raise MalformedDicom("truncated: the object ends inside the Pixel Data items")
        tag = data[pos : pos + 4]
        length = int(struct.unpack_from("<I", data, pos + 4)[0])
        if tag == _DELIMITER_TAG:
            return pos + ITEM_HEADER
        if tag != _ITEM_TAG:
            raise MalformedDicom(f"an element that is not an item inside Pixel Data at byte {pos}")
        if length == UNDEFINED_LENGTH:
            raise MalformedDicom(f"a Pixel Data item of undefined length at byte {pos}")
        pos += ITEM_HEADER + length


_TABLES: Final = ("Extended Offset Table", "Extended Offset Table Lengths")


def _binary(value: object, name: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    raise MalformedDicom(f"{name} is not one binary value")


def header_of(
    values: Values,
    syntax: str,
    pixel: PixelFormat,
    photometric: str,
    place: PixelPlace,
    rescaled: tuple[tuple[float, ...], tuple[float, ...], bool] | None,
    codec: Codec | None = None,
    offset_table: tuple[bytes, bytes] | None = None,
    *,
    geometry: bool = True,
) -> DicomHeader:
    """The header from checked parts; ``rescaled`` None: the per-frame values are pending
    (the per-frame geometry with them); ``geometry`` False: an object's per-frame plane
    positions are left unread, and its geometry with them (``parse_header``)."""
    slopes, intercepts, rescale = rescaled or ((), (), False)
    planes = rescaled is not None and (geometry or not has_per_frame_groups(values))
    per_frame = read_per_frame(values) if planes else None
    found = geometry_of(values, pixel.frames, per_frame) if planes else None
    return DicomHeader(
        transfer_syntax_uid=syntax,
        study_instance_uid=text(values, "StudyInstanceUID"),
        series_instance_uid=text(values, "SeriesInstanceUID"),
        sop_instance_uid=text(values, "SOPInstanceUID"),
        modality=text(values, "Modality"),
        photometric_interpretation=photometric,
        pixel=pixel,
        transform_slopes=slopes,
        transform_intercepts=intercepts,
        rescale=rescale,
        pixel_offset=place.offset,
        pixel_length=place.length,
        per_frame_pending=rescaled is None,
        frame_pitch=place.pitch,
        codec=codec,
        offset_table=offset_table,
        slide=slide_of(values, pixel, per_frame, found.pixel_spacing if found else None),
        sop_class_uid=text(values, "SOPClassUID"),
        patient_id=text(values, "PatientID"),
        geometry=found,
    )
