"""Compressed objects of every syntax the worker decodes, broken: the bases, their
codestream, structure and syntax mutants, what must come of each (``compressed_cases``),
and ``decode_as_worker``, which decodes one in this process with the product's own
functions (``pixel_array``: what pydicom makes of it)."""

from __future__ import annotations

import copy
import functools
import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
from pydicom import dcmread
from pydicom.dataset import Dataset
from pydicom.encaps import generate_frames
from pydicom.uid import UID, JPEGBaseline8Bit, RLELossless

from ingest.dicom.codec import decode_encapsulated
from ingest.dicom.parse import DicomHeader
from ingest.dicom.syntaxes import is_compressed
from ingest.embedded.samples_compressed import CT_SYNTAXES, compressed_ct
from ingest.embedded.samples_slide import jpeg_slide_bytes, write_fragments
from ingest.errors import IngestError, LimitExceeded, MalformedDicom, UnsupportedDicom
from ingest.fetch.planning import ByteRange, first_read
from ingest.pipeline.decoded import compressed_frames, frame_groups
from ingest.pipeline.large import header_or_more
from ingest.pipeline.process import whole_header
from ingest.pipeline.streamed import frame_stream
from tests.bad_inputs.bases import MAX_HEADER_BYTES, PART_SIZE, BadObject
from tests.bad_inputs.edits import edit, patch_short, pixel_tag_at, set_u32

# Each base is a compressed object taken apart (header, one codestream a frame) and
# written back whole or with one thing changed: a frame's codestream (cut, zeroed,
# flipped, replaced, a frame header that lies), Number of Frames, the offset tables,
# the items or their delimiter, or the transfer syntax. The bases: three 64 x 64 CT
# slices in each of ``CT_SYNTAXES`` and a JPEG-tiled slide of 3 x 2 tiles of 64 (all
# one GET), and a slide of 6 x 5 tiles (~91 KB: the streamed path, which splits
# frames with ``FrameSplitter`` as ranges arrive). What must come of each
# (``_DECODES``, ``_REFUSED``, else MalformedDicom) was found by running them, and
# checked to be right: what cannot be decoded is refused; what decodes gives pydicom's
# values (not bad, then: processed). Known product bugs are in ``_BUGS``.

COMPRESSED_SIZE: Final = 64  # rows and columns of a compressed CT frame and a slide tile
OffsetChoice = Literal["basic", "extended", "none"]
Outcome = type[IngestError] | None  # None: decodes, to what pydicom's pixel_array gives
_ITEM_TAG: Final = b"\xfe\xff\x00\xe0"
_JPEG_SOF: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xF7}  # + JPEG-LS
_UNSUPPORTED: Final = (  # transfer syntaxes with pixel data the worker has no decoder for
    "1.2.840.10008.1.2.4.110",  # JPEG XL Lossless (pydicom 3.0 does not know its name)
    "1.2.840.10008.1.2.4.100",  # MPEG2 Main Profile / Main Level
    "1.2.840.10008.1.2.4.94",  # JPIP Referenced
    "1.2.840.10008.1.2.4.52",  # JPEG Extended (Process 3 and 5), retired
    "1.2.840.10008.1.2.4.107",  # HEVC/H.265 Main Profile
)


@dataclass(frozen=True)
class CompressedBase:
    """A compressed object taken apart: its header (no Pixel Data) and each frame's
    codestream, written back (``write``) with frames, tables or counts changed."""

    name: str
    syntax: str
    header: Dataset
    frames: tuple[bytes, ...]
    target: int  # the frame whose codestream a mutation changes

    def write(
        self, frames: Sequence[bytes] | None = None, offsets: OffsetChoice = "basic"
    ) -> bytes:
        """The object with ``frames`` (default: its own), one fragment each, and ``offsets``."""
        frames = self.frames if frames is None else frames
        ds = copy.deepcopy(self.header)
        ds.NumberOfFrames = len(frames)
        lengths = np.array([len(frame) for frame in frames], dtype=np.int64)
        out = BytesIO()
        write_fragments(out, ds, frames, lengths, offsets)
        return out.getvalue()

    def with_target(self, frame: bytes) -> bytes:
        """The object with its target frame's codestream replaced by ``frame``."""
        k = self.target
        return self.write([*self.frames[:k], frame, *self.frames[k + 1 :]])


