"""Encapsulated Pixel Data split as it streams (``ingest.dicom.encapsulated``), against pydicom.

The reference is ``pydicom.encaps.generate_frames`` given the whole value at once.
Values are built by pydicom's own ``encapsulate``/``encapsulate_extended``, from
random bytes and from the codestreams of pydicom's sample files, fed in random
pieces (item headers split anywhere), and mutated. The property throughout:
where the splitter finishes, pydicom took the same bytes without an error or a
warning and gave the same frames, Number of Frames of them; where it refuses, it
raises ``MalformedDicom`` or ``LimitExceeded``, and the frames it gave before
agree with pydicom's.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import cycle, pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydicom import dcmread
from pydicom.data import get_testdata_file
from pydicom.encaps import encapsulate, encapsulate_extended, generate_frames

from ingest.dicom.encapsulated import ITEM_HEADER, FrameSplitter, value_ranges
from ingest.errors import LimitExceeded, MalformedDicom
from ingest.fetch.planning import ByteRange

DELIMITER = b"\xfe\xff\xdd\xe0" + bytes(4)
ROOMY = 1 << 24  # a bound no test value reaches, unless the test is about the bound
EOT = tuple[bytes, bytes] | None
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Value:
    """An encapsulated value, its Number of Frames and Extended Offset Table."""

    data: bytes
    frames: int
    eot: EOT = None


def reference(value: Value) -> tuple[list[bytes], bool]:
    """pydicom's frames (those it gave before any error) and whether it took the value
    cleanly: no error, no warning, Number of Frames of them."""
    frames: list[bytes] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for frame in generate_frames(
                value.data, number_of_frames=value.frames, extended_offsets=value.eot
            ):
                frames.append(frame)
        except Exception:
            return frames, False
    return frames, not caught and len(frames) == value.frames


def pieces(data: bytes, sizes: Sequence[int]) -> Iterator[bytes]:
    at = 0
    for size in cycle(sizes):
        if at >= len(data):
            return
        yield data[at : at + size]
        at += size


def split(
    value: Value, sizes: Sequence[int] = (4096,), bound: int = ROOMY, views: bool = False
) -> tuple[list[bytes | memoryview], Exception | None]:
    """Our frames, fed ``value`` in pieces of ``sizes`` (cycled), and the error if refused.

    Checks on the way that no more than a frame's bound and a partial header is held.
    """
    frames: list[bytes | memoryview] = []
    try:
        splitter = FrameSplitter(value.frames, value.eot, max_frame_bytes=bound, views=views)
        for piece in pieces(value.data, sizes):
            frames += splitter.feed(memoryview(piece))
            assert splitter.buffered <= bound + ITEM_HEADER - 1
        frames += splitter.finish()
        assert splitter.done
        assert splitter.frames == len(frames)
    except (MalformedDicom, LimitExceeded) as exc:
        return frames, exc
    return frames, None


def check_against_pydicom(value: Value, sizes: Sequence[int], bound: int = ROOMY) -> bool:
    """The property of the module docstring; True when the splitter finished. Frames
    handed out as views of the fed bytes (``views``) are the same frames."""
    viewed, _ = split(value, sizes, bound, views=True)
    ours, error = split(value, sizes, bound)
    assert viewed == ours
    theirs, clean = reference(value)
    assert ours[: len(theirs)] == theirs[: len(ours)]
    if error is None:
        assert clean
        assert ours == theirs
    return error is None


def check_finishes_where_pydicom_does(value: Value, sizes: Sequence[int]) -> bool:
    """For a value as pydicom encapsulates it: finished exactly where pydicom takes it
    cleanly (none of the refusals of ``REFUSED`` applies); True when it did."""
    finished = check_against_pydicom(value, sizes)
    assert finished == reference(value)[1]
    return finished


# -- values -------------------------------------------------------------------------------

chunk_sizes = st.lists(st.one_of(st.integers(1, 9), st.integers(10, 300)), min_size=1, max_size=6)


@st.composite
def frame_bytes(draw: st.DrawFn, jpeg_like: bool) -> bytes:
    """Random bytes; JPEG-like ones have no FF but the end marker, as a codestream."""
    size = draw(st.integers(6, 60))
    if jpeg_like:
        body = bytes(draw(st.lists(st.integers(0, 0xFE), min_size=size, max_size=size)))
        return body + b"\xff\xd9"
    return draw(st.binary(min_size=size, max_size=size))


@st.composite
def values(draw: st.DrawFn, frames: Sequence[bytes] | None = None) -> tuple[Value, bool]:
    """A value as pydicom encapsulates it, and whether pydicom must take it (a table or one
    fragment a frame says where frames end; without, a frame's end marker may be split
    between fragments, or random bytes hold one)."""
    jpeg_like = draw(st.booleans())
    if frames is None:
        count = draw(st.integers(1, 5))
        frames = draw(st.lists(frame_bytes(jpeg_like), min_size=count, max_size=count))
    layout = draw(st.sampled_from(["bot", "no-bot", "eot"]))
    if layout == "eot":
        data, offsets, lengths = encapsulate_extended(list(frames))
        return Value(data + DELIMITER, len(frames), (offsets, lengths)), True
    per_frame = draw(st.integers(1, 3))
    data = encapsulate(list(frames), fragments_per_frame=per_frame, has_bot=layout == "bot")
    plain = layout == "bot" or per_frame == 1 or len(frames) == 1
    return Value(data + DELIMITER, len(frames)), plain


@SETTINGS
@given(values(), chunk_sizes)
def test_split_equals_generate_frames(built: tuple[Value, bool], sizes: list[int]) -> None:
    value, plain = built
    assert check_finishes_where_pydicom_does(value, sizes) or not plain


# -- real codestreams ---------------------------------------------------------------------


@cache
def sample(name: str) -> Value:
    ds = dcmread(str(get_testdata_file(name)))
    eot = None
    if "ExtendedOffsetTable" in ds:
        eot = (ds.ExtendedOffsetTable, ds.ExtendedOffsetTableLengths)
    return Value(bytes(ds.PixelData) + DELIMITER, int(ds.get("NumberOfFrames", 1) or 1), eot)


@cache
def codestreams(name: str, count: int) -> list[bytes]:
    value = sample(name)
    return list(generate_frames(value.data, number_of_frames=value.frames))[:count]


SAMPLES = [
    "SC_rgb_jpeg_dcmtk.dcm",  # JPEG baseline, BOT
    "examples_ybr_color.dcm",  # JPEG baseline, 30 frames, BOT
    "color3d_jpeg_baseline.dcm",  # JPEG baseline, 120 frames, no BOT
    "emri_small_jpeg_2k_lossless.dcm",  # JPEG 2000, 10 frames, no BOT
    "emri_small_jpeg_ls_lossless.dcm",  # JPEG-LS, 10 frames, no BOT
    "emri_small_RLE.dcm",  # RLE, 10 frames, BOT
    "OBXXXX1A_rle_2frame.dcm",  # RLE, 2 frames, no BOT and no markers
    "MR2_J2KR.dcm",  # JPEG 2000, one frame in 9 fragments
    "RG1_J2KR.dcm",  # JPEG 2000, one frame in 66 fragments
]


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("sizes", [(3, 5, 8), (4093,), (1 << 16,), (8 << 20,)])
def test_sample_files_split_as_pydicom(name: str, sizes: tuple[int, ...]) -> None:
    value = sample(name)
    if len(value.data) > 1 << 20 and sizes[0] < 16:
        sizes = (7, 1 << 15)
    assert check_against_pydicom(value, sizes)
    trailing = Value(value.data + b"\x08\x00\x05\x00" * 9, value.frames, value.eot)
    splitter = FrameSplitter(value.frames, value.eot, max_frame_bytes=ROOMY)
    assert len(splitter.feed(trailing.data)) == value.frames
    assert splitter.done
    assert splitter.value_length == len(value.data)
    assert splitter.feed(b"more after the delimiter") == []


@SETTINGS
@given(st.data(), chunk_sizes)
def test_real_codestreams_reencapsulated(data: st.DataObject, sizes: list[int]) -> None:
    name = data.draw(st.sampled_from(["color3d_jpeg_baseline.dcm", "emri_small_RLE.dcm"]))
    frames = codestreams(name, data.draw(st.integers(1, 8)))
    value, plain = data.draw(values(frames))
    finished = check_finishes_where_pydicom_does(value, sizes)
    assert finished or not plain


# -- mutations ----------------------------------------------------------------------------


def item_headers(data: bytes) -> list[int]:
    """Where each item header of a well-formed value starts (the delimiter's included)."""
    at, found = 0, []
    while at + ITEM_HEADER <= len(data):
        found.append(at)
        if data[at : at + 4] == DELIMITER[:4]:
            break
        at += ITEM_HEADER + struct.unpack_from("<I", data, at + 4)[0]
    return found


def put(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + len(new) :]


def table(*numbers: int) -> bytes:
    """An Extended Offset Table (or its lengths)."""
    return struct.pack(f"<{len(numbers)}Q", *numbers)


@st.composite
def mutants(draw: st.DrawFn) -> Value:
    value, _ = draw(values())
    data, eot, frames = value.data, value.eot, value.frames
    headers = item_headers(data)
    at = draw(st.sampled_from(headers))
    kind = draw(
        st.sampled_from(
            ["truncate", "length", "tag", "bot", "eot", "frames", "byte", "insert", "delete"]
        )
    )
    if kind == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "length":
        lie = draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 80)))
        data = put(data, at + 4, struct.pack("<I", lie))
    elif kind == "tag":
        tag = draw(st.sampled_from([DELIMITER[:4], b"\xfe\xff\x0d\xe0", b"\xe0\x7f\x10\x00"]))
        data = put(data, at, tag)
    elif kind == "bot":  # a table (over a value without one, too)
        bot = draw(st.lists(st.integers(0, len(data)), min_size=1, max_size=6))
        old_length = struct.unpack_from("<I", data, 4)[0]
        data = with_bot(bot, value.data[ITEM_HEADER + old_length :])
    elif kind == "eot":
        count = draw(st.integers(0, 6))
        numbers = st.lists(st.integers(0, 200), min_size=count, max_size=count)
        offsets, lengths = draw(numbers), draw(numbers)
        eot = (table(*offsets), table(*lengths))
        frames = max(1, count)
    elif kind == "frames":
        frames = draw(st.integers(1, frames + 3))
    elif kind == "byte":
        where = draw(st.integers(0, len(data) - 1))
        data = put(data, where, bytes([draw(st.integers(0, 255))]))
    elif kind == "insert":  # an item, before another (or the delimiter)
        payload = draw(st.sampled_from([b"", b"\xff\xd9", b"\x00\x01\x02\x03"]))
        item = struct.pack("<4sI", b"\xfe\xff\x00\xe0", len(payload)) + payload
        data = data[:at] + item + data[at:]
    elif len(headers) > 2 and at not in (0, headers[-1]):  # delete an item
        data = data[:at] + data[headers[headers.index(at) + 1] :]
    return Value(data, frames, eot)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutants(), chunk_sizes, st.sampled_from([ROOMY, 64, 16]))
