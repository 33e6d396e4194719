"""ingest/sink/volume_stream.py: which slices of a series make which part, as they arrive.

Slices of 4 x 4 ``float32`` (64 bytes) with parts of 256 bytes: four slices a
part. Every test that streams checks S3's rules on the parts it ends with: one
number each, the header in the first, every part but the last of ``per_part``
slices at least, and their slices, in the order of their numbers, the volume's.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from ingest.sink.series import Member
from ingest.sink.volume_stream import Part, VolumeStream

PART_SIZE = 256  # four slices
MAX_PARTS = 10_000
STEP_MM = 1.25


def slice_at(index: int, *, step: float = STEP_MM, sop: str | None = None) -> Member:
    """Slice ``index`` of a series along z, ``step`` mm apart."""
    return Member(
        sop_instance_uid=sop or f"1.2.3.{index}",
        npy=f"out/{index}.npy",
        content=f"crc-{index}",
        shape=(1, 4, 4),
        dtype="float32",
        position=(-179.2, -179.2, index * step),
        orientation=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0),
        pixel_spacing=(0.7, 0.7),
        instance_number=index + 1,
        acquisition_number=1,
        images_in_acquisition=None,
    )


def order_of(count: int) -> list[str]:
    """The volume's slices, along the normal (ascending z)."""
    return [slice_at(i).sop_instance_uid for i in range(count)]


def stream(
    arrivals: Sequence[Member], max_parts: int = MAX_PARTS
) -> tuple[VolumeStream, list[list[Part]]]:
    """A stream given ``arrivals`` in turn, and the parts each one cut."""
    layout = VolumeStream(arrivals[0], PART_SIZE, max_parts)
    return layout, [layout.add(m) for m in arrivals]


def check_parts(layout: VolumeStream, rest: list[Part], order: list[str], max_parts: int) -> None:
    """S3's rules, and the parts' slices in the order of their numbers are the volume's."""
    parts = sorted([*layout.parts, *rest], key=lambda p: p.number)
    numbers = [p.number for p in parts]
    assert len(set(numbers)) == len(numbers)
    assert numbers[0] >= 1
    assert numbers[-1] <= max_parts
    assert [p.header for p in parts] == [True] + [False] * (len(parts) - 1)
    assert all(len(p.slices) >= layout.per_part for p in parts[:-1])
    assert [sop for p in parts for sop in p.slices] == order


@pytest.mark.parametrize("direction", [1, -1])
def test_slices_in_order_are_uploaded_as_they_come_and_make_the_volume(direction: int) -> None:
    count = 14
    indices = list(range(count))[::direction]
    layout, cut = stream([slice_at(i) for i in indices])

    assert layout.per_part == 4
    # the first part is cut once two parts' worth have come, not at the end
    assert [len(c) for c in cut[:8]] == [0] * 7 + [1]
    assert all(not p.header for p in layout.parts)
    rest = layout.finish(order_of(count), (count, 4, 4), "float32")
    assert rest is not None, layout.stopped
    check_parts(layout, rest, order_of(count), MAX_PARTS)
    if direction == 1:  # upwards from 5,000, the head below it, the tail after the block
        assert [p.number for p in layout.parts] == [5000, 5001]
        assert [(p.number, len(p.slices)) for p in rest] == [(4999, 4), (5002, 2)]
    else:  # downwards from 5,000, leaving the head at least four slices
        assert [p.number for p in layout.parts] == [5000, 4999]
        assert [(p.number, len(p.slices)) for p in rest] == [(4998, 6)]
    assert rest[0].header


