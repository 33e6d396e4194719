"""DICOM header parsing: where an object's native Pixel Data lies and what it means.

Pure (the worker calls it in a worker thread): an object's first bytes go in, a
frozen :class:`DicomHeader` comes out, or :class:`NeedMoreBytes`. A plain
header is read straight from its bytes (``direct``); any other, pydicom
reads: ``dcmread(..., stop_before_pixels=True)`` leaves the file position
on the first byte of the top-level (7FE0,0010) tag (its reader seeks back over
the tag/VR/length it has just read before it stops), and the 8-byte implicit or
12-byte explicit OB/OW element header is read here. Only uncompressed
little-endian Pixel Data is handled: native, or Encapsulated Uncompressed (one
frame a fragment, located after its Basic Offset Table: ``ingest.dicom.fragments``);
what else pydicom decodes gets a ``Codec``; other transfer syntaxes are refused
from the file meta alone. A Deflated object is told apart by its file meta
(``DeflatedDataSet``) and never inflated here: ``ingest.dicom.deflate`` inflates
its data set a bounded step at a time and hands the inflated bytes back
(``inflated=True``). The Modality LUT (rescale values, per frame where the file
has them) is ``rescale``'s.
``parse_header`` is the one place where foreign exceptions become
``ingest.errors``; messages carry element names and numbers, never values that
could be patient data.
"""

from __future__ import annotations

import io
import logging
import re
import struct
import threading
import warnings
from typing import Final

from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.filereader import dcmread, read_dataset
from pydicom.uid import UID

from ingest.dicom.codec import codec_from_dataset, decoded_format, needs_codec
from ingest.dicom.direct import read_plain_header
from ingest.dicom.header import (
    FLOAT_TAGS,
    PIXEL_TAG,
    PIXEL_TAG_BE,
    DicomHeader,
    NeedMoreBytes,
    PixelPlace,
    ShortPrefix,
    header_of,
    locate_pixels,
    locate_stored,
    missing,
    pixel_format,
)
from ingest.dicom.image_pixel import image_pixel
from ingest.dicom.rescale import PER_FRAME_GROUPS, modality_rescale
from ingest.dicom.syntaxes import (
    DEFLATED_LE,
    ENCAPSULATED_UNCOMPRESSED,
    EXPLICIT_VR_BE,
    EXPLICIT_VR_LE,
    IMPLICIT_VR_LE,
    READABLE,
    is_compressed,
)
from ingest.errors import (
    DeflatedDataSet,
    LimitExceeded,
    MalformedDicom,
    NotDicom,
    UnsupportedDicom,
)

__all__ = ["DicomHeader", "NeedMoreBytes", "parse_header"]


_MIB: Final = 1024 * 1024
_MIN_REQUEST: Final = 64 * 1024
_ROWS_TAG: Final = 0x00280010
_UID_RE: Final = re.compile(r"[0-9.]{1,64}")

# warnings.catch_warnings() swaps process-wide state: two threads nesting it out
# of order can leave a filter behind for good, so parses take turns (they hold
# the GIL almost throughout anyway).
_PYDICOM_LOCK = threading.Lock()
_quiet = threading.local()


def _drop_while_parsing(record: logging.LogRecord) -> bool:
    # pydicom logs what it warns about, values included (names, IDs): keep those
    # out of the worker's logs while this module drives pydicom.
    return not getattr(_quiet, "on", False)


logging.getLogger("pydicom").addFilter(_drop_while_parsing)


class _Source(io.BytesIO):
    """A BytesIO that notes whether pydicom ever asked for bytes past its end."""

    def __init__(self, data: bytes, start: int = 0) -> None:
        super().__init__(data)
        self.seek(start)
        self.hit_end = False  # any short read, a clean end of the data included
        self.partial = False  # a read that got some, but not all, of what it asked for

    def read(self, size: int | None = -1, /) -> bytes:
        out = super().read(size)
        if size is not None and 0 <= len(out) < size:
            self.hit_end = True
            self.partial = self.partial or len(out) > 0
        return out


class _Step:
    """What the parse is doing, for error messages; never holds element values."""

    now = "checking the preamble"
    truncated = False  # a read ran past the end of a complete object


