"""The transfer syntaxes the worker reads: one row each, with everything the worker
needs to know of it.

Native little endian Pixel Data (Implicit, Explicit, Encapsulated Uncompressed)
goes to the device straight from the ring. Every other syntax here is decoded
first, by pydicom's decoders (``ingest/dicom/codec.py``): the compressed ones
frame by frame from their fragments, big endian from its native bytes.
Deflated Explicit VR Little Endian is not read from its stored bytes: its data
set is inflated first (``ingest/dicom/deflate.py``), then its native Pixel Data
decoded as big endian's is. A syntax not listed (video, JPIP references,
deflated image frames, JPEG 2000 Part 2) is refused with its name.

The UIDs, their names for messages (``UID.name``), and whether Pixel Data is
encapsulated or the data set deflated are pydicom's (``pydicom.uid``); what the
worker does with each is this table's. Every other module's set of syntaxes is
derived from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

# pydicom 3.0 has no constant for it (DICOM 2023c)
EncapsulatedUncompressedExplicitVRLittleEndian: Final = UID("1.2.840.10008.1.2.1.98")

# What a frame of the syntax is: native samples, or a codestream of one of these codecs
Family = Literal["native", "rle", "jpeg", "jpeg-ls", "jpeg2000", "htj2k"]


@dataclass(frozen=True, slots=True)
class Syntax:
    """One transfer syntax the worker reads, and how."""

    uid: UID
    # short name: the sidecar's ``decode:NAME`` (a compressed syntax's), the sample
    # files' and the bench's names
    name: str
    family: Family
    # the decoded values are the encoded ones (a lossy syntax may also hold lossless data)
    lossless: bool
    # nvImageCodec's frames are pydicom's (exact; a lossy one within the lossy bound):
    # ``ingest/dicom/device_codecs.py`` says how it was checked and what else decides
    device: bool = False
    # the pydicom plugin tried first (a faster one than pydicom's first choice, with the
    # same values); "": pydicom's own order
    plugin: str = ""
    # the syntax whose pydicom decoder decodes a frame; None: this one's
    decoder: UID | None = None

    @property
    def compressed(self) -> bool:
        """Frames are codestreams, decoded one by one from their fragments."""
        return self.family != "native"

    @property
    def encapsulated(self) -> bool:
        """Pixel Data is a sequence of fragments (pydicom's ``UID.is_encapsulated``)."""
        return bool(self.uid.is_encapsulated)

    @property
    def deflated(self) -> bool:
        """The data set is one deflate stream, inflated before it is read."""
        return bool(self.uid.is_deflated)

    @property
    def as_stored(self) -> bool:
        """The device takes the Pixel Data as it is stored: native little endian samples."""
        return not self.compressed and self.uid.is_little_endian and not self.deflated

    @property
    def decoder_uid(self) -> UID:
        """The syntax of the pydicom decoder that decodes one frame."""
        return self.decoder or self.uid


SYNTAXES: Final[Mapping[str, Syntax]] = {
    s.uid: s
    for s in (
        Syntax(ImplicitVRLittleEndian, "implicit-vr-little-endian", "native", True),
        Syntax(ExplicitVRLittleEndian, "explicit-vr-little-endian", "native", True),
        # a frame a fragment, each one frame of Explicit VR Little Endian samples
        Syntax(
            EncapsulatedUncompressedExplicitVRLittleEndian,
            "encapsulated-uncompressed",
            "native",
            True,
            decoder=ExplicitVRLittleEndian,
        ),
        Syntax(DeflatedExplicitVRLittleEndian, "deflated", "native", True),
        Syntax(ExplicitVRBigEndian, "explicit-vr-big-endian", "native", True),
        # pylibjpeg-rle is several times faster than pydicom's own decoder, its first choice
        Syntax(RLELossless, "rle", "rle", True, plugin="pylibjpeg"),
        Syntax(JPEGBaseline8Bit, "jpeg-baseline", "jpeg", False, device=True),
        Syntax(JPEGExtended12Bit, "jpeg-extended", "jpeg", False),
        Syntax(JPEGLossless, "jpeg-lossless", "jpeg", True),
        Syntax(JPEGLosslessSV1, "jpeg-lossless-sv1", "jpeg", True),
        # pyjpegls (CharLS) is several times faster than pylibjpeg's libjpeg, pydicom's
        # first choice; near-lossless decodes to the same values in both
        Syntax(JPEGLSLossless, "jpeg-ls", "jpeg-ls", True, plugin="pyjpegls"),
        Syntax(JPEGLSNearLossless, "jpeg-ls-near-lossless", "jpeg-ls", False, plugin="pyjpegls"),
        Syntax(JPEG2000Lossless, "jpeg2000-lossless", "jpeg2000", True, device=True),
        Syntax(JPEG2000, "jpeg2000", "jpeg2000", False, device=True),
        Syntax(HTJ2KLossless, "htj2k-lossless", "htj2k", True, device=True),
        Syntax(HTJ2KLosslessRPCL, "htj2k-lossless-rpcl", "htj2k", True, device=True),
        Syntax(HTJ2K, "htj2k", "htj2k", False),
    )
}

IMPLICIT_VR_LE: Final = ImplicitVRLittleEndian
EXPLICIT_VR_LE: Final = ExplicitVRLittleEndian
ENCAPSULATED_UNCOMPRESSED: Final = EncapsulatedUncompressedExplicitVRLittleEndian
DEFLATED_LE: Final = DeflatedExplicitVRLittleEndian
EXPLICIT_VR_BE: Final = ExplicitVRBigEndian

# Pixel Data the device takes as it is stored (no decode)
NATIVE_LE: Final = frozenset(uid for uid, s in SYNTAXES.items() if s.as_stored)
# Encapsulated codestreams, decoded frame by frame: UID -> short name
COMPRESSED: Final = {uid: s.name for uid, s in SYNTAXES.items() if s.compressed}
# Pixel Data as samples rather than fragments (Deflated: once inflated)
NATIVE: Final = frozenset(uid for uid, s in SYNTAXES.items() if not s.encapsulated)
# Everything the header reader reads from stored bytes (Deflated: once inflated)
READABLE: Final = frozenset(uid for uid, s in SYNTAXES.items() if not s.deflated)
# Frames whose codestream has JPEG's markers (JPEG, JPEG-LS), or JPEG 2000's (and HTJ2K's)
JPEG_CODESTREAMS: Final = frozenset(
    uid for uid, s in SYNTAXES.items() if s.family in ("jpeg", "jpeg-ls")
)
J2K_CODESTREAMS: Final = frozenset(
    uid for uid, s in SYNTAXES.items() if s.family in ("jpeg2000", "htj2k")
)
LOSSLESS: Final = frozenset(uid for uid, s in SYNTAXES.items() if s.lossless)


def is_compressed(uid: str) -> bool:
    return uid in COMPRESSED
