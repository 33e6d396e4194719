"""Deflated Explicit VR Little Endian: the data set inflated a bounded step at a time,
and the header of what comes out.

In a Deflated object (PS3.5 A.5) everything after the file meta is one raw deflate
stream (RFC 1951, no zlib wrapper: ``wbits=-15``) of an Explicit VR Little Endian
data set, padded with one NUL byte to an even length; some writers append the
stream's CRC-32 and length instead, as gzip does (pydicom's ``image_dfl.dcm``), and
pydicom ignores whatever follows the stream, so up to ``MAX_TRAILING`` bytes after
it are ignored and more are refused. Offsets in the stored object
say nothing of offsets in the data set, so it is read from its start, in order,
and inflated as it arrives.

Deflate inflates up to 1,032 times (a 258-byte match coded in two bits): a 1 MB
object can hold a GB. So ``Inflater`` never returns more than ``max_length`` bytes
a step, and gives zlib its input in pieces of ``INPUT_PIECE`` bytes, so that what
zlib keeps of a step's unread input (``unconsumed_tail``) is small too: its memory
is its 32 KiB window and one piece, whatever the stream holds. What the caller
keeps of the output is the caller's bound.

``inflated_header`` reads the header from the inflated data set's first bytes with
``parse_header``, the same reader as every other object's: they are presented
behind a minimal file meta that names Explicit VR Little Endian, which is how
pydicom itself reads an inflated data set (``filereader.read_partial``), and come
back as a Deflated header whose Pixel Data (native once inflated) a ``Codec``
decodes as pydicom does, with offsets in the inflated data set.

Errors are ``MalformedDicom`` or ``LimitExceeded`` naming the syntax: a corrupt
stream, one the object ends inside, more than ``MAX_TRAILING`` bytes after its end,
a header larger than ``max_header_bytes`` once inflated, or one that declares more
than the stored stream could inflate to.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Final

from ingest.dicom.codec import Codec
from ingest.dicom.codec_read import syntax_name
from ingest.dicom.header import DicomHeader, NeedMoreBytes
from ingest.dicom.parse import parse_header
from ingest.dicom.syntaxes import DEFLATED_LE, EXPLICIT_VR_LE
from ingest.errors import DicomError, LimitExceeded, MalformedDicom

INPUT_PIECE: Final = 64 * 1024  # stored bytes given to zlib at a time
MAX_TRAILING: Final = 8  # bytes after the stream: a pad byte, or a CRC-32 and length
MAX_INFLATE_RATIO: Final = 1032  # deflate's bound: 258 bytes from two bits
NAME: Final = syntax_name(DEFLATED_LE)  # "Deflated Explicit VR Little Endian (1.2...99)"

# A file meta that names Explicit VR Little Endian: its Group Length and Transfer Syntax UID
_UID: Final = EXPLICIT_VR_LE.encode() + b"\0"
_TS_ELEMENT: Final = struct.pack("<HH2sH", 0x0002, 0x0010, b"UI", len(_UID)) + _UID
META: Final = (
    bytes(128)
    + b"DICM"
    + struct.pack("<HH2sHI", 0x0002, 0x0000, b"UL", 4, len(_TS_ELEMENT))
    + _TS_ELEMENT
)
_UNKNOWN_SIZE: Final = 1 << 62  # the inflated size, before the stream has ended


class Inflater:
    """A raw deflate stream inflated a bounded step at a time (pure; one caller at a time).

    ``give`` the stored bytes in order, each once the last is used up
    (``needs_input``), and ``inflate`` until it returns nothing; ``finish`` when the
    stored bytes have ended. A given buffer is read until it is used up, so the
    caller keeps it alive (and unchanged) until then.
    """

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
        self._input = memoryview(b"")
        self._at = 0  # how much of _input went to zlib
        self._tail = b""  # what zlib left unread of the last piece
        self.given = 0  # stored bytes given
        self.inflated = 0  # bytes returned
        self._after_end = 0  # stored bytes after the stream's end

    @property
    def eof(self) -> bool:
        """Whether the stream has ended (its final block is inflated)."""
        return bool(self._zlib.eof)

    @property
    def needs_input(self) -> bool:
        """Whether everything given is used up (inflated, or counted after the end)."""
        return not self._tail and self._at >= len(self._input)

    def give(self, data: bytes | memoryview) -> None:
        """The next stored bytes of the stream.

        Raises:
            MalformedDicom: the stream has ended, and more than ``MAX_TRAILING`` bytes
                follow it.
            RuntimeError: what was given before is not used up (a caller bug).
        """
        if not self.needs_input:
            raise RuntimeError("the bytes given before are not inflated yet")
        self._input, self._at = memoryview(data).cast("B"), 0
        self.given += len(self._input)
        if self.eof:
            self._past_end(self._input)
            self._at = len(self._input)

    def inflate(self, max_length: int) -> bytes:
        """At most ``max_length`` more bytes of the data set; ``b""`` when what was given
        is used up or the stream has ended.

        Raises:
            MalformedDicom: the stream is corrupt, or more than ``MAX_TRAILING`` bytes
                follow its end.
            ValueError: ``max_length`` is not positive.
        """
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        while not self.eof:
            if self._tail:
                piece: bytes | memoryview = self._tail
            elif self._at < len(self._input):
                piece = self._input[self._at : self._at + INPUT_PIECE]
                self._at += len(piece)
            else:
                return b""
            try:
                out = self._zlib.decompress(piece, max_length)
            except zlib.error as exc:  # zlib's message names the fault, never the data
                raise MalformedDicom(f"{NAME}: the deflate stream is corrupt ({exc})") from None
            self._tail = self._zlib.unconsumed_tail
            if self.eof:
                self._past_end(memoryview(self._zlib.unused_data))
                self._past_end(self._input[self._at :])
                self._at, self._tail = len(self._input), b""
            if out:
                self.inflated += len(out)
                return out
        return b""

    def finish(self) -> None:
        """The stored bytes have ended: the stream must have ended too.

        Raises:
            MalformedDicom: it has not (the object is cut inside the stream).
        """
        if not self.eof:
            raise MalformedDicom(
                f"{NAME}: truncated: the object ends inside the deflate stream"
                f" ({self.given} bytes of it given, {self.inflated} inflated)"
            )

    def _past_end(self, data: memoryview) -> None:
        self._after_end += len(data)
        if self._after_end > MAX_TRAILING:
            raise MalformedDicom(
                f"{NAME}: {self._after_end} bytes or more follow the end of the deflate"
                f" stream (at most {MAX_TRAILING} may: a pad byte, or a CRC-32 and length)"
            )


def inflated_header(
    prefix: bytes | bytearray,
    complete: bool,
    stored_bytes: int,
    *,
    max_header_bytes: int,
) -> DicomHeader | NeedMoreBytes:
    """The header of a Deflated object from its inflated data set's first bytes.

    ``complete``: ``prefix`` is the whole data set (the stream has ended).
    ``stored_bytes``: the size of the stored stream, which bounds what it can inflate to.
    The header's ``pixel_offset`` and ``NeedMoreBytes.at_least`` count from the data
    set's first byte; ``pixel_length`` is the Pixel Data element's length; ``codec``
    decodes the inflated frames (Deflated: ``conversions`` says ``inflate``).
    ``max_header_bytes`` bounds the data set presented (its meta included), as it
    bounds any header.

    Raises:
        MalformedDicom, UnsupportedDicom, NotDicom, LimitExceeded: what ``parse_header``
            raises of the data set, naming the syntax; file meta elements inside the
            data set; a header that declares more than ``stored_bytes`` can inflate to.
    """
    if len(prefix) >= 2 and prefix[:2] == b"\x02\x00":  # pydicom would take them for meta
        raise MalformedDicom(f"{NAME}: file meta elements (group 0002) in the deflated data set")
    data = META + prefix
    size = len(data) if complete else _UNKNOWN_SIZE
    try:
        parsed = parse_header(data, size, max_header_bytes=max_header_bytes, inflated=True)
    except (DicomError, LimitExceeded) as exc:  # offsets and sizes are the data presented's
        text = str(exc).removeprefix(f"{NAME}: ")
        where = f"the inflated data set, behind a {len(META)}-byte file meta"
        raise type(exc)(f"{NAME}: {where}: {text}") from exc
    if isinstance(parsed, NeedMoreBytes):
        return NeedMoreBytes(at_least=parsed.at_least - len(META))
    codec = parsed.codec
    assert codec is not None  # inflated=True: always decoded
    value = parsed.pixel_offset - len(META)
    pixels_end = value + -(-frame_bits(codec) * codec.number_of_frames // 8)
    most = MAX_INFLATE_RATIO * stored_bytes + 1024
    if pixels_end > most:
        raise MalformedDicom(
            f"{NAME}: the header puts the end of the Pixel Data at byte {pixels_end} of the"
            f" data set; its {stored_bytes}-byte deflate stream inflates to {most} at most"
        )
    return dataclasses.replace(parsed, pixel_offset=value)


def frame_bits(codec: Codec) -> int:
    """Bits of one stored native frame, as pydicom counts them (YBR_FULL_422: two
    samples a pixel)."""
    bits = codec.rows * codec.columns * codec.samples_per_pixel * codec.bits_allocated
    return bits * 2 // 3 if codec.photometric_interpretation == "YBR_FULL_422" else bits
