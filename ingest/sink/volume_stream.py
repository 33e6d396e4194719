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
when it came: on a busy host the worker finishes slices far out of the order
they were sent in (the first to finish may be from the middle of those sent).
The file is cut into three regions:

- the *block*: the parts uploaded while slices arrive, each ``per_part``
  slices (``part_size`` bytes or a little more) adjacent to each other, one
  step apart (the smallest step between the positions seen so far);
- the *head*: every slice below the block, with the header in front, whose
  shape is known only at the end; it is the first part, uploaded last, and
  always holds at least ``per_part`` slices;
- the *tail*: every slice above the block, the last part, uploaded last.

No direction is guessed. The block's first part is the lowest run of
``per_part`` adjacent slices with ``per_part`` seen below it, numbered in the
middle of S3's range (5,000); the block then grows upwards (5,001, 5,002, ...)
and downwards (4,999, ...) wherever runs of ``per_part`` adjacent slices meet
it, downwards only while ``per_part`` slices stay below it for the head. The
number below the block's lowest is the head's, the one above its highest the
tail's. A series sent either way streams up to half of S3's parts (about 24
GiB of 5 MiB parts); slices past that wait for the head or the tail.

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
        self._step: float | None = None  # the smallest step between positions seen
        self._block: tuple[float, float] | None = None  # its lowest and highest slice
        self._up = self._down = max_parts // 2  # the block's highest and lowest numbers
        self._cut: list[Part] = []
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

    def _first_part(self) -> Part | None:
        """The block's first part: the lowest run of ``per_part`` adjacent slices with
        ``per_part`` slices below it, once there is one."""
        per = self.per_part
        if self._step is None:
            return None
        start = per
        while start + per <= len(self._at):
            run = self._run_up(start)
            if run >= per:
                self._block = (self._at[start], self._at[start + per - 1])
                return Part(self._up, tuple(self._sops[start : start + per]))
            start += run
        return None

    def _part_above(self) -> Part | None:
        """The run of ``per_part`` adjacent slices right above the block, if there is one
        and a number for it below the tail's."""
        assert self._block is not None
        low, high = self._block
        start = bisect.bisect_right(self._at, high + _SAME_POSITION_MM)
        if (
            self._up + 1 >= self._max_parts  # the last number stays for the tail
            or start >= len(self._at)
            or not self._adjacent(high, self._at[start])
            or self._run_up(start) < self.per_part
        ):
            return None
        self._up += 1
        self._block = (low, self._at[start + self.per_part - 1])
        return Part(self._up, tuple(self._sops[start : start + self.per_part]))

    def _part_below(self) -> Part | None:
        """The run of ``per_part`` adjacent slices right below the block, if there is one,
        ``per_part`` slices below it for the head, and a number for it above the head's."""
        per = self.per_part
        assert self._block is not None
        low, high = self._block
        start = bisect.bisect_left(self._at, low - _SAME_POSITION_MM) - 1
        if (
            self._down - 1 <= 1  # part 1 stays for the head
            or start < 0
            or not self._adjacent(self._at[start], low)
            or self._run_down(start) < per
            or start + 1 - per < per  # the head keeps per_part slices at least
        ):
            return None
        self._down -= 1
        self._block = (self._at[start + 1 - per], high)
        return Part(self._down, tuple(self._sops[start + 1 - per : start + 1]))

    def _cut_parts(self) -> list[Part]:
        out: list[Part] = []
        if self._block is None:
            first = self._first_part()
            if first is None:
                return out
            out.append(first)
        while (part := self._part_above() or self._part_below()) is not None:
            out.append(part)
        self._cut.extend(out)
        return out