def test_mutated_values_refused_or_equal(value: Value, sizes: list[int], bound: int) -> None:
    if bound == ROOMY:
        check_against_pydicom(value, sizes)
        return
    # a small bound: frames over it refused; without a table, a reading settled by the
    # bound may have given frames before the refusal, so only the finished case is compared
    ours, error = split(value, sizes, bound)
    if error is None:
        theirs, clean = reference(value)
        assert clean
        assert ours == theirs


# -- memory -------------------------------------------------------------------------------


def jpeg_like(count: int, size: int) -> list[bytes]:
    return [bytes([k % 250]) * (size - 2) + b"\xff\xd9" for k in range(count)]


def opaque(count: int, size: int) -> list[bytes]:
    return [bytes([k % 250]) * size for k in range(count)]


def frame_ends(data: bytes, per_frame: int) -> list[int]:
    """Where each frame's last fragment ends, but the last frame's: at the delimiter's end."""
    headers = item_headers(data)[1:-1]
    ends = [at + ITEM_HEADER + struct.unpack_from("<I", data, at + 4)[0] for at in headers]
    return [*ends[per_frame - 1 :: per_frame][:-1], len(data)]


def extended(frames: list[bytes]) -> Value:
    data, offsets, lengths = encapsulate_extended(frames)
    return Value(data + DELIMITER, len(frames), (offsets, lengths))


