"""Deflated Explicit VR Little Endian objects: a writer, the good ones the worker must
process, and the bad ones it must refuse (``deflated_cases``)."""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np

from ingest.errors import LimitExceeded, MalformedDicom
from tests.bad_inputs.bases import MIB, BadObject, ct_small, large_base
from tests.bad_inputs.edits import edit, pixel_tag_at, private_ob, set_pixel_length

# Deflated Explicit VR Little Endian: the data set after the file meta is one raw deflate
# stream (``deflate_file`` writes one as pydicom does, from pieces, so a data set of
# hundreds of MiB of zeros is never held). The worker reads such an object in order and
# inflates it a step at a time (``ingest/pipeline/inflated.py``); these are what it must
# refuse, naming the syntax, in bounded memory and time, and what it must process.

DEFLATED: Final = "1.2.840.10008.1.2.1.99"
BOMB_BYTES: Final = 64 * MIB  # zeros inflated from ~65 KB
_ZEROS: Final = bytes(MIB)


def zeros(size: int) -> Iterator[bytes]:
    """``size`` zero bytes, a MiB at a time (the same MiB object each time)."""
    whole, rest = divmod(size, MIB)
    for _ in range(whole):
        yield _ZEROS
    if rest:
        yield bytes(rest)


def meta_end(data: bytes) -> int:
    """Where the data set starts: after the file meta, by its Group Length (0002,0000)."""
    return 144 + int(struct.unpack_from("<I", data, 140)[0])


def deflate_file(data: bytes, data_set: Sequence[bytes] | Iterator[bytes] | None = None) -> bytes:
    """``data`` (Explicit VR Little Endian, with a file meta Group Length) as Deflated
    Explicit VR Little Endian: its file meta naming that syntax, then the raw deflate
    stream of its data set (or of ``data_set``, deflated piece by piece), padded to even
    as pydicom pads it."""
    end = meta_end(data)
    meta = data[132:end]
    at = meta.index(b"\x02\x00\x10\x00UI")
    old = struct.unpack_from("<H", meta, at + 6)[0]
    uid = DEFLATED.encode()  # 22 bytes: even
    meta = meta[: at + 6] + struct.pack("<H", len(uid)) + uid + meta[at + 8 + old :]
    meta = meta[:8] + struct.pack("<I", len(meta) - 12) + meta[12:]
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    stream = bytearray()
    for piece in [data[end:]] if data_set is None else data_set:
        stream += deflater.compress(piece)
    stream += deflater.flush()
    if len(stream) % 2:
        stream += b"\0"
    return data[:132] + meta + bytes(stream)


def noisy_large() -> bytes:
    """``large_base`` with random 16-bit samples (Bits Stored 12: pydicom masks them): ~300
    KB that deflate barely shrinks, so the Deflated object is read in ranges."""
    data = large_base()
    value = pixel_tag_at(data) + 12
    length = int(struct.unpack_from("<I", data, value - 4)[0])
    noise = np.random.default_rng(99).bytes(length)
    return data[:value] + noise + data[value + length :]


def _first_failing_flip(data: bytes, start: int) -> bytes:
    """``data`` with one stream byte inverted, the first from ``start`` on that zlib refuses."""
    body = meta_end(data)
    for at in range(start, len(data)):
        flipped = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        try:
            zlib.decompress(flipped[body:], -zlib.MAX_WBITS)
        except zlib.error:
            return flipped
    raise AssertionError("no flip that zlib refuses")


@functools.cache
def deflated_goods() -> tuple[tuple[str, bytes], ...]:
    """Deflated objects that must be processed: one GET and ranged, and one whose 64 MiB
    of trailing padding inflates from ~65 KB (inflated, thrown away, in bounded memory)."""
    ct, noisy = ct_small(), noisy_large()
    trailer = struct.pack("<HH2sHI", 0xFFFC, 0xFFFC, b"OB", 0, BOMB_BYTES)
    padded_bomb = deflate_file(ct, [ct[meta_end(ct) :], trailer, *zeros(BOMB_BYTES)])
    return (
        ("ct-small", deflate_file(ct)),
        ("ranged-multiframe-noise", deflate_file(noisy)),
        ("multiframe-per-frame-rescale", deflate_file(large_base())),
        ("padding-bomb", padded_bomb),
    )


@functools.cache
def deflated_cases() -> tuple[BadObject, ...]:
    """Deflated objects the worker must refuse, naming the syntax: cut, corrupt, trailed by
    garbage, bombs (a header that inflates past ``MAX_HEADER_BYTES``, Pixel Data that the
    stored stream could never inflate to), a data set that ends inside its Pixel Data or
    before its Pixel Data element's length, file meta elements inside the data set."""
    ct, noisy = ct_small(), noisy_large()
    small, big = deflate_file(ct), deflate_file(noisy)
    body = meta_end(small)
    at, value = pixel_tag_at(ct), pixel_tag_at(ct) + 12
    block = small[body] | 0b110  # BTYPE 11: a reserved block type
    header_bomb = [ct[meta_end(ct) : at], private_ob(0)[:-8]]  # the creator; then its OB
    header_bomb += [struct.pack("<HH2sHI", 0x0099, 0x1000, b"OB", 0, BOMB_BYTES)]
    header_bomb += [*zeros(BOMB_BYTES), ct[at:]]
    frames = 100_000  # 2.46 GB of Pixel Data declared, its element's length agreeing
    lying = edit(noisy, NumberOfFrames=frames, PerFrameFunctionalGroupsSequence=None)
    lying = set_pixel_length(lying, frames * 128 * 96 * 2)
    cases = [
        ("deflated-cut-in-stream", small[: len(small) // 2]),
        ("deflated-cut-in-header", small[: body + 200]),
        ("ranged-deflated-cut-in-stream", big[: len(big) * 2 // 3]),
        ("deflated-corrupt-block-type", small[:body] + bytes([block]) + small[body + 1 :]),
        ("deflated-corrupt-mid-stream", _first_failing_flip(small, len(small) // 3)),
        ("ranged-deflated-corrupt", _first_failing_flip(big, len(big) // 2)),
        ("deflated-trailing-garbage", small + b"trailing garbage after the stream!"),
        ("deflated-data-set-cut-in-pixels", deflate_file(ct[: value + 1000])),
        ("ranged-deflated-data-set-cut-in-pixels", deflate_file(noisy[:200_000])),
        ("ranged-deflated-pixel-length-past-end", deflate_file(set_pixel_length(noisy, 400_000))),
        ("deflated-meta-in-data-set", deflate_file(ct, [ct[144:body], ct[body:]])),
        ("deflated-declares-2-gb", deflate_file(lying)),
    ]
    out = [BadObject(name, "deflated", data, MalformedDicom, DEFLATED) for name, data in cases]
    # the object ends where its file meta does: the parser finds that before the syntax
    out.append(BadObject("deflated-cut-after-meta", "deflated", small[:body], MalformedDicom))
    bomb = deflate_file(ct, header_bomb)
    out.append(BadObject("deflated-header-bomb", "deflated", bomb, LimitExceeded, DEFLATED))
    return tuple(out)