def _taken_apart(data: bytes) -> tuple[Dataset, list[bytes]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        count = int(ds.get("NumberOfFrames") or 1)
        frames = [bytes(f) for f in generate_frames(ds.PixelData, number_of_frames=count)]
        del ds.PixelData
    return ds, frames


@functools.cache
def compressed_base(syntax: str) -> CompressedBase:
    """Three 64 x 64 CT slices (``compressed_ct``, slices 0-2) in ``syntax``; mutations
    change the middle one."""
    header, _ = _taken_apart(compressed_ct(syntax, 0, COMPRESSED_SIZE, COMPRESSED_SIZE))
    frames = tuple(
        _taken_apart(compressed_ct(syntax, k, COMPRESSED_SIZE, COMPRESSED_SIZE))[1][0]
        for k in range(3)
    )
    return CompressedBase(f"ct-{UID(syntax).keyword}", syntax, header, frames, target=1)


@functools.cache
def slide_base(ranged: bool) -> CompressedBase:
    """A JPEG baseline (YBR_FULL_422) slide of 64 x 64 tiles: 3 x 2 (~20 KB, one GET), or
    6 x 5 (~91 KB: ranged; mutations change tile 25, in the second range)."""
    across, down = (6, 5) if ranged else (3, 2)
    data = jpeg_slide_bytes(
        tiles_across=across, tiles_down=down, tile=COMPRESSED_SIZE, distinct=across * down
    )
    header, frames = _taken_apart(data)
    name = "ranged-slide" if ranged else "slide"
    return CompressedBase(name, JPEGBaseline8Bit, header, tuple(frames), 25 if ranged else 1)


def compressed_bases() -> list[CompressedBase]:
    """One base a syntax of ``CT_SYNTAXES``, then the two slides."""
    return [*(compressed_base(s) for s in CT_SYNTAXES), slide_base(False), slide_base(True)]


def items_of(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(where, length) of each item of the encapsulated Pixel Data (the Basic Offset Table
    first), and where the Sequence Delimiter is."""
    at, found = pixel_tag_at(data) + 12, []
    while data[at : at + 4] == _ITEM_TAG:
        length = int(struct.unpack_from("<I", data, at + 4)[0])
        found.append((at, length))
        at += 8 + length
    return found, at


def meta_syntax(data: bytes) -> str:
    """The Transfer Syntax UID in ``data``'s file meta."""
    at = data.index(b"\x02\x00\x10\x00UI", 132)
    length = struct.unpack_from("<H", data, at + 6)[0]
    return data[at + 8 : at + 8 + length].rstrip(b"\0 ").decode()


def relabelled(data: bytes, syntax: str) -> bytes:
    """``data`` with its file meta's Transfer Syntax UID replaced (group length fixed)."""
    value = syntax.encode() + b"\0" * (len(syntax) % 2)
    at = data.index(b"\x02\x00\x10\x00UI", 132)
    old = struct.unpack_from("<H", data, at + 6)[0]
    out = data[: at + 6] + struct.pack("<H", len(value)) + value + data[at + 8 + old :]
    group = struct.unpack_from("<I", out, 140)[0]  # (0002,0000)'s value
    return set_u32(out, 140, group + len(value) - old)


def codestream_header_end(frame: bytes) -> int:
    """Where a frame's codestream header ends: JPEG (-LS) at its first scan's data, JPEG 2000
    at its first tile-part, RLE after its 64-byte header."""
    if frame[:2] == b"\xff\xd8":
        at = 2
        while at + 4 <= len(frame) and frame[at] == 0xFF:
            length = int(struct.unpack_from(">H", frame, at + 2)[0])
            if frame[at + 1] == 0xDA:
                return min(at + 2 + length, len(frame))
            at += 2 + length
        return min(at, len(frame))
    if frame[:2] == b"\xff\x4f":
        at = frame.find(b"\xff\x90")
        return at if at > 0 else len(frame)
    return min(64, len(frame))


def _sof_at(frame: bytes) -> int:
    """Where a JPEG (-LS) frame's SOF marker segment is."""
    at = 2
    while at + 4 <= len(frame) and frame[at] == 0xFF:
        if frame[at + 1] in _JPEG_SOF:
            return at
        at += 2 + struct.unpack_from(">H", frame, at + 2)[0]
    raise ValueError("no SOF marker segment")


def claims_size(frame: bytes, rows: int, columns: int) -> bytes | None:
    """The codestream with its frame header saying ``rows`` x ``columns`` (JPEG's SOF,
    JPEG 2000's SIZ with no image offset); None for RLE, which has no size to state."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame)
        return frame[: at + 5] + struct.pack(">HH", rows, columns) + frame[at + 9 :]
    if frame[:2] == b"\xff\x4f":  # SOC, SIZ: Lsiz, Rsiz, then Xsiz, Ysiz, XOsiz, YOsiz
        return frame[:8] + struct.pack(">IIII", columns, rows, 0, 0) + frame[24:]
    return None


def claims_components(frame: bytes) -> bytes:
    """The codestream claiming one component more than it has (RLE: a first segment
    starting past the frame's end)."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame) + 9
        return frame[:at] + bytes([frame[at] + 1]) + frame[at + 1 :]
    if frame[:2] == b"\xff\x4f":  # Csiz at 40
        count = struct.unpack_from(">H", frame, 40)[0]
        return frame[:40] + struct.pack(">H", count + 1) + frame[42:]
    return frame[:4] + struct.pack("<I", 0x7FFFFFF0) + frame[8:]


def claims_precision(frame: bytes) -> bytes:
    """The codestream claiming another sample precision: JPEG 16 bits (the CT's are 12,
    the slide's 8), JPEG 2000 unsigned samples (the CT's are signed); RLE 15 segments."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame) + 4
        return frame[:at] + b"\x10" + frame[at + 1 :]
    if frame[:2] == b"\xff\x4f":  # Ssiz of the first component at 42: bit 7 the sign
        return frame[:42] + bytes([frame[42] & 0x7F]) + frame[43:]
    return struct.pack("<I", 15) + frame[4:]


def _codestream_mutants(b: CompressedBase) -> Iterator[tuple[str, str, bytes]]:
    frame = b.frames[b.target]
    third = len(frame) // 3
    zeroed = frame[:third] + bytes(third) + frame[2 * third :]
    flipped = bytearray(frame)
    for at in range(len(frame) // 4, 3 * len(frame) // 4, 37):
        flipped[at] ^= 0x10
    noise = np.random.default_rng(len(frame)).bytes(len(frame))
    yield "codestream-cut", "corrupt", b.with_target(frame[: len(frame) // 2])
    yield "codestream-zeroed", "corrupt", b.with_target(zeroed)
    yield "codestream-flipped", "corrupt", b.with_target(bytes(flipped))
    yield "codestream-random", "corrupt", b.with_target(noise)
    yield "codestream-header-only", "corrupt", b.with_target(frame[: codestream_header_end(frame)])
    size = COMPRESSED_SIZE
    claims = (
        ("claims-larger", 65535, 65535),
        ("claims-smaller", 32, 32),
        ("claims-height-0", 0, size),
    )
    for name, rows, columns in claims:
        changed = claims_size(frame, rows, columns)
        if changed is not None:
            yield name, "claims", b.with_target(changed)
    yield "claims-components", "claims", b.with_target(claims_components(frame))
    yield "claims-precision", "claims", b.with_target(claims_precision(frame))
    # the DICOM header claims frames of 12288 x 12288 (288 MiB or more decoded each)
    yield "header-claims-larger", "claims", edit(b.write(), Rows=12288, Columns=12288)


def _structure_mutants(b: CompressedBase) -> Iterator[tuple[str, str, bytes]]:
    n, k = len(b.frames), b.target
    good = b.write()
    items, delimiter = items_of(good)
    tables: tuple[OffsetChoice, ...] = ("basic", "extended", "none")
    for table_kind in tables:
        data = b.write(offsets=table_kind)
        yield f"frames-more-{table_kind}", "frame-count", edit(data, NumberOfFrames=n + 1)
        yield f"frames-fewer-{table_kind}", "frame-count", edit(data, NumberOfFrames=n - 1)
    one = b.write(b.frames[:1])
    yield "one-frame-claims-2", "frame-count", edit(one, NumberOfFrames=2)
    yield "frames-1e12", "frame-count", patch_short(good, 0x00280008, b"999999999999")
    table = items[0][0] + 8
    offsets = struct.unpack_from(f"<{n}I", good, table)
    yield "bot-mid-item", "offset-table", set_u32(good, table + 4 * k, offsets[k] + 2)
    yield "bot-past-end", "offset-table", set_u32(good, table + 4 * (n - 1), 0x7FFFFFF0)
    swapped = set_u32(set_u32(good, table + 4 * k, offsets[k + 1]), table + 4 * (k + 1), offsets[k])
    yield "bot-swapped", "offset-table", swapped
    yield "bot-not-rising", "offset-table", set_u32(good, table + 4 * (k + 1), offsets[k])
    yield "bot-not-from-zero", "offset-table", set_u32(good, table, 8)
    yield "bot-odd-length", "offset-table", set_u32(good, table - 4, 4 * n - 2)
    eot = b.write(offsets="extended")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(eot))
    starts = np.frombuffer(ds.ExtendedOffsetTable, "<u8").copy()
    lengths = np.frombuffer(ds.ExtendedOffsetTableLengths, "<u8").copy()

    def eot_with(name: str, at: int, value: int, table: str = "offsets") -> tuple[str, str, bytes]:
        changed = (starts if table == "offsets" else lengths).copy()
        changed[at] = value
        field = "ExtendedOffsetTable" if table == "offsets" else "ExtendedOffsetTableLengths"
        return name, "extended-offset-table", edit(eot, **{field: changed.tobytes()})

    yield eot_with("eot-mid-item", k, int(starts[k]) + 2)
    yield eot_with("eot-not-rising", k, int(starts[k + 1]))
    yield eot_with("eot-past-end", n - 1, 2**40)
    yield eot_with("eot-length-past-item", k, int(lengths[k]) + 100, "lengths")
    yield eot_with("eot-length-short", k, int(lengths[k]) // 2, "lengths")
    yield eot_with("eot-length-huge", k, 2**40, "lengths")
    fewer = {"ExtendedOffsetTable": starts[:-1].tobytes()}
    fewer["ExtendedOffsetTableLengths"] = lengths[:-1].tobytes()
    yield "eot-too-few", "extended-offset-table", edit(eot, **fewer)
    # (an Extended Offset Table without its lengths is left out: the worker ignores
    # the table, pydicom's pixel_array fails on it, so there is nothing to compare)
    at, length = items[1 + k]
    yield "object-cut-mid-frame", "delimiter", good[: at + 8 + length // 2]
    yield "cut-before-delimiter", "delimiter", good[:delimiter]
    yield "no-delimiter", "delimiter", good[:delimiter] + bytes(8) + good[delimiter + 8 :]
    yield "item-tag-is-delimitation", "item", good[:at] + b"\xfe\xff\x0d\xe0" + good[at + 4 :]
    yield "item-tag-is-pixel-data", "item", good[:at] + b"\xe0\x7f\x10\x00" + good[at + 4 :]
    yield "item-undefined-length", "item", set_u32(good, at + 4, 0xFFFFFFFF)
    yield "item-length-past-end", "item", set_u32(good, at + 4, 0x7FFFFFF0)
    empty = struct.pack("<HHI", 0xFFFE, 0xE000, 0)
    yield "empty-fragment-frame", "empty-fragment", b.with_target(b"")
    empty_tables: tuple[OffsetChoice, ...] = ("none", "basic")
    for table_kind in empty_tables:
        data = b.write(offsets=table_kind)
        found, end = items_of(data)
        first = found[1][0]
        yield (
            f"empty-fragment-first-{table_kind}",
            "empty-fragment",
            data[:first] + empty + data[first:],
        )
        yield (
            f"empty-fragment-extra-{table_kind}",
            "empty-fragment",
            data[:end] + empty + data[end:],
        )


def _syntax_mutants(b: CompressedBase, index: int) -> Iterator[tuple[str, str, bytes]]:
    good = b.write()
    yield (
        "labelled-unsupported",
        "syntax",
        relabelled(good, _UNSUPPORTED[index % len(_UNSUPPORTED)]),
    )
    other: dict[str, str] = {
        RLELossless: "1.2.840.10008.1.2.4.80",  # RLE segments read as JPEG-LS
        **dict.fromkeys((*CT_SYNTAXES[1:4], JPEGBaseline8Bit), "1.2.840.10008.1.2.4.90"),
        **dict.fromkeys(CT_SYNTAXES[4:6], RLELossless),
        **dict.fromkeys(CT_SYNTAXES[6:], "1.2.840.10008.1.2.4.57"),
    }
    yield "labelled-other-codec", "syntax", relabelled(good, other[b.syntax])


_CT: Final = tuple(f"ct-{UID(syntax).keyword}" for syntax in CT_SYNTAXES)
_RLE, _SV1, _LOSSLESS, _EXTENDED, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, *_HTJ2K = _CT
_SINGLE: Final = frozenset({*_CT, "slide"})  # the bases that fit one GET
# (base, mutation) pairs that decode, where pydicom's pixel_array decodes them alike;
# every other mutant is refused, MalformedDicom unless ``_REFUSED`` says otherwise
_DECODES: Final[dict[str, frozenset[str]]] = {
    "codestream-zeroed": frozenset(
        {_SV1, _LOSSLESS, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, "slide", "ranged-slide"}
    ),
    "codestream-flipped": frozenset(
        {_RLE, _SV1, _LOSSLESS, _EXTENDED, _JLS, _JLS_NEAR, _J2K, _J2K_LOSSY, "ranged-slide"}
    ),
    "claims-precision": frozenset(_CT) - {_EXTENDED},  # RLE: 15 segments, 2 of them read
    "bot-not-rising": _SINGLE,  # pydicom's frames: the fragments between the offsets
    "bot-not-from-zero": _SINGLE,
    "eot-not-rising": frozenset({_RLE, _LOSSLESS, *_HTJ2K, "slide"}),  # frame 2's stream
    "eot-length-past-item": frozenset({_RLE}),  # the length is cut at the item's end
    "eot-length-huge": frozenset({_RLE, _SV1, _LOSSLESS, _JLS, _HTJ2K[2]}),
    "empty-fragment-first-basic": _SINGLE,
    # RLE has no end marker to end a frame at
    "empty-fragment-first-none": _SINGLE - {_RLE} | {"ranged-slide"},
    "empty-fragment-extra-basic": _SINGLE | {"ranged-slide"},
}
_REFUSED: Final[dict[tuple[str, str], type[IngestError]]] = {
    **{(base, "labelled-unsupported"): UnsupportedDicom for base in (*_SINGLE, "ranged-slide")},
    ("ranged-slide", "eot-length-huge"): LimitExceeded,  # a frame over the splitter's bound
    ("ranged-slide", "item-length-past-end"): LimitExceeded,
    **{(b, "header-claims-larger"): LimitExceeded for b in (*_SINGLE, "ranged-slide")},
}
# Where the worker's output differs from pixel_array on purpose: xfail(strict) in the tests
# and left out of the worker run. The worker decodes each frame as its own codestream says
# (pydicom's pixel_array(ds, index=k)); pydicom's whole-object decode carries state.
BUG_FRAME_STATE: Final = (
    "frames decode one by one, pydicom's pixel_array carries state from frame to frame"
    " (the last codestream's precision / signedness for every frame; after a frame only"
    " another plugin decodes, the following frames by that plugin): the arrays differ"
)
# a JPEG or JPEG-LS frame height of 0 once made libjpeg and CharLS grow memory until it ran
# out: these mutants decode in a process of their own, under an address-space limit
ISOLATED_MUTATIONS: Final = frozenset({"claims-height-0"})
_BUGS: Final = {
    **{(b, "claims-precision"): BUG_FRAME_STATE for b in (_JLS, _JLS_NEAR, _J2K, _J2K_LOSSY)},
    ("ranged-slide", "codestream-flipped"): BUG_FRAME_STATE,  # tiles 26-29 by Pillow
}


@dataclass(frozen=True, slots=True)
class CompressedCase:
    """A mutant of a compressed base and what must come of it (``error`` None: it decodes,
    to what pydicom's ``pixel_array`` gives)."""

    base: str
    mutation: str
    kind: str  # the mutation's family
    syntax: str
    data: bytes
    error: Outcome
    bug: str | None = None  # a known product bug: xfail(strict), not in the worker run

    @property
    def name(self) -> str:
        return f"{self.base}-{self.mutation}"


@functools.cache
def compressed_cases() -> tuple[CompressedCase, ...]:
    """Every mutant of every compressed base, in a fixed order; names are unique."""
    cases = []
    for index, base in enumerate(compressed_bases()):
        mutants = [
            *_codestream_mutants(base),
            *_structure_mutants(base),
            *_syntax_mutants(base, index),
        ]
        for mutation, kind, data in mutants:
            key = (base.name, mutation)
            bug = _BUGS.get(key)
            error: Outcome = _REFUSED.get(key, MalformedDicom)
            if base.name in _DECODES.get(mutation, ()):
                error = None
            syntax = meta_syntax(data)
            cases.append(CompressedCase(base.name, mutation, kind, syntax, data, error, bug))
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), "compressed case names must be unique"
    return tuple(cases)


def _compressed() -> Iterator[BadObject]:
    for case in compressed_cases():
        if case.error is not None and case.bug is None:
            yield BadObject(
                case.name,
                f"compressed-{case.kind}",
                case.data,
                case.error,
                case.syntax,
            )


def decode_as_worker(data: bytes) -> npt.NDArray[Any] | None:
    """What the worker's decode stage makes of a compressed object, in this process; None
    when the object is not compressed.

    The worker's own functions on the object's bytes, read from memory instead of S3:
    the first GET (``first_read``) holds an object of at most ``PART_SIZE`` whole
    (``whole_header``, ``compressed_frames``); a larger one is a header probe, grown
    while the parser asks (``header_or_more``), then its Pixel Data in ranges
    (``frame_stream``). Frames decode in the worker's groups (``frame_groups``), on
    the CPU.

    Raises:
        IngestError: what the worker would dead-letter the object with.
    """
    view, size = memoryview(data), len(data)
    first = first_read(size, PART_SIZE, MAX_HEADER_BYTES)
    frames: list[bytes | memoryview]
    if first.end == size:
        header = whole_header(view, MAX_HEADER_BYTES)
        if not _compressed_syntax(header):
            return None
        value = view[header.pixel_offset : header.pixel_offset + header.pixel_length]
        frames = list(compressed_frames(header, value))
    else:
        layout = header_or_more(view[: first.end], size, MAX_HEADER_BYTES)
        while isinstance(layout, ByteRange):
            layout = header_or_more(view[: layout.end], size, MAX_HEADER_BYTES)
        header = layout
        if not _compressed_syntax(header):
            return None
        stream = frame_stream(header, size, PART_SIZE)
        frames = [f for r in stream.ranges for f in stream.feed(view[r.start : r.end])]
        frames += stream.finish()
    codec = header.codec
    assert codec is not None
    groups = [
        decode_encapsulated(codec, [bytes(f) for f in frames[group.start : group.stop]])
        for group in frame_groups(header)
    ]
    return np.concatenate(groups)


def _compressed_syntax(header: DicomHeader) -> bool:
    codec = header.codec
    return codec is not None and is_compressed(codec.transfer_syntax_uid)


def pixel_array(data: bytes) -> npt.NDArray[Any]:
    """pydicom's ``pixel_array`` of ``data`` (palette and LUTs not applied), one axis a frame."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        arr: npt.NDArray[Any] = ds.pixel_array
    frames = int(ds.get("NumberOfFrames") or 1)
    return arr.reshape(frames, *arr.shape[-3 + (ds.SamplesPerPixel == 1) :])