def parse_header(
    prefix: bytes | memoryview,
    object_size: int,
    *,
    max_header_bytes: int = 16 * _MIB,
    max_pixel_bytes: int = 64 * 1024 * _MIB,
    per_frame: bool = True,
    geometry: bool = True,
    inflated: bool = False,
) -> DicomHeader | NeedMoreBytes:
    """Parse the header in ``prefix`` (the object's first bytes) and locate its Pixel Data.

    Returns :class:`NeedMoreBytes` when ``prefix`` is shorter than the object and ends
    before the Pixel Data element header. With ``per_frame=False`` a Per-Frame
    Functional Groups Sequence is left unread (``per_frame_pending``): the layout is
    known in a fraction of the time (``python -m ingest.bench.diagnostics.header_cost``
    compares the two), and the same prefix parsed again in full gives the rescale
    values. With ``geometry=False`` the per-frame rescale values are read but not the
    frames' plane positions (``geometry`` None, a slide's per-frame tile places with
    it): what processing the frames needs, in a fraction of the time of the parse in
    full, which gives them.

    ``inflated``: ``prefix`` is a Deflated object's data set, inflated, behind a
    file meta naming Explicit VR Little Endian (the encoding pydicom reads an
    inflated data set in; ``ingest.dicom.deflate.inflated_header`` builds it), and
    ``object_size`` its size (larger while the stream has not ended): the header is
    Deflated Explicit VR Little Endian's, its Pixel Data decoded by a ``Codec`` (it
    is native once inflated), its offsets those of the bytes given.

    Raises:
        NotDicom: the bytes are not DICOM (or, without 'DICM', not a DICOM image).
        DeflatedDataSet: a Deflated object (not ``inflated``): its data set, from
            ``data_set_offset`` on, must be inflated before it is read.
        UnsupportedDicom: a transfer syntax, photometric interpretation, bit depth,
            Modality LUT Sequence ... this version does not process; no Pixel Data.
        MalformedDicom: the header contradicts itself or the object's size.
        LimitExceeded: the header is longer than ``max_header_bytes``, or the
            pixel data would be larger than ``max_pixel_bytes``.
        ValueError: ``object_size`` is smaller than the prefix (a caller bug).
    """
    data = bytes(prefix)
    if object_size < len(data):
        raise ValueError(f"object_size {object_size} is smaller than the prefix ({len(data)})")
    plain = None if inflated else read_plain_header(data, object_size, max_pixel_bytes)
    if plain is not None:  # a tenth of pydicom's time, and no lock
        return plain
    has_dicm = data[128:132] == b"DICM"
    step = _Step()
    with _PYDICOM_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _quiet.on = True
        try:
            return _parse(
                data, object_size, has_dicm, max_pixel_bytes, per_frame, geometry, step, inflated
            )
        except ShortPrefix as short:
            if len(data) >= max_header_bytes:
                raise LimitExceeded(f"DICOM header larger than {max_header_bytes} bytes") from None
            want = max(2 * len(data), short.need, _MIN_REQUEST)
            return NeedMoreBytes(at_least=min(want, max_header_bytes, object_size))
        except (LimitExceeded, MalformedDicom, NotDicom, UnsupportedDicom):
            raise
        except RecursionError as exc:
            raise MalformedDicom(f"sequences nested too deeply ({step.now})") from exc
        except MemoryError as exc:
            raise LimitExceeded(f"out of memory {step.now}") from exc
        except Exception as exc:
            if step.truncated and has_dicm:
                raise MalformedDicom(f"truncated: the object ends while {step.now}") from exc
            kind = MalformedDicom if has_dicm else NotDicom
            raise kind(f"unreadable header: {step.now} failed ({type(exc).__name__})") from exc
        finally:
            _quiet.on = False