@pytest.mark.parametrize("direction", [1, -1])
def test_neighbours_finished_out_of_order_still_stream(direction: int) -> None:
    """The worker finishes slices a few places out of the order they were sent in, the
    first two among them: the direction and the parts still come out right."""
    count = 40
    for seed in range(20):
        rng = random.Random(seed)
        indices = list(range(count))[::direction]
        jittered = sorted(range(count), key=lambda k: k + rng.uniform(0, 3.5))
        arrivals = [indices[k] for k in jittered]
        layout, _ = stream([slice_at(i) for i in arrivals])
        rest = layout.finish(order_of(count), (count, 4, 4), "float32")
        assert rest is not None, (seed, layout.stopped)
        check_parts(layout, rest, order_of(count), MAX_PARTS)
        assert len(layout.parts) >= 6  # of ten parts' worth: the head's and one more at most


# The order a busy 2-core host finished 23 slices sent one after another: the first to
# finish was the twelfth sent, the second the third.
FINISHED = [11, 2, 12, 3, 14, 15, 5, 17, 16, 7, 0, 1, 6, 8, 13, 22, 21, 20, 19, 18, 9, 4, 10]


@pytest.mark.parametrize("direction", [1, -1])
def test_slices_finished_far_out_of_the_order_sent_stream_before_the_last(
    direction: int,
) -> None:
    """The slices sent in order finish far out of it, the first from the middle: every part
    the slices before the last make is up before the last one comes."""
    count = len(FINISHED) + 1
    sent = list(range(count))[::direction]
    layout, cut = stream([slice_at(sent[k]) for k in [*FINISHED, count - 1]])
    # 23 slices: four parts' worth beside the head's four, but for the three left over
    assert sum(len(c) for c in cut[:-1]) == 4
    rest = layout.finish(order_of(count), (count, 4, 4), "float32")
    assert rest is not None, layout.stopped
    check_parts(layout, rest, order_of(count), MAX_PARTS)


@pytest.mark.parametrize("direction", [1, -1])
def test_slices_finished_a_dozen_places_out_of_order_still_stream(direction: int) -> None:
    count = 40
    for seed in range(20):
        rng = random.Random(seed)
        indices = list(range(count))[::direction]
        jittered = sorted(range(count), key=lambda k: k + rng.uniform(0, 12))
        layout, _ = stream([slice_at(indices[k]) for k in jittered])
        rest = layout.finish(order_of(count), (count, 4, 4), "float32")
        assert rest is not None, (seed, layout.stopped)
        check_parts(layout, rest, order_of(count), MAX_PARTS)
        assert len(layout.parts) >= 6, seed  # of ten parts' worth, the head's and more


def test_the_first_two_in_the_reverse_order_still_stream() -> None:
    arrivals = [1, 0, *range(2, 12)]
    layout, _ = stream([slice_at(i) for i in arrivals])
    assert [p.number for p in layout.parts] == [5000, 5001]
    rest = layout.finish(order_of(12), (12, 4, 4), "float32")
    assert rest is not None
    check_parts(layout, rest, order_of(12), MAX_PARTS)


@pytest.mark.parametrize("direction", [1, -1])
def test_the_first_slice_last_joins_the_part_uploaded_at_the_end(direction: int) -> None:
    """Ascending, the lowest slice coming last goes into the head; descending, the highest
    goes into the tail, the part above the block."""
    count = 16
    indices = list(range(count))[::direction]
    arrivals = [*indices[1:], indices[0]]
    layout, _ = stream([slice_at(i) for i in arrivals])
    rest = layout.finish(order_of(count), (count, 4, 4), "float32")
    assert rest is not None, layout.stopped
    check_parts(layout, rest, order_of(count), MAX_PARTS)
    if direction == -1:
        assert rest[-1] == Part(5001, (slice_at(count - 1).sop_instance_uid,))


def test_a_duplicate_position_stops_the_stream() -> None:
    arrivals = [slice_at(i) for i in range(10)]
    arrivals.insert(9, slice_at(3, sop="1.2.3.dup"))
    layout, _ = stream(arrivals)
    assert layout.stopped == "two slices at one position"
    assert layout.finish(order_of(10), (10, 4, 4), "float32") is None