@pytest.mark.parametrize(
    ("value", "per_frame"),
    [
        (Value(encapsulate(jpeg_like(40, 1000), 3) + DELIMITER, 40), 3),
        (Value(encapsulate(jpeg_like(40, 1000), has_bot=False) + DELIMITER, 40), 1),
        (Value(encapsulate(opaque(40, 1000), 1, has_bot=True) + DELIMITER, 40), 1),
        (extended(opaque(40, 1000)), 1),
    ],
)
def test_each_frame_out_once_in_holding_at_most_a_frame(value: Value, per_frame: int) -> None:
    """With a table, or a marker ending every fragment: a frame and a partial header held at
    most, and each frame out as soon as its last byte is in (the last: its delimiter)."""
    splitter = FrameSplitter(value.frames, value.eot, max_frame_bytes=1000)
    ends, seen, fed = frame_ends(value.data, per_frame), 0, 0
    for piece in pieces(value.data, (5, 333, 2, 1)):
        seen += len(splitter.feed(piece))
        fed += len(piece)
        assert splitter.buffered <= 1000 + ITEM_HEADER - 1
        assert seen == sum(end <= fed for end in ends)
    assert seen == 40


def test_eot_frames_are_its_lengths() -> None:
    value = extended(opaque(6, 99))
    assert check_against_pydicom(value, (13,))
    assert split(value)[0] == [frame + b"\x00" for frame in opaque(6, 99)]