def _parse(
    data: bytes,
    object_size: int,
    has_dicm: bool,
    max_pixel_bytes: int,
    per_frame: bool,
    geometry: bool,
    step: _Step,
    inflated: bool,
) -> DicomHeader:
    complete = len(data) == object_size
    if not has_dicm:
        if len(data) < 132 and not complete:
            raise ShortPrefix(132)
        if not _starts_with_element(data, object_size):
            raise NotDicom("no 'DICM' prefix at byte 128 and no DICOM element at byte 0")

    step.now = "reading the file meta information"
    syntax = _meta_transfer_syntax(data, has_dicm, complete)

    step.now = "reading the header"
    src = _Source(data)
    try:
        ds = dcmread(src, stop_before_pixels=True, force=True)
    except Exception:
        if not complete and src.hit_end:
            raise ShortPrefix() from None
        step.truncated = src.hit_end
        raise
    pos = src.tell()
    tag = data[pos : pos + 4]
    if tag == PIXEL_TAG_BE and syntax == EXPLICIT_VR_BE:
        tag = PIXEL_TAG
    if tag != PIXEL_TAG:
        if tag in FLOAT_TAGS:
            raise UnsupportedDicom(f"{FLOAT_TAGS[tag]} Pixel Data is not supported")
        if not complete:
            raise ShortPrefix(pos + 12)
        if not has_dicm:
            raise NotDicom("no 'DICM' prefix and no Pixel Data: not a DICOM image")
        if data.find(PIXEL_TAG, 132) != -1 or src.partial:
            raise MalformedDicom("truncated or inconsistent lengths: Pixel Data not reachable")
        if _is_image(ds):  # an image whose Pixel Data was cut off
            raise MalformedDicom("truncated: an image object without its Pixel Data")
        raise UnsupportedDicom("no Pixel Data")

    step.now = "reading the image elements"
    implicit, little = _encoding(ds, has_dicm)
    chosen = syntax or (IMPLICIT_VR_LE if implicit else EXPLICIT_VR_LE)
    if inflated:  # read as pydicom reads an inflated data set; decoded as Deflated
        chosen = DEFLATED_LE
    if not little and chosen != EXPLICIT_VR_BE:
        raise UnsupportedDicom("a big endian data set without the Explicit VR Big Endian syntax")
    if needs_codec(
        chosen,
        str(ds.get("PhotometricInterpretation", "")).strip(),
        _int_or_zero(ds.get("BitsAllocated")),
        "ModalityLUTSequence" in ds,
    ):
        return _decoded(
            ds,
            data,
            pos,
            implicit,
            little,
            complete,
            chosen,
            object_size,
            step,
            per_frame,
            geometry,
        )
    image = image_pixel(ds)
    pixel, photometric = pixel_format(image), image.photometric_interpretation
    step.now = "locating the pixels"
    tables = (ds.get("ExtendedOffsetTable"), ds.get("ExtendedOffsetTableLengths"))
    encapsulated = syntax == ENCAPSULATED_UNCOMPRESSED
    place = locate_pixels(
        data, pos, implicit, complete, pixel, object_size, max_pixel_bytes, encapsulated, tables
    )
    step.now = "reading the Modality LUT"
    rescaled = modality_rescale(ds, pixel.frames, per_frame)
    step.now = "reading the UIDs"
    return header_of(ds, chosen, pixel, photometric, place, rescaled, geometry=geometry)


