"""The transfer syntaxes the worker reads, and what each needs.

Native little endian Pixel Data (Implicit, Explicit, Encapsulated Uncompressed)
goes to the device straight from the ring. Every other syntax here is decoded
first, by pydicom's decoders (``ingest/dicom/codec.py``): the compressed ones
frame by frame from their fragments, big endian from its native bytes.
Deflated Explicit VR Little Endian is not read from its stored bytes: its data
set is inflated first (``ingest/dicom/deflate.py``), then its native Pixel Data
decoded as big endian's is. A syntax not listed (video, JPIP references,
deflated image frames) is refused with its name.
"""

from __future__ import annotations

from typing import Final

IMPLICIT_VR_LE: Final = "1.2.840.10008.1.2"
EXPLICIT_VR_LE: Final = "1.2.840.10008.1.2.1"
ENCAPSULATED_UNCOMPRESSED: Final = "1.2.840.10008.1.2.1.98"
DEFLATED_LE: Final = "1.2.840.10008.1.2.1.99"
EXPLICIT_VR_BE: Final = "1.2.840.10008.1.2.2"

# Pixel Data the device takes as it is stored (no decode)
NATIVE_LE: Final = frozenset({IMPLICIT_VR_LE, EXPLICIT_VR_LE, ENCAPSULATED_UNCOMPRESSED})

# Encapsulated (fragments), decoded frame by frame: UID -> short codec name
COMPRESSED: Final = {
    "1.2.840.10008.1.2.5": "rle",
    "1.2.840.10008.1.2.4.50": "jpeg-baseline",
    "1.2.840.10008.1.2.4.51": "jpeg-extended",
    "1.2.840.10008.1.2.4.57": "jpeg-lossless",
    "1.2.840.10008.1.2.4.70": "jpeg-lossless-sv1",
    "1.2.840.10008.1.2.4.80": "jpeg-ls",
    "1.2.840.10008.1.2.4.81": "jpeg-ls-near-lossless",
    "1.2.840.10008.1.2.4.90": "jpeg2000-lossless",
    "1.2.840.10008.1.2.4.91": "jpeg2000",
    "1.2.840.10008.1.2.4.201": "htj2k-lossless",
    "1.2.840.10008.1.2.4.202": "htj2k-lossless-rpcl",
    "1.2.840.10008.1.2.4.203": "htj2k",
}

# Everything the header reader reads from stored bytes (Deflated: once inflated)
READABLE: Final = NATIVE_LE | {EXPLICIT_VR_BE} | frozenset(COMPRESSED)


def is_compressed(uid: str) -> bool:
    return uid in COMPRESSED