def test_no_table_without_markers_settles_by_the_bound() -> None:
    """RLE-like fragments (no markers), no table: pydicom's count decides only at the end,
    but reading fragments as frames is the only one left once a marked frame would pass
    the bound, so frames flow long before the end."""
    value = Value(encapsulate(opaque(60, 500), has_bot=False) + DELIMITER, 60)
    splitter = FrameSplitter(60, max_frame_bytes=1600)
    early = splitter.feed(value.data[: len(value.data) // 2])
    assert len(early) >= 20
    assert splitter.buffered <= 1600
    assert early + splitter.feed(value.data[len(value.data) // 2 :]) == reference(value)[0]


def test_no_table_undecidable_within_the_bound() -> None:
    """Marked frames of two fragments, no table: one frame a fragment stays possible until
    the fragments outnumber the frames, which is past the bound here."""
    value = Value(encapsulate(jpeg_like(30, 400), 2, has_bot=False) + DELIMITER, 30)
    assert check_against_pydicom(value, (64,))
    _, error = split(value, (64,), bound=2000)
    assert isinstance(error, LimitExceeded)


def test_settled_reading_proven_wrong_is_refused() -> None:
    """Fragments outnumber frames after all: pydicom's frames end at markers, and this one,
    with no marker, would pass the bound (the frames given before are not to be used)."""
    value = Value(encapsulate(opaque(8, 500), has_bot=False) + DELIMITER, 7)
    _, error = split(value, (100,), bound=1200)
    assert isinstance(error, LimitExceeded)


def test_many_tiny_undecided_fragments_are_bounded_too() -> None:
    value = Value(encapsulate(opaque(3000, 2), has_bot=False) + DELIMITER, 3000)
    assert check_against_pydicom(value, (4096,))
    _, error = split(value, (4096,), bound=4096)
    assert isinstance(error, LimitExceeded)


@pytest.mark.parametrize(
    "value",
    [
        Value(encapsulate([b"x" * 5000]) + DELIMITER, 1),
        Value(encapsulate([b"x" * 5000], 4) + DELIMITER, 1),
        Value(encapsulate([b"x" * 100, b"y" * 5000], 1, has_bot=False) + DELIMITER, 2),
    ],
)
def test_frame_over_the_bound(value: Value) -> None:
    _, error = split(value, (999,), bound=4096)
    assert isinstance(error, LimitExceeded)


def test_eot_frame_over_the_bound() -> None:
    with pytest.raises(LimitExceeded):
        FrameSplitter(2, (table(0, 16), table(8, 9999)), max_frame_bytes=99)


def test_views_of_whole_items_copies_of_the_rest() -> None:
    """With ``views``, a frame that is one item inside one ``feed`` is a view of the fed
    bytes (no copy); one that straddles two feeds is copied."""
    frames = jpeg_like(3, 100)
    slot = bytearray(encapsulate(frames, 1) + DELIMITER)
    first_item = len(slot) - len(DELIMITER) - sum(8 + len(f) for f in frames)  # after the BOT
    cut = first_item + 2 * (8 + len(frames[0])) + 50  # inside the third frame
    splitter = FrameSplitter(3, max_frame_bytes=ROOMY, views=True)
    head = splitter.feed(memoryview(slot)[:cut])
    tail = splitter.feed(memoryview(slot)[cut:])
    assert head + tail == frames
    assert [type(f) for f in head + tail] == [memoryview, memoryview, bytes]
    slot[first_item + 8] ^= 0xFF  # the views see the slot's bytes
    assert head[0] != frames[0]
    assert tail[0] == frames[2]


def test_no_reference_to_the_fed_buffer() -> None:
    """The caller hands the ring slot back once ``feed`` returns, even when it raised."""
    slot = bytearray(encapsulate(jpeg_like(3, 100), 2) + DELIMITER)
    splitter = FrameSplitter(3, max_frame_bytes=ROOMY)
    frames = splitter.feed(memoryview(slot)[:150]) + splitter.feed(memoryview(slot)[150:])
    slot[:] = bytes(len(slot))
    slot += b"resized"
    assert frames == jpeg_like(3, 100)
    bad = bytearray(b"\xfe\xff\x00\xe0\x03\x00\x00\x00")
    with pytest.raises(MalformedDicom):
        FrameSplitter(1, max_frame_bytes=ROOMY).feed(memoryview(bad))
    bad += b"resized"


# -- where pydicom guesses and the splitter refuses -----------------------------------------

FRAMES = [b"\x01\x02" * 20 + b"\xff\xd9", b"\x03\x04" * 20 + b"\xff\xd9"]
GOOD = encapsulate(FRAMES)
SECOND = ITEM_HEADER + len(FRAMES[0])  # the second frame's item, past the BOT


GOOD_EOT = encapsulate_extended(FRAMES)[0] + DELIMITER


def with_bot(offsets: list[int], rest: bytes = GOOD[16:]) -> bytes:
    table = struct.pack(f"<{len(offsets)}I", *offsets)
    return b"\xfe\xff\x00\xe0" + struct.pack("<I", len(table)) + table + rest


REFUSED = {
    "no delimiter": Value(GOOD, 2),
    "truncated fragment": Value(GOOD[:-3], 2),
    "BOT first offset not 0": Value(with_bot([8, SECOND]) + DELIMITER, 2),
    "BOT offset inside an item": Value(with_bot([0, 30]) + DELIMITER, 2),
    "BOT offset past the end": Value(with_bot([0, SECOND, 2 * SECOND]) + DELIMITER, 3),
    "fewer frames than Number of Frames": Value(GOOD + DELIMITER, 1),
    "more marked frames than Number of Frames": Value(
        encapsulate(FRAMES * 2, has_bot=False) + DELIMITER, 3
    ),
    "a fragment after the last marker": Value(
        encapsulate([*FRAMES, b"\x05\x06"], has_bot=False) + DELIMITER, 2
    ),
    "EOT length past its item": Value(GOOD_EOT, 2, (table(0, SECOND), table(44, 42))),
    "EOT offset inside an item": Value(GOOD_EOT, 2, (table(0, 30), table(8, 8))),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_where_pydicom_guesses(case: str) -> None:
    value = REFUSED[case]
    ours, error = split(value, (7,))
    assert isinstance(error, MalformedDicom), case
    theirs = reference(value)[0]
    assert theirs  # pydicom gives frames for each of these, with or without a warning
    assert ours[: len(theirs)] == theirs[: len(ours)]


def test_errors_name_offsets_not_data() -> None:
    secret = b"PATIENT^NAME"
    value = Value(encapsulate([secret + b"\xff\xd9"]) + b"\x10\x00\x10\x00PN\x0c\x00", 1)
    for sizes in ((3,), (999,)):
        _, error = split(value, sizes)
        assert isinstance(error, MalformedDicom)
        assert "PATIENT" not in str(error)
        assert "(0010,0010)" in str(error)


@pytest.mark.parametrize("frames", [0, -1])
def test_number_of_frames_must_be_positive(frames: int) -> None:
    with pytest.raises(MalformedDicom):
        FrameSplitter(frames, max_frame_bytes=ROOMY)


# -- read plan ------------------------------------------------------------------------------


@given(
    st.integers(0, 5000),
    st.integers(16, 9999),
    st.integers(0, 5000),
    st.integers(1, 3000),
    st.booleans(),
)
def test_value_ranges_tile_the_value(
    start: int, length: int, trailer: int, part: int, known_end: bool
) -> None:
    size = start + length + trailer
    ranges = value_ranges(start, start + length if known_end else None, size, part)
    end = start + length if known_end else size
    assert ranges[0].start == start
    assert ranges[-1].end == end
    assert all(a.end == b.start for a, b in pairwise(ranges))
    assert all(0 < r.length <= part for r in ranges)


@pytest.mark.parametrize(
    ("start", "end", "size"), [(10, 5000, 4000), (5000, None, 4000), (100, 110, 4000)]
)
def test_value_ranges_refuse_a_value_outside_the_object(
    start: int, end: int | None, size: int
) -> None:
    with pytest.raises(MalformedDicom):
        value_ranges(start, end, size, 1024)


def test_value_ranges_example() -> None:
    assert value_ranges(100, None, 300, 128) == [ByteRange(100, 228), ByteRange(228, 300)]
