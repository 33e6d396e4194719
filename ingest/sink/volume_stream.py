"""A series volume streamed as its slices arrive, the pure part: which slices make which part.

A volume's ``.npy`` is its header, then its slices sorted along the slice normal
(``ingest.sink.series.plan_volume``). A scanner or a PACS usually sends a series
in that order or in the reverse one, so most of the file can be uploaded as
multipart parts while the series still arrives, and be complete right after its
last slice. S3's rules for a multipart upload shape how:

- parts may be uploaded in any order and their numbers (1 to 10,000) need not
  be contiguous: the object is the parts named at completion, by number;
- every part but the last holds at least 5 MiB; one holds at most 5 GiB.

``VolumeStream`` places each slice by its distance along the normal, not by
when it came: the worker finishes slices a few places out of the order they
were sent in. The file is cut into three regions:

- the *block*: the parts uploaded while slices arrive, each ``per_part``
  slices (``part_size`` bytes or a little more) adjacent to each other, one
  step apart (the smallest step between the positions seen so far);
- the *head*: every slice below the block, with the header in front, whose
  shape is known only at the end; it is the first part, uploaded last, and
  always holds at least ``per_part`` slices;
- the *tail*: every slice above the block, the last part, uploaded last.

The direction is decided when the first part is cut, from where the first
slice to arrive lies among those seen then (near the bottom: ascending; near
the top: descending): with the first two positions alone, two neighbours
finished in the reverse order would decide it wrongly. Ascending, the block
grows upwards from part 2, its head (part 1) the ``per_part`` lowest slices
and any that come below them later; descending, it grows downwards from part
9,999, always leaving at least ``per_part`` slices below for the head, part
10,000 kept for a tail of slices that come above it later.

A slice that lands inside the block (a duplicate, or a step smaller than the
one assumed), differs from the first in shape, type, orientation or spacing,
or makes the smallest step smaller once parts are cut, stops the stream
(``stopped`` says why): its upload is aborted and the volume written whole at
the end, as without streaming. ``finish`` checks the plan at the end: the
volume's slices must be exactly those streamed, in the same order, with the
same shape and type, so the parts make the bytes the whole write would.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from ingest.sink.series import DEFAULT_TOLERANCE, Member

MAX_PART_BYTES: Final = 5 * 1024**3  # S3's largest part
_HEADER_ROOM: Final = 65536  # a ``.npy`` header's bytes at most, but for absurd shapes
_SAME_POSITION_MM: Final = 1e-3  # as plan_volume: closer positions are one position
_ORIENTATION_TOLERANCE: Final = 1e-4  # as plan_volume


@dataclass(frozen=True, slots=True)
class Part:
    """One part of the volume's multipart upload: its slices in the volume's order."""

    number: int
    slices: tuple[str, ...]  # SOP Instance UIDs
    header: bool = False  # the ``.npy`` header goes in front of them (the first part)


class VolumeStream:
    """Decides the parts of one series' volume as its slices arrive (the module's docstring).

    ``add`` takes each slice and returns the parts it completes, to upload now;
    ``finish`` takes the plan's order at the end and returns the parts left (the
    head, with the header, and the tail), or None when the volume must be
    written whole.
    """

    def __init__(
        self,
        first: Member,
        part_size: int,
        max_parts: int,
        tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        self._first = first
        self._dtype = np.dtype(first.dtype)
        self.slice_bytes = int(np.prod(first.shape[1:])) * self._dtype.itemsize
        self.per_part = max(1, -(-part_size // max(self.slice_bytes, 1)))
        self._max_parts = max_parts
        self._tolerance = tolerance
        orientation = np.asarray(first.orientation, dtype=np.float64)
        self._normal = np.cross(orientation[:3], orientation[3:])
        self._at: list[float] = []  # distances along the normal, ascending
        self._sops: list[str] = []  # the slices at them
        self._first_at: float | None = None
        self._step: float | None = None  # the smallest step between positions seen
        self._block: tuple[float, float] | None = None  # its lowest and highest slice
        self._next = 0  # the next part number the block takes
        self._cut: list[Part] = []
        self.direction = 0  # 1 ascending, -1 descending, 0 not decided yet
        self.stopped: str | None = None  # why the volume is no longer streamed

    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts cut so far (the block), in the order they were cut."""
        return tuple(self._cut)

    @property
    def slices(self) -> int:
        return len(self._sops)

    @property
    def order(self) -> tuple[str, ...]:
        """The slices taken, along the normal: a volume of them all has them in this order."""
        return tuple(self._sops)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """One slice's shape in the volume (the first slice's, without its frame axis)."""
        return tuple(self._first.shape[1:])

    def stop(self, why: str) -> None:
        """Stream no more: the volume is written whole (the first reason is kept)."""
        if self.stopped is None:
            self.stopped = why

    def add(self, member: Member) -> list[Part]:
        """Take one slice; return the parts it completes (none once stopped)."""
        if self.stopped is not None:
            return []
        why = self._differs(member)
        if why is not None:
            self.stop(why)
            return []
        at = float(np.dot(member.position, self._normal))
        index = bisect.bisect_left(self._at, at)
        near = self._at[max(index - 1, 0) : index + 1]
        if any(abs(at - other) <= _SAME_POSITION_MM for other in near):
            self.stop("two slices at one position")
            return []
        if self._block is not None:
            low, high = self._block
            if low - _SAME_POSITION_MM <= at <= high + _SAME_POSITION_MM:
                self.stop("a slice inside the parts uploaded")
                return []
        steps = [at - self._at[index - 1]] if index > 0 else []
        steps += [self._at[index] - at] if index < len(self._at) else []
        step = min([*steps, self._step] if self._step is not None else steps, default=None)
        if self._block is not None and step is not None and step < self._smaller_step:
            self.stop("a step smaller than the one the parts uploaded assumed")
            return []
        self._step = step
        self._at.insert(index, at)
        self._sops.insert(index, member.sop_instance_uid)
        if self._first_at is None:
            self._first_at = at
        return self._cut_parts()

    def finish(self, order: Sequence[str], shape: tuple[int, ...], dtype: str) -> list[Part] | None:
        """The parts left for a volume of the slices ``order`` (the plan's, along the normal),
        ``shape`` and ``dtype``: the head (header first) and the tail, if any; None when
        the volume must be written whole (``stopped`` says why)."""
        if self.stopped is None:
            if self._block is None:
                self.stop("no part was cut")
            elif list(order) != self._sops:
                self.stop("the volume's slices are not those streamed, in their order")
            elif np.dtype(dtype) != self._dtype or tuple(shape[1:]) != self._first.shape[1:]:
                self.stop("the volume's type or shape is not its slices'")
        if self.stopped is not None or self._block is None:
            return None
        low = bisect.bisect_left(self._at, self._block[0])
        high = bisect.bisect_right(self._at, self._block[1])
        numbers = sorted(p.number for p in self._cut)
        head = Part(numbers[0] - 1, tuple(self._sops[:low]), header=True)
        parts = [head]
        if high < len(self._sops):
            parts.append(Part(numbers[-1] + 1, tuple(self._sops[high:])))
        if any(len(p.slices) * self.slice_bytes > MAX_PART_BYTES - _HEADER_ROOM for p in parts):
            self.stop("the first or last part would be larger than S3 allows")
            return None
        return parts

    def _differs(self, member: Member) -> str | None:
        first = self._first
        if member.shape[1:] != first.shape[1:] or np.dtype(member.dtype) != self._dtype:
            return "the slices' shapes or types differ"
        if member.pixel_spacing != first.pixel_spacing:
            return "the slices' pixel spacings differ"
        if len(member.orientation) != 6 or (
            np.abs(np.asarray(member.orientation) - np.asarray(first.orientation)).max()
            > _ORIENTATION_TOLERANCE
        ):
            return "the slices' orientations differ"
        return None

    @property
    def _smaller_step(self) -> float:
        """A step below this is not the one assumed (within the tolerance)."""
        return (self._step or 0.0) * (1 - self._tolerance)

    def _adjacent(self, low: float, high: float) -> bool:
        assert self._step is not None
        return abs((high - low) - self._step) <= self._tolerance * self._step

    def _run_up(self, start: int) -> int:
        """How many slices from ``start`` upwards are one step apart each."""
        end = start + 1
        while end < len(self._at) and self._adjacent(self._at[end - 1], self._at[end]):
            end += 1
        return end - start

    def _run_down(self, start: int) -> int:
        """How many slices from ``start`` downwards are one step apart each."""
        end = start - 1
        while end >= 0 and self._adjacent(self._at[end], self._at[end + 1]):
            end -= 1
        return start - end

    def _cut_parts(self) -> list[Part]:
        per, count = self.per_part, len(self._at)
        out: list[Part] = []
        if self._block is None:
            if self._step is None or count < 2 * per or self._first_at is None:
                return out
            above, below = self._at[-1] - self._first_at, self._first_at - self._at[0]
            if above == below:
                return out
            direction = 1 if above > below else -1
            if direction == 1 and self._run_up(per) >= per:
                first = Part(2, tuple(self._sops[per : 2 * per]))
                self._block, self._next = (self._at[per], self._at[2 * per - 1]), 3
            elif direction == -1 and self._run_down(count - 1) >= per:
                first = Part(self._max_parts - 1, tuple(self._sops[count - per :]))
                self._block = (self._at[count - per], self._at[-1])
                self._next = self._max_parts - 2
            else:
                return out
            self.direction = direction
            out.append(first)
        while True:
            low, high = self._block
            if self.direction == 1:
                start = bisect.bisect_right(self._at, high + _SAME_POSITION_MM)
                if (
                    self._next >= self._max_parts  # the last number stays for the tail
                    or start >= count
                    or not self._adjacent(high, self._at[start])
                    or self._run_up(start) < per
                ):
                    break
                part = Part(self._next, tuple(self._sops[start : start + per]))
                self._block, self._next = (low, self._at[start + per - 1]), self._next + 1
            else:
                start = bisect.bisect_left(self._at, low - _SAME_POSITION_MM) - 1
                if (
                    self._next < 2  # part 1 stays for the head
                    or start < 0
                    or not self._adjacent(self._at[start], low)
                    or self._run_down(start) < per
                    or start + 1 - per < per  # the head keeps per_part slices at least
                ):
                    break
                part = Part(self._next, tuple(self._sops[start + 1 - per : start + 1]))
                self._block, self._next = (self._at[start + 1 - per], high), self._next - 1
            out.append(part)
        self._cut.extend(out)
        return out