def _decoded(
    ds: Dataset,
    data: bytes,
    pos: int,
    implicit: bool,
    little: bool,
    complete: bool,
    syntax: str,
    object_size: int,
    step: _Step,
    per_frame: bool,
    geometry: bool,
) -> DicomHeader:
    """The header of Pixel Data that pydicom's decoders turn into values first;
    ``per_frame`` and ``geometry`` as ``parse_header``'s."""
    step.now = "reading the pixel description"
    vr = data[pos + 4 : pos + 6].decode("latin-1") if not implicit else ""
    if implicit:  # the VR pydicom gives implicit Pixel Data
        vr = "OW" if _int_or_zero(ds.get("BitsAllocated")) > 8 else "OB"
    codec = codec_from_dataset(ds, syntax, vr)
    pixel = decoded_format(codec)
    step.now = "locating the pixels"
    encapsulated = is_compressed(syntax)
    try:
        place: PixelPlace = locate_stored(
            data, pos, implicit, little, complete, codec.stored_bytes, encapsulated, object_size
        )
    except MalformedDicom as exc:
        raise MalformedDicom(f"{codec.syntax_name}: {exc}") from exc
    step.now = "reading the Modality LUT"
    rescaled: tuple[tuple[float, ...], tuple[float, ...], bool] | None
    if not per_frame and PER_FRAME_GROUPS in ds:  # left for the parse in full
        rescaled = None
    elif codec.modality_lut is not None:  # applied by the decoder: its values are final
        rescaled = ((1.0,), (0.0,), False)
    else:
        found = modality_rescale(ds, pixel.frames, per_frame=True)
        assert found is not None  # per_frame=True always reads them
        rescaled = found
    table = (ds.get("ExtendedOffsetTable"), ds.get("ExtendedOffsetTableLengths"))
    offset_table = (
        (bytes(table[0]), bytes(table[1]))
        if encapsulated and isinstance(table[0], bytes) and isinstance(table[1], bytes)
        else None
    )
    step.now = "reading the UIDs"
    return header_of(
        ds,
        syntax,
        pixel,
        codec.photometric_interpretation,
        place,
        rescaled,
        codec,
        offset_table,
        geometry=geometry,
    )


def _int_or_zero(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _starts_with_element(data: bytes, object_size: int) -> bool:
    """Whether a file without preamble plausibly opens with a DICOM element."""
    if len(data) < 8 or data[:2] not in (b"\x02\x00", b"\x08\x00"):
        return False
    vr = data[4:6]
    return (vr.isalpha() and vr.isupper()) or struct.unpack_from("<I", data, 4)[0] <= object_size


def _meta_transfer_syntax(data: bytes, has_dicm: bool, complete: bool) -> str | None:
    """The file meta's Transfer Syntax UID, refusing what the header reader does not read.

    Raises:
        DeflatedDataSet: the syntax is Deflated; the data set starts where the meta ends.
        UnsupportedDicom: a syntax with no decoder.
    """
    start = 132 if has_dicm else 0
    if data[start : start + 2] != b"\x02\x00":
        return None  # no file meta: pydicom guesses the encoding from the data set
    src = _Source(data, start)
    try:
        meta = read_dataset(src, False, True, stop_when=lambda tag, _vr, _len: tag >> 16 != 2)
        value = meta.get("TransferSyntaxUID")
    except Exception:
        if not complete and src.hit_end:
            raise ShortPrefix() from None
        raise
    if src.hit_end:
        if not complete:
            raise ShortPrefix()
        raise MalformedDicom("truncated in the file meta information")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise MalformedDicom("Transfer Syntax UID is not a single UID")
    syntax = str(value)
    # only a well-formed UID is echoed: these bytes could be anything
    shown = f"{syntax} ({UID(syntax).name})" if _UID_RE.fullmatch(syntax) else "(not a UID)"
    if syntax == DEFLATED_LE:  # pydicom would inflate the whole data set: never here
        raise DeflatedDataSet(
            f"transfer syntax {shown}: its data set is inflated first", src.tell()
        )
    if syntax not in READABLE:
        raise UnsupportedDicom(
            f"transfer syntax {shown} is not supported: no decoder for it is installed"
        )
    return syntax


def _is_image(ds: Dataset) -> bool:
    """Image attributes, or an image storage SOP class (meta or data set), are present."""
    if "Rows" in ds and "Columns" in ds:
        return True
    meta = getattr(ds, "file_meta", None)
    sop = ds.get("SOPClassUID") or (meta.get("MediaStorageSOPClassUID") if meta else None)
    return isinstance(sop, str) and "Image" in UID(sop).name


def _encoding(ds: Dataset, has_dicm: bool) -> tuple[bool, bool]:
    """(implicit VR, little endian) as pydicom actually read the data set (it may override
    the meta)."""
    raw = ds.get_item(_ROWS_TAG)
    if raw is None:
        raise missing("Rows", has_dicm)
    encoding: tuple[bool | None, bool | None] = ds.original_encoding
    if isinstance(raw, RawDataElement):
        encoding = (raw.is_implicit_VR, raw.is_little_endian)
    return bool(encoding[0]), bool(encoding[1])
