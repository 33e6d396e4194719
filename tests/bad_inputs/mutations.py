"""Hypothesis strategies that mutate valid objects (``mutated_object``, ``mutate``) and
compressed ones (``mutated_compressed``), and fixed lists of their mutants."""

from __future__ import annotations

import struct
from typing import Final

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.bad_inputs.bases import ct_small, encapsulated_large, large_base, small_base
from tests.bad_inputs.compressed import (
    OffsetChoice,
    _sof_at,
    codestream_header_end,
    compressed_bases,
    items_of,
)
from tests.bad_inputs.edits import edit, pixel_tag_at

# -- mutations of a valid object (hypothesis) ------------------------------------------

# single GET, single GET, ranged, ranged Encapsulated Uncompressed
MUTATION_BASES: Final = (small_base, ct_small, large_base, encapsulated_large)
MUTATION_KINDS: Final = ("flip", "set", "insert", "delete", "truncate")


@st.composite
def mutated_object(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with 1-4 byte flips, sets, insertions, deletions or a truncation.

    Half the positions fall in the header (up to the Pixel Data element header),
    where a change can mislead the parser; the rest is mostly Pixel Data.
    """
    data = bytearray(base)
    header_end = pixel_tag_at(base) + 12
    for _ in range(draw(st.integers(1, 4))):
        limit = draw(st.sampled_from([min(len(data), header_end), len(data)]))
        mutate(draw, data, draw(st.integers(0, limit)))
    return bytes(data)


def mutate(draw: st.DrawFn, data: bytearray, at: int) -> None:
    """One random edit of ``data`` at ``at``: a bit flip, a byte set, an insertion,
    a deletion or a truncation (``MUTATION_KINDS``)."""
    kind = draw(st.sampled_from(MUTATION_KINDS))
    if kind == "flip" and at < len(data):
        data[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "set" and at < len(data):
        data[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x20]))
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=12))
    elif kind == "delete":
        del data[at : at + draw(st.integers(1, 40))]
    elif kind == "truncate":
        del data[at:]


def mutations(per_base: int) -> list[bytes]:
    """Distinct mutants of each of ``MUTATION_BASES`` (up to ``per_base`` each), fixed per run.

    Hypothesis draws them (``derandomize``: the same examples every run, so a
    failure reproduces); the caller runs the whole list through one worker, so
    the worker starts once however many there are.
    """
    found: dict[bytes, None] = {}
    for make in MUTATION_BASES:
        base = make()

        @settings(
            max_examples=per_base,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(mutated_object(base))
        def collect(data: bytes) -> None:
            found[data] = None

        collect()
        found.pop(base, None)
    return list(found)


# -- mutations of compressed objects (hypothesis) --------------------------------------

_FIELD_VALUES: Final = (0, 1, 2, 3, 7, 8, 15, 16, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF)


def codestream_fields(frame: bytes) -> list[tuple[int, str]]:
    """(where, struct format) of the fields of a codestream's frame header that say what
    it decodes to: JPEG (-LS) SOF's precision, size, components and their sampling;
    JPEG 2000 SIZ's profile, sizes, offsets, tile sizes, components, their depth and
    subsampling, and COD's decomposition levels and code-block size; RLE's segment
    count and offsets."""
    if frame[:2] == b"\xff\xd8":
        at = _sof_at(frame)
        fields = [(at + 4, ">B"), (at + 5, ">H"), (at + 7, ">H"), (at + 9, ">B")]
        return fields + [
            (at + 11 + 3 * c, ">B") for c in range(frame[at + 9]) if at + 12 + 3 * c <= len(frame)
        ]
    if frame[:2] == b"\xff\x4f":
        fields = [(6, ">H"), *((8 + 4 * i, ">I") for i in range(8)), (40, ">H"), (42, ">B")]
        fields += [(43, ">B"), (44, ">B")]
        cod = frame.find(b"\xff\x52")
        if cod > 0 and cod + 12 <= len(frame):
            fields += [(cod + 9, ">B"), (cod + 10, ">B"), (cod + 11, ">B")]
        return fields
    return [(4 * i, "<I") for i in range(min(16, len(frame) // 4))]


class Mutant:
    """A mutated object, shown by what was done to which base (never its bytes)."""

    __slots__ = ("data", "how")

    def __init__(self, how: str, data: bytes) -> None:
        self.how, self.data = how, data

    def __repr__(self) -> str:
        return f"Mutant({self.how!r}, {len(self.data)} bytes)"


@st.composite
def mutated_compressed(draw: st.DrawFn) -> Mutant:
    """A compressed base (``compressed_bases``: every syntax, and both slides) with some of
    its offset tables, then one of: 1-4 edits (``mutate``) of a frame's codestream, half of
    them in its header; a frame header field set to an edge or any value; 1-4 edits of the
    encapsulated items (their headers, the tables, the delimiter); Number of Frames, Rows or
    Columns changed (Rows and Columns at most 1024, so a claim costs at most 2 MiB a frame)."""
    base = draw(st.sampled_from(compressed_bases()))
    offsets: OffsetChoice = draw(st.sampled_from(["basic", "extended", "none"]))
    frames = list(base.frames)
    how = draw(st.sampled_from(["codestream", "codestream", "field", "items", "header"]))
    said = f"{base.name}, {offsets} table, {how}"
    if how in ("codestream", "field"):
        k = draw(st.sampled_from(sorted({0, base.target, len(frames) - 1})))
        frame = bytearray(frames[k])
        if how == "field":
            at, fmt = draw(st.sampled_from(codestream_fields(bytes(frame))))
            top = 256 ** struct.calcsize(fmt) - 1
            value = draw(st.one_of(st.sampled_from(_FIELD_VALUES), st.integers(0, top)))
            struct.pack_into(fmt, frame, at, min(value, top))
            said += f" {at} of frame {k} = {min(value, top)}"
        else:
            end = codestream_header_end(bytes(frame))
            for _ in range(draw(st.integers(1, 4))):
                limit = draw(st.sampled_from([min(len(frame), end), len(frame)]))
                mutate(draw, frame, draw(st.integers(0, limit)))
            said += f" of frame {k}"
        frames[k] = bytes(frame)
        return Mutant(said, base.write(frames, offsets))
    data = base.write(frames, offsets)
    if how == "header":
        keyword = draw(st.sampled_from(["NumberOfFrames", "Rows", "Columns"]))
        top = 2**31 - 1 if keyword == "NumberOfFrames" else 1024
        value = draw(
            st.one_of(st.sampled_from([0, 1, 2, len(frames) + 1, top]), st.integers(0, top))
        )
        return Mutant(f"{said} {keyword} = {value}", edit(data, **{keyword: value}))
    found, delimiter = items_of(data)
    heads = [at for at, _ in found] + [delimiter]
    mutable = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            at = draw(st.sampled_from(heads)) + draw(st.integers(0, 11))
        else:
            at = draw(st.integers(heads[0], len(mutable)))
        mutate(draw, mutable, min(at, len(mutable)))
    return Mutant(said, bytes(mutable))


def compressed_mutations(count: int) -> list[bytes]:
    """Distinct ``mutated_compressed`` mutants (up to ``count``), the same every run."""
    found: dict[bytes, None] = {}

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_compressed())
    def collect(mutant: Mutant) -> None:
        found[mutant.data] = None

    collect()
    return list(found)