def test_the_same_slice_again_stops_the_stream() -> None:
    layout, _ = stream([slice_at(i) for i in (0, 1, 2, 1)])
    assert layout.stopped == "two slices at one position"


def test_a_slice_inside_the_parts_uploaded_stops_the_stream() -> None:
    """Even positions first, then the odd ones (an interleaved acquisition): the step seemed
    twice what it is, and the first odd slice lands inside a part already up."""
    arrivals = [*range(0, 24, 2), *range(9, 24, 2), *range(1, 9, 2)]
    layout, _ = stream([slice_at(i) for i in arrivals])
    assert layout.parts  # some were cut, at the step of the even ones
    assert layout.stopped == "a slice inside the parts uploaded"
    assert layout.finish(order_of(24), (24, 4, 4), "float32") is None


def test_a_smaller_step_once_parts_are_up_stops_the_stream() -> None:
    arrivals = [slice_at(i) for i in range(10)]
    between = dataclasses.replace(slice_at(10), position=(-179.2, -179.2, 9 * STEP_MM + 0.5))
    layout, _ = stream([*arrivals, between])
    assert layout.parts
    assert layout.stopped == "a step smaller than the one the parts uploaded assumed"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"shape": (1, 4, 5)}, "the slices' shapes or types differ"),
        ({"dtype": "int16"}, "the slices' shapes or types differ"),
        ({"pixel_spacing": (0.7, 0.8)}, "the slices' pixel spacings differ"),
        ({"orientation": (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)}, "the slices' orientations differ"),
    ],
)
def test_a_slice_unlike_the_first_stops_the_stream(change: dict[str, object], why: str) -> None:
    arrivals = [slice_at(i) for i in range(10)]
    arrivals[9] = dataclasses.replace(arrivals[9], **change)  # type: ignore[arg-type]
    layout, _ = stream(arrivals)
    assert layout.stopped == why


def test_a_plan_unlike_the_slices_streamed_is_written_whole() -> None:
    count = 12
    for order, shape, dtype in [
        (order_of(count + 1), (count + 1, 4, 4), "float32"),  # a slice it did not see
        (order_of(count)[::-1], (count, 4, 4), "float32"),
        (order_of(count), (count, 4, 4), "float64"),  # promoted by another slice's type
    ]:
        layout, _ = stream([slice_at(i) for i in range(count)])
        assert layout.parts
        assert layout.finish(order, shape, dtype) is None
        assert layout.stopped is not None


def test_too_few_slices_for_two_parts_are_written_whole() -> None:
    layout, cut = stream([slice_at(i) for i in range(7)])
    assert cut == [[]] * 7
    assert layout.finish(order_of(7), (7, 4, 4), "float32") is None
    assert layout.stopped == "no part was cut"


@pytest.mark.parametrize(("direction", "numbers"), [(1, [4, 5, 6, 7, 8]), (-1, [4, 3, 2])])
def test_the_part_numbers_run_out_before_the_slices(direction: int, numbers: list[int]) -> None:
    """With nine part numbers the block starts at 4: upwards it takes 4 to 8 (9 kept for
    the tail), downwards 4 to 2 (1 kept for the head); the rest waits for the end."""
    count = 40
    indices = list(range(count))[::direction]
    layout, _ = stream([slice_at(i) for i in indices], max_parts=9)
    assert [p.number for p in layout.parts] == numbers
    rest = layout.finish(order_of(count), (count, 4, 4), "float32")
    assert rest is not None
    check_parts(layout, rest, order_of(count), 9)


def test_large_slices_make_a_part_each() -> None:
    first = dataclasses.replace(slice_at(0), shape=(1, 16, 16))  # 1,024 bytes: past a part
    layout = VolumeStream(first, PART_SIZE, MAX_PARTS)
    assert layout.per_part == 1
    cut = [layout.add(dataclasses.replace(slice_at(i), shape=(1, 16, 16))) for i in range(4)]
    assert [len(c) for c in cut] == [0, 1, 1, 1]
