"""Series volumes, the IO: member records, pending markers, slices kept, volumes written.

With ``SERIES=volume`` every slice's sidecar (``ingest.sink.series.member_of``)
also leaves a member record under ``OUTPUT_URL + "series/" + STUDY/SERIES/FRAME_OF_REFERENCE
+ "/members/" + SOP + ".json"`` and a pending marker under ``series-pending/``
(which this process does not remove while a member record is being written),
both before the slice's offset is committed: the assembly's whole state is
durable outputs or uncommitted offsets, so a worker killed at any point, or a
partition that moves to another worker, loses nothing. A held slice (below)
writes no marker: its offset is not committed before its values are durable, and
it is spilled after writing the marker. Nor does it wait for its member record:
the records of the slices held within ``HELD_RECORD_LINGER_S`` of each other are
written as one, ``.../members/held-TOKEN-N.json`` (a record is never rewritten:
TOKEN is the process's, N counts), and a series' pending ones before its volume is
planned; a slice spilled has a record of its own as well, which wins. Then:

- when the data says the series is complete (Images in Acquisition, NM's and
  PET's Number of Slices, or a series manifest whose instances are all there),
  the slice that completes it writes the volume before its own offset is
  committed;
- else, ``SERIES_QUIET_S`` after a series' last slice arrived here, the
  assembler plans it from its member records (those of every worker) and
  writes what they make; at start-up, every pending marker is due after the
  same quiet period, so a series whose quiet period was cut short by a crash
  or a rebalance is still written.

A one-frame output's values are kept as they are written (the sink's
``keep``), within ``SERIES_MEMORY``, so the volume is written from memory; what
is not kept is read back. With ``SERIES_SLICES=hold`` a kept slice's own
``.npy`` is not written at all: its member record says ``held``, and its offset
waits (``Hold``) until a volume holding it is durable, or until the slice is
*spilled* (written as an output of its own after all): when its partition is
revoked, when it is a duplicate or the plan is refused, or when the quiet
period finds slices held by another worker. A later version reads a held
slice from the volume that holds it.

A volume is ``.../VERSION.npy`` + ``.../VERSION.json`` (and ``latest.json``, a copy
of the newest sidecar written; with ``SERIES_FORMAT`` ``nifti`` or ``both`` a
``.nii.gz``); its version names its members and their bytes, so it is written
once (an existing sidecar of that version is left as it is) and a late slice
makes a new version beside it. Its slices are taken ``SLICES_IN_FLIGHT`` at a
time and streamed into one multipart upload. A plan the checks refuse (gaps,
uneven steps, mixed sizes) is written as a sidecar with ``npy`` null and the
reasons.

Most volumes are uploaded before that, while their slices arrive (``_Stream``):
a series this process sees from its first slice, none of it recorded by another
worker or an earlier run, has its ``.npy`` uploaded part by part as runs of
adjacent slices come (``ingest.sink.volume_stream`` decides which), in the
background of ``run``. When the series is complete and its plan is exactly the
slices uploaded, the first part (with the header) and the last are uploaded and
the upload completed, under ``.../stream-ID.npy`` (an upload is bound to its key
before the version is known), which the version's sidecar names; anything else
aborts the upload, and the volume is written whole as above. The values uploaded
are the kept ones: with ``SERIES_SLICES=write`` (and nothing else to read them at
the end) a slice is dropped once its part is up, its own ``.npy`` read back if
the volume is written whole after all; held slices stay until the volume is
durable, as their offsets do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import anyio
import numpy as np
import structlog
from anyio.abc import TaskGroup, TaskStatus

from ingest.errors import IngestError, ProcessingError, SinkError
from ingest.hooks import HookSlab, SeriesHook
from ingest.settings import Settings
from ingest.sink.nifti import nifti_dtype, nifti_header
from ingest.sink.output import (
    MAX_PARTS,
    S3_MIN_PART,
    ArrayWriter,
    OutputSink,
    PartUpload,
    Writer,
    npy_header,
)
from ingest.sink.series import (
    Member,
    SeriesId,
    VolumePlan,
    manifest_of,
    member_from_json,
    member_of,
    plan_volume,
)
from ingest.sink.volume_stream import Part, VolumeStream
from ingest.source.offsets import Partition
from ingest_gpu.thread import DeviceThread

log = structlog.get_logger("ingest.series")

SLICES_IN_FLIGHT: Final = 8  # slices read back at once (the assembler's memory: as many)
# Held slices' member records are written together: one record for those held within this
# long of each other (their offsets wait for the volume, not for the record), at most
# HELD_RECORD_MEMBERS in one; a volume about to be planned has its series' written at once.
HELD_RECORD_LINGER_S: Final = 0.5
HELD_RECORD_MEMBERS: Final = 256
_HELD_RECORD_PREFIX: Final = "held-"  # a shared record's name: no SOP Instance UID starts so
NIFTI_GZIP_LEVEL: Final = 1  # CT values compress little more at 6, at several times the CPU
NIFTI_TYPE: Final = "application/gzip"


class Hold:
    """A held slice's offset: finished (``then``'s callbacks run) once its values are
    durable, in a volume or in their own output."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.released = False

    def then(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the slice is durable (now, when it is already)."""
        if self.released:
            callback()
        else:
            self._callbacks.append(callback)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


@dataclass(slots=True)
class _Kept:
    """One slice's values in memory: written (its own ``.npy`` is durable) or held."""

    values: np.ndarray  # (1, rows, columns[, samples])
    written: bool
    hold: Hold | None = None  # held: its offset waits for it
    partition: Partition | None = None


class _KeepingWriter:
    """The writer of a one-frame output that keeps its values (``SeriesAssembler.keep``):
    with ``inner`` it writes them too (``SERIES_SLICES=write``), else only keeps them."""

    def __init__(
        self,
        assembler: SeriesAssembler,
        key: str,
        shape: tuple[int, ...],
        dtype: str,
        inner: Writer | None,
    ) -> None:
        self._assembler = assembler
        self._key = key
        self._shape = shape
        self._dtype = np.dtype(dtype)
        self._inner = inner
        self._pieces: list[np.ndarray] = []

    async def __aenter__(self) -> _KeepingWriter:
        if self._inner is not None:
            await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        kept = False
        try:
            if self._inner is not None:
                await self._inner.__aexit__(exc_type, exc, tb)
            if exc is None:  # one piece (a slice's values) is kept as it is: no copy
                pieces = [p.reshape(-1) for p in self._pieces]
                values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                if values.size != int(np.prod(self._shape)):
                    raise _BadRecord(f"output has {values.size} values, not {self._shape}")
                self._assembler._loose[self._key] = _Kept(
                    values.reshape(self._shape), written=self._inner is not None
                )
                kept = True
        finally:
            if not kept:
                self._assembler._free(self._shape, self._dtype)
        return None

    async def write(self, values: np.ndarray | None) -> None:
        """Keep (and with ``inner``, write) ``values``; as for any writer, the caller does not
        change them afterwards."""
        if values is None:
            raise _BadRecord("no host values to keep (the device kept them)")
        if self._inner is not None:
            await self._inner.write(values)
        self._pieces.append(np.asarray(values, dtype=self._dtype))


class _Stream:
    """A series' volume uploaded while its slices arrive: ``VolumeStream`` says which slices
    make which part; a part goes up as soon as it is cut (in the background); the head
    (with the header) and the tail go up at the end (``finish``), when the plan is the
    volume streamed, and ``complete`` makes the object. The values uploaded are those
    kept of each slice (``_Kept``): no copy."""

    def __init__(self, sink: OutputSink, key: str, first: Member) -> None:
        self.key = key  # without its suffix (``.npy``; a NIfTI beside it, ``.nii.gz``)
        # S3's smallest parts: the head goes up after the last slice with between one and
        # two parts' worth of slices, so the smaller a part, the sooner the volume is done
        self.layout = VolumeStream(first, S3_MIN_PART, MAX_PARTS)
        self.completed = False
        self._dtype = np.dtype(first.dtype)
        self._upload = PartUpload(sink, f"{key}.npy")
        self._limiter = anyio.Semaphore(sink.parts_in_flight)
        self._waiting: dict[str, _Kept] = {}  # slices taken and in no part uploaded yet
        self._uploads = 0  # part uploads under way
        self._idle = anyio.Event()
        self._idle.set()
        # the volume ``finish`` uploaded the head and tail of, and its answer
        self._finished: tuple[tuple[tuple[str, ...], tuple[int, ...], str], bool] | None = None

    def take(self, member: Member, kept: _Kept) -> list[tuple[Part, list[tuple[str, _Kept]]]]:
        """Place one slice; the parts it completes, with their slices, to ``upload``."""
        self._waiting[member.sop_instance_uid] = kept
        return [
            (part, [(sop, self._waiting.pop(sop)) for sop in part.slices])
            for part in self.layout.add(member)
        ]

    async def upload(
        self, parts: list[tuple[Part, list[tuple[str, _Kept]]]]
    ) -> list[tuple[str, _Kept]]:
        """Upload the parts ``take`` cut; one that fails stops the stream (it is not raised:
        the volume is written whole at the end). Returns the slices uploaded."""
        done: list[tuple[str, _Kept]] = []
        if not parts:
            return done
        self._uploads += 1
        if self._uploads == 1:
            self._idle = anyio.Event()

        async def one(part: Part, slices: list[tuple[str, _Kept]]) -> None:
            await self._put(part.number, self._body([k for _, k in slices]))
            done.extend(slices)

        try:  # at once: a slice that ends a gap completes several parts
            await _all([functools.partial(one, part, slices) for part, slices in parts])
        except IngestError as exc:
            self.layout.stop(f"a part could not be uploaded: {exc}")
        finally:
            self._uploads -= 1
            if not self._uploads:
                self._idle.set()
        return done

    def expected(self) -> tuple[tuple[str, ...], tuple[int, ...], str]:
        """The volume of the slices streamed, as a plan of them all would make it: its slices
        in order, shape and type (``finish`` before the plan is known, when the data says
        the series is complete)."""
        order = self.layout.order
        return order, (len(order), *self.layout.slice_shape), self._dtype.str

    async def finish(self, order: Sequence[str], shape: tuple[int, ...], dtype: str) -> bool:
        """Upload the head (with the header) and the tail, when the volume of the slices
        ``order``, ``shape`` and ``dtype`` is the one streamed, and wait for the parts still
        going up; False when it is not, or a part failed (``layout.stopped`` says why): the
        volume is then written whole. Once finished, a call for the same volume returns
        the same answer; a call for another stops the stream.

        Raises:
            SinkError: the head or the tail could not be uploaded.
        """
        wanted = (tuple(order), tuple(shape), np.dtype(dtype).str)
        if self._finished is not None:
            volume, answer = self._finished
            if volume != wanted:
                self.layout.stop("the volume's slices are not those streamed, in their order")
                return False
            return answer and self.layout.stopped is None
        answer = await self._finish(*wanted)
        self._finished = wanted, answer
        return answer

    async def _finish(self, order: Sequence[str], shape: tuple[int, ...], dtype: str) -> bool:
        parts = self.layout.finish(order, shape, dtype)
        if parts is None:
            return False
        header = memoryview(npy_header(shape, dtype))

        async def put(part: Part) -> None:
            body = self._body([self._waiting[sop] for sop in part.slices])
            await self._put(part.number, [header, *body] if part.header else body)

        await _all([functools.partial(put, part) for part in parts])
        await self._settled()
        if not {p.number for p in self.layout.parts} <= set(self._upload.numbers):
            self.layout.stop(self.layout.stopped or "a part was not uploaded")
            return False
        return True

    async def complete(self) -> None:
        """Make the ``.npy`` of the parts (``finish`` uploaded the last of them).

        Raises:
            SinkError: the completion failed.
        """
        await self._upload.complete()
        self.completed = True

    async def abort(self) -> None:
        """Drop what was uploaded, once the parts under way are up."""
        await self._settled()
        await self._upload.abort()

    async def _put(self, number: int, body: list[memoryview]) -> None:
        async with self._limiter:  # as a whole write's parts: SINK_PARTS_IN_FLIGHT at once
            await self._upload.put(number, body)

    async def _settled(self) -> None:
        while self._uploads:
            await self._idle.wait()

    def _body(self, slices: list[_Kept]) -> list[memoryview]:
        return [
            np.ascontiguousarray(k.values.astype(self._dtype, copy=False))
            .reshape(-1)
            .view(np.uint8)
            .data
            for k in slices
        ]


class SeriesAssembler:
    """Gathers the slices of each series into versioned volumes (the module's docstring)."""

    def __init__(
        self,
        settings: Settings,
        sink: OutputSink,
        hook: SeriesHook | None = None,
        thread: DeviceThread | None = None,
    ) -> None:
        self._settings = settings
        self._sink = sink
        self._hook = hook  # SERIES_HOOK, given the volume's slabs on the device thread
        self._thread = thread
        self._root = f"{settings.output_prefix}series/"
        self._pending_root = f"{settings.output_prefix}series-pending/"
        self._manifest_root = f"{settings.output_prefix}series-manifests/"
        # the member records this process wrote or read, by series: active series only
        self._members: dict[SeriesId, dict[str, Member | None]] = {}
        # member records being written (a held slice's: until its shared record lands), by
        # series; the shared records of held members, by series
        self._adding: dict[SeriesId, int] = {}
        self._records: dict[SeriesId, _Records] = {}
        self._token = uuid.uuid4().hex[:12]  # this process's shared records' names
        self._markers: dict[SeriesId, _Marker] = {}  # the pending markers' PUTs, by series
        self._marker_lock = anyio.Lock()  # a marker is not deleted while an add decides on it
        self._manifests: dict[SeriesId, tuple[frozenset[str] | None, float]] = {}
        self._manifest_reads: dict[SeriesId, anyio.Lock] = {}
        self._due: dict[SeriesId, float] = {}  # when a series' quiet period ends
        self._forgetting: dict[SeriesId, list[str]] = {}  # written: ``_forget`` them
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # one assembly at a time
        # slices' values in memory: taken from the sink's writer (loose) until the slice's
        # sidecar says which series it is of; SERIES_MEMORY bytes at most in all
        self._loose: dict[str, _Kept] = {}
        self._kept: dict[SeriesId, dict[str, _Kept]] = {}
        self._memory = 0
        # volumes uploaded while their slices arrive, by series; the slices whose member
        # records this process writes, by series (a series' first slice here starts a stream
        # only when no other slice of it is recorded)
        self._streams: dict[SeriesId, _Stream] = {}
        self._background: TaskGroup | None = None  # their part uploads (``run``'s)
        self._ours: dict[SeriesId, set[str]] = {}
        self.volumes_written = 0
        self.volumes_streamed = 0
        self.holding = settings.series_slices == "hold"
        # a streamed slice's values are dropped once its part is up when nothing else needs
        # them: its own `.npy` (written) is read back should the volume be written whole
        self._drops_streamed = not self.holding and hook is None and settings.series_format == "npy"
        sink.keep = self.keep

    def volume_prefix(self, series: SeriesId) -> str:
        return f"{self._root}{series.path}/"

    def _pending(self, series: SeriesId) -> str:
        return f"{self._pending_root}{series.path}.json"

    @property
    def memory(self) -> int:
        """Bytes of slices' values this assembler keeps now."""
        return self._memory

    def keep(self, key: str, shape: tuple[int, ...], dtype: str) -> Writer | None:
        """The sink's writer of a one-frame output: one that keeps its values (and, unless
        slices are held, writes them), while ``SERIES_MEMORY`` has room; else None."""
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self._memory + size > self._settings.series_memory:
            return None
        self._memory += size
        inner = None if self.holding else ArrayWriter(self._sink, key, shape, dtype)
        return _KeepingWriter(self, key, shape, dtype, inner)

    def _free(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self._memory -= int(np.prod(shape)) * dtype.itemsize

    def _drop(self, kept: _Kept) -> None:
        self._free(kept.values.shape, kept.values.dtype)

    def discard(self, key: str) -> None:
        """Forget the values kept of output ``key`` (its object failed after they were)."""
        kept = self._loose.pop(key, None)
        if kept is not None:
            self._drop(kept)

    async def add(
        self, sidecar: Mapping[str, Any], partition: Partition | None = None
    ) -> Hold | None:
        """Record one instance's membership (before its offset is committed); write the
        volume now when this slice completes its series by the data's count or manifest.

        Returns the slice's ``Hold`` when its values are held, not yet durable: its
        offset must wait for it (``Hold.then``). None: nothing to wait for.

        A manifest that cannot be read, or a volume that cannot be written now, fails
        neither the slice nor its add: the series stays due after its quiet period.

        Raises:
            SinkError: a member record, marker or slice could not be written.
        """
        key = (sidecar.get("output") or {}).get("npy")
        kept = self._loose.pop(key, None) if key else None
        found = member_of(sidecar)
        if found is None:  # not a slice of a volume: its output is written now
            if kept is not None:
                if not kept.written:
                    await self._write_npy(str(key), kept.values)
                self._drop(kept)
            return None
        series, member = found
        held = kept is not None and not kept.written
        if held:
            member = dataclasses.replace(member, held=True)
        prefix = self.volume_prefix(series)
        self._ours.setdefault(series, set()).add(member.sop_instance_uid)
        async with self._marker_lock:  # not while this process removes the marker
            self._adding[series] = self._adding.get(series, 0) + 1  # nor until these land
        # A held slice's offset waits for a volume or its own output (a spill, which writes
        # the marker then): its record is written with other held slices', with no marker.
        if held:
            self._hold_record(series, member)
        else:
            try:
                await self._record(
                    series, f"{prefix}members/{member.sop_instance_uid}.json", member
                )
            finally:
                self._recorded(series, 1)
        members = self._members.get(series)
        first_sight, foreign = members is None, False
        if members is None:  # this process has not seen the series: what is durable already
            members = self._members[series] = {}
            records = self._records.setdefault(series, _Records())
            for found_key in await self._sink.keys(f"{prefix}members/"):
                if _shared(found_key):  # read now: how many slices it holds counts
                    foreign = foreign or found_key not in records.written
                    try:
                        shared = await self._shared_members(series, found_key)
                    except _BadRecord:  # the volume fails on it when planned, not this slice
                        continue
                    for them in shared:
                        members.setdefault(them.sop_instance_uid, them)
                    continue
                sop = _sop_of(found_key)
                members.setdefault(sop, None)  # read back when it is planned
                foreign = foreign or sop not in self._ours.get(series, ())
        members[member.sop_instance_uid] = member
        hold = None
        if kept is not None:
            if held:
                hold = kept.hold = Hold()
                kept.partition = partition
            slices = self._kept.setdefault(series, {})
            before = slices.pop(member.sop_instance_uid, None)
            if before is not None:  # the same instance again (redelivered)
                self._drop(before)
                if before.hold is not None:  # its offset is durable when this one is
                    if hold is None:
                        before.hold.release()
                    else:
                        hold.then(before.hold.release)
            slices[member.sop_instance_uid] = kept
        self._feed(series, member, kept, start=first_sight and not foreign)
        self._due[series] = time.monotonic() + self._settings.series_quiet_s
        self._wake.set()
        counts = (member.images_in_acquisition, member.volume_slices)
        try:
            manifest = await self._manifest(series, refresh_after=1.0)
            if any(c is not None and len(members) >= c for c in counts) or (
                manifest is not None and manifest <= members.keys()
            ):
                await self.assemble(series, quiet=False)
        except IngestError as exc:
            # this slice is durable (its record and the marker are): it is the volume that
            # failed, tried again when the quiet period ends, a held slice waiting for it
            log.warning("series volume failed", error=str(exc), reason=exc.reason)
        return hold if hold is not None and not hold.released else None

    async def spill(self, partitions: Sequence[Partition]) -> None:
        """Write the held slices of ``partitions`` as outputs of their own and release
        their offsets (the partitions are being taken away: ``Commits.revoking``).

        Raises:
            SinkError: a slice or its member record could not be written.
        """
        async with self._lock:
            for series in list(self._kept):
                await self._spill_series(series, lambda k: k.partition in partitions)

    async def _spill_series(self, series: SeriesId, which: Callable[[_Kept], bool]) -> None:
        """Write the held slices of ``series`` that ``which`` picks as outputs of their own
        (``.npy`` and a member record that says so), then release them."""
        slices = self._kept.get(series, {})
        members = self._members.get(series, {})
        chosen = [(sop, k) for sop, k in slices.items() if not k.written and which(k)]
        if chosen:  # these offsets are committed before their series is written
            await self._mark(series)
        errors: list[IngestError] = []
        for start in range(0, len(chosen), SLICES_IN_FLIGHT):
            batch = chosen[start : start + SLICES_IN_FLIGHT]

            async def one(sop: str, kept: _Kept) -> None:
                member = members.get(sop)
                try:
                    if member is None:  # read back: only this process's own are missing
                        raise _BadRecord(f"slice {sop} is held without its member record")
                    await self._write_npy(member.npy, kept.values)
                    written = dataclasses.replace(member, held=False)
                    record = f"{self.volume_prefix(series)}members/{sop}.json"
                    await self._sink.put_json(record, written.as_json())
                except IngestError as exc:  # raised below, ungrouped
                    errors.append(exc)
                    return
                members[sop] = written
                records = self._records.get(series)
                if records is not None and records.pending.pop(sop, None) is not None:
                    self._recorded(series, 1)  # its own record says more than that would
                kept.written = True
                if kept.hold is not None:
                    kept.hold.release()

            async with anyio.create_task_group() as group:
                for sop, kept in batch:
                    group.start_soon(one, sop, kept)
            if errors:
                raise errors[0]
        if chosen:
            log.info("series slices spilled", slices=len(chosen))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write each series whose quiet period has ended; pending markers of earlier
        runs are due one quiet period after the start."""
        started = time.monotonic()
        for key in await self._sink.keys(self._pending_root):
            series = _series_of(key[len(self._pending_root) :])
            if series is not None:
                self._due.setdefault(series, started + self._settings.series_quiet_s)
        async with anyio.create_task_group() as background:
            self._background = background
            task_status.started()
            try:
                while True:
                    await self._forget_written()
                    now = time.monotonic()
                    for series in [s for s, t in self._due.items() if t <= now]:
                        del self._due[series]
                        try:
                            await self.assemble(series, quiet=True)
                        except IngestError as exc:  # the marker stays: a later run tries again
                            log.warning("series volume failed", error=str(exc), reason=exc.reason)
                            self._due[series] = time.monotonic() + self._settings.series_quiet_s
                    wait = min(self._due.values(), default=now + 3600.0) - time.monotonic()
                    with anyio.move_on_after(max(wait, 0.0)):
                        await self._wake.wait()
                    self._wake = anyio.Event()
            finally:  # stopping: uploads of series not complete go (the next worker redoes them)
                streams, self._streams = list(self._streams.values()), {}
                for stream in streams:
                    await self._abandon(stream, "the worker stopped")
                with anyio.move_on_after(self._settings.read_timeout_s, shield=True):
                    await self._forget_written()

    async def assemble(self, series: SeriesId, *, quiet: bool) -> VolumePlan | None:
        """Plan the series from its member records and write the volume (once a version).

        ``quiet``: its quiet period has ended, so write what the members make; else
        only a series complete by the data's count or its manifest is written.
        Returns the plan acted on, None when the series is not complete yet or a
        slice of it is held by another worker (this one's held slices are then
        written as outputs of their own, so that one can).

        Raises:
            SinkError: reading the members or slices, or writing the volume, failed.
        """
        async with self._lock:
            prefix = self.volume_prefix(series)
            planned: list[tuple[list[str], VolumePlan]] = []

            async def plan() -> None:
                await self._flush_held(series)  # this process's held members: listed too
                keys = await self._sink.keys(f"{prefix}members/")
                members = await self._read_members(series, keys)
                manifest = await self._manifest(series, refresh_after=0.0 if quiet else None)
                planned.append((keys, plan_volume(series, members, manifest=manifest)))

            # When the data says the series is complete, the head and the tail of the volume
            # streamed go up while its members are listed and planned: the plan is that
            # volume but for a slice recorded by another worker, or one late or refused.
            stream = None if quiet else self._streams.pop(series, None)
            try:
                if stream is None:
                    await plan()
                else:
                    streamed = stream

                    async def head_and_tail() -> None:
                        await streamed.finish(*streamed.expected())

                    await _all([plan, head_and_tail])
                keys, found = planned[0]
                if not quiet and (not found.complete_by_data or found.refused):
                    return None
                if stream is None:
                    stream = self._streams.pop(series, None)  # settled here: completed or aborted
                return await self._write_plan(found, keys, quiet, stream)
            finally:
                if stream is not None and not stream.completed:
                    await self._abandon(stream, "the volume was not written from it")

    async def _write_plan(
        self, plan: VolumePlan, keys: list[str], quiet: bool, stream: _Stream | None
    ) -> VolumePlan | None:
        """``assemble``'s writing, under its lock: the volume, from ``stream`` when that was
        uploaded as the slices came and is this plan's volume, else whole; then its sidecar.

        Raises:
            SinkError: reading the slices, or writing the volume, failed.
        """
        series = plan.series
        prefix = self.volume_prefix(series)
        kept = self._kept.get(series, {})
        if any(m.held and m.sop_instance_uid not in kept for m in plan.members):
            # held elsewhere (another worker's memory, or a worker gone: its slices are
            # redelivered) or already in a volume of this series
            found = await self._in_volumes(series, plan.members, kept)
            if found is None:
                if quiet:  # this worker's held slices become readable by the other
                    await self._spill_series(series, lambda _: True)
                    self._due[series] = time.monotonic() + self._settings.series_quiet_s
                    self._wake.set()
                return None
        else:
            found = {}
        sidecar_key = f"{prefix}{plan.version}.json"
        if stream is not None and plan.refused:
            stream.layout.stop(f"the volume is refused: {plan.refused[0]}")
        # Each version is written once. A stream's last parts go up while that is looked
        # up: they are aborted with it when the version is there already.
        written = streamed = False

        async def look() -> None:
            nonlocal written
            written = bool(await self._sink.keys(sidecar_key))

        async def finish() -> None:
            nonlocal streamed
            streamed = stream is not None and await stream.finish(
                [m.sop_instance_uid for m in plan.members], plan.shape, plan.dtype
            )

        await _all([look, finish] if stream is not None and not plan.refused else [look])
        if stream is not None and written:
            stream.layout.stop("its version is written already")
        if not written:
            npy_key = nifti_key = None
            if not plan.refused:
                base = stream.key if stream is not None and streamed else prefix + plan.version
                npy, nifti = self._formats(plan.shape, plan.dtype)
                npy_key = f"{base}.npy" if npy else None
                nifti_key = f"{base}.nii.gz" if nifti else None
                if stream is not None and streamed:
                    if nifti_key is not None or self._hook is not None:
                        await self._write_volume(plan, None, nifti_key, found)
                    await stream.complete()  # the .npy is durable
                    self.volumes_streamed += 1
                else:
                    await self._write_volume(plan, npy_key, nifti_key, found)
            document = plan.as_json(npy_key, nifti_key)
            # at once: a latest.json without its version's sidecar (a kill between them) is
            # written again with the version, which is not taken as written without it
            await _all(
                [
                    lambda: self._sink.put_json(sidecar_key, document),
                    lambda: self._sink.put_json(f"{prefix}latest.json", document),
                ]
            )
            self.volumes_written += 1
            log.info(
                "series volume written",
                slices=len(plan.members),
                version=plan.version,
                refused=len(plan.refused),
                streamed=stream is not None and stream.completed,
            )
        # the volume is durable: its held slices are released; the rest of this
        # series' held slices (duplicates, left out, a refused plan) get outputs of
        # their own
        in_volume = {m.sop_instance_uid for m in plan.members}
        for sop in [s for s in kept if s in in_volume]:
            done = kept.pop(sop)
            self._drop(done)
            if done.hold is not None:
                done.hold.release()
        await self._spill_series(series, lambda _: True)
        for sop in [s for s, k in kept.items() if k.written]:  # read back if needed again
            self._drop(kept.pop(sop))
        if quiet or plan.complete_by_data:  # by ``run``, after the slice that completed it
            self._forgetting[series] = keys
            self._wake.set()
        return plan

    def _feed(self, series: SeriesId, member: Member, kept: _Kept | None, *, start: bool) -> None:
        """Give one slice to the volume its series streams here (``start``: the series' first
        slice here, none of it recorded by others, starts one). The parts it completes go up
        in the background (``run``'s task group): a slice never waits for them; a stream
        that stops is aborted there (its volume is written whole)."""
        stream = self._streams.get(series)
        if start and kept is not None and self._formats(member.shape, member.dtype)[0]:
            key = f"{self.volume_prefix(series)}stream-{uuid.uuid4().hex[:16]}"
            stream = self._streams[series] = _Stream(self._sink, key, member)
            # The slices of the series that came while this one listed its members passed
            # here before the stream was; this one among them.
            members = self._members[series]
            parts = [
                part
                for sop, their in self._kept.get(series, {}).items()
                if (them := members.get(sop)) is not None
                for part in stream.take(them, their)
            ]
        elif stream is None:
            return
        elif kept is None:  # past SERIES_MEMORY: its values are not here to upload
            stream.layout.stop("a slice not kept in memory")
            parts = []
        else:
            parts = stream.take(member, kept)
        assert self._background is not None  # run() is started before any slice comes
        if parts:
            self._background.start_soon(self._upload, series, stream, parts)
        elif stream.layout.stopped is not None and self._streams.get(series) is stream:
            del self._streams[series]
            self._background.start_soon(self._abandon, stream, stream.layout.stopped)

    async def _upload(
        self, series: SeriesId, stream: _Stream, parts: list[tuple[Part, list[tuple[str, _Kept]]]]
    ) -> None:
        """Upload parts a slice completed; then abort the stream if it stopped (unless an
        assembly has it), or drop the slices uploaded when nothing else needs them."""
        uploaded = await stream.upload(parts)
        if stream.layout.stopped is not None:
            if self._streams.get(series) is stream:  # else an assembly settles it
                del self._streams[series]
                await self._abandon(stream, stream.layout.stopped)
            return
        slices = self._kept.get(series, {})
        for sop, done in uploaded if self._drops_streamed else ():
            if slices.get(sop) is done and done.written:
                del slices[sop]
                self._drop(done)

    async def _abandon(self, stream: _Stream, why: str) -> None:
        """Abort a stream's upload: its volume is written whole, or not at all."""
        stream.layout.stop(why)
        log.info(
            "series volume not streamed",
            reason=stream.layout.stopped,
            slices=stream.layout.slices,
            parts=len(stream.layout.parts),
        )
        with anyio.move_on_after(self._settings.read_timeout_s, shield=True):
            await stream.abort()

    def _formats(self, shape: tuple[int, ...], dtype: str) -> tuple[bool, bool]:
        """Whether a volume of ``shape`` (or its slices') and ``dtype`` is written as ``.npy``,
        and as ``.nii.gz`` (``SERIES_FORMAT``; a colour volume as ``.npy`` only)."""
        formats = self._settings.series_format
        nifti = formats in ("nifti", "both") and _nifti_able(shape, dtype)
        return formats in ("npy", "both") or not nifti, nifti

    async def _forget_written(self) -> None:
        """``_forget`` the series written since the last call. A marker that stays (an error,
        or a stop before this) only makes its series due again after the quiet period,
        which finds its version written."""
        while self._forgetting:
            series, keys = self._forgetting.popitem()
            try:
                async with self._lock:
                    await self._forget(series, keys)
            except IngestError as exc:
                log.warning("series marker not removed", error=str(exc), reason=exc.reason)

    async def _forget(self, series: SeriesId, keys: list[str]) -> None:
        """Done with ``series``, unless a member came since its members were ``keys``:
        its pending marker goes, and what this process knew of it."""
        members = f"{self.volume_prefix(series)}members/"
        async with self._marker_lock:
            if series in self._adding:
                return
            if await self._sink.keys(members) != keys:
                return  # one came meanwhile: its marker stays
            await self._sink.delete(self._pending(series))
            # Another worker's member record that landed after the listing above, its
            # marker's PUT before the delete, is listed now: the marker goes back. One that
            # lands after this listing is followed by its own marker's PUT (``_record``),
            # which lands after the delete.
            if await self._sink.keys(members) != keys:
                await self._sink.put_json(self._pending(series), _series_json(series))
                return
            self._markers.pop(series, None)  # no add is marking it: none is adding
            self._members.pop(series, None)
            self._ours.pop(series, None)
            self._records.pop(series, None)  # none pending: none is adding
            self._manifests.pop(series, None)
            self._manifest_reads.pop(series, None)
            self._due.pop(series, None)
            for left in self._kept.pop(series, {}).values():
                self._drop(left)

    async def _record(self, series: SeriesId, key: str, member: Member) -> None:
        """PUT a member record and then make sure of the series' pending marker: a marker
        PUT that lands is never older than the record it covers, which another worker's
        ``_forget`` relies on.

        Raises:
            SinkError: one of them could not be written.
        """
        await self._sink.put_json(key, member.as_json())
        await self._mark(series)

    def _recorded(self, series: SeriesId, count: int) -> None:
        """``count`` member records of ``series`` landed (or failed): no longer being added."""
        left = self._adding[series] - count
        if left:
            self._adding[series] = left
        else:
            del self._adding[series]

    def _hold_record(self, series: SeriesId, member: Member) -> None:
        """Have a held member's record written with others' (``_write_held``); it counts as
        being added (``_adding``, counted by the caller) until it lands."""
        records = self._records.setdefault(series, _Records())
        if member.sop_instance_uid in records.pending:  # redelivered: the record is pending
            self._recorded(series, 1)
        records.pending[member.sop_instance_uid] = member
        if len(records.pending) >= HELD_RECORD_MEMBERS:
            records.full.set()
        if not records.writing:
            records.writing = True
            assert self._background is not None  # run() is started before any slice comes
            self._background.start_soon(self._write_held, series, records)

    async def _write_held(self, series: SeriesId, records: _Records) -> None:
        """Write the series' pending held records, each batch ``HELD_RECORD_LINGER_S`` after
        the first of it came (sooner when full), until none is pending. One that fails
        stays pending, written with the next (or by the volume's ``_flush_held``)."""
        try:
            while records.pending:
                with anyio.move_on_after(HELD_RECORD_LINGER_S):
                    await records.full.wait()
                try:
                    await self._flush_held(series)
                except IngestError as exc:
                    log.warning("held member records not written", error=str(exc))
        finally:
            records.writing = False

    async def _flush_held(self, series: SeriesId) -> None:
        """Write the held members of ``series`` pending now as one shared record; return
        once every one pending at the call has landed.

        Raises:
            SinkError: the record could not be written (its members stay pending, as they
                do when the call is cancelled).
        """
        records = self._records.get(series)
        if records is None:
            return
        async with records.lock:  # after a write under way, which may hold fewer
            if not records.pending:
                return
            batch, records.pending = records.pending, {}
            records.full = anyio.Event()
            number, records.count = records.count, records.count + 1
            name = f"{_HELD_RECORD_PREFIX}{self._token}-{number:06d}.json"
            key = f"{self.volume_prefix(series)}members/{name}"
            try:
                await self._sink.put_json(key, {"members": [m.as_json() for m in batch.values()]})
            except BaseException:  # failed or cancelled: pending again, for the next write
                for sop, member in batch.items():  # unless one came again meanwhile
                    if records.pending.setdefault(sop, member) is not member:
                        self._recorded(series, 1)
                raise
            records.written[key] = tuple(batch)
            self._recorded(series, len(batch))

    async def _shared_members(self, series: SeriesId, key: str) -> tuple[Member, ...]:
        """The members a shared record holds: this process's own as it knows them now,
        another's read (once).

        Raises:
            SinkError: it could not be read, or is not a member record.
        """
        records = self._records.setdefault(series, _Records())
        ours = records.written.get(key)
        if ours is not None:
            known = self._members.get(series, {})
            return tuple(m for sop in ours if (m := known.get(sop)) is not None)
        found = records.read.get(key)
        if found is None:
            data = await self._sink.get(key)
            if data is None:
                return ()  # removed meanwhile
            try:
                found = tuple(member_from_json(m) for m in json.loads(data)["members"])
            except (KeyError, TypeError, ValueError) as exc:
                raise _BadRecord(f"shared member record {_sop_of(key)} is unreadable") from exc
            records.read[key] = found
        return found

    async def _mark(self, series: SeriesId) -> None:
        """PUT the series' pending marker; return once a PUT of it that began after this
        call has landed. Every committed slice writes it again (another worker may have
        removed it, its volume written, while this one's slices of the series still come);
        calls that meet while one PUT is going share the next.

        Raises:
            SinkError: the marker could not be written.
        """
        marker = self._markers.setdefault(series, _Marker())
        marker.asked += 1
        wanted = marker.asked
        async with marker.lock:
            if marker.landed >= wanted:
                return
            begun = marker.asked  # every call made so far is answered by this PUT
            await self._sink.put_json(self._pending(series), _series_json(series))
            marker.landed = max(marker.landed, begun)

    async def _manifest(
        self, series: SeriesId, refresh_after: float | None
    ) -> frozenset[str] | None:
        """The series' manifest (``series-manifests/SERIES_INSTANCE_UID.json``), read once it
        is there; while it is not, read again when ``refresh_after`` seconds have passed
        (None: only the first time).

        Raises:
            SinkError: the read failed for good, or the manifest is not one.
        """
        now = time.monotonic()

        def known() -> tuple[bool, frozenset[str] | None]:
            found = self._manifests.get(series)
            if found is not None and (
                found[0] is not None or refresh_after is None or now - found[1] < refresh_after
            ):
                return True, found[0]
            return False, None

        done, manifest = known()
        if done:
            return manifest
        # one read at a time: the slices that come meanwhile take its answer
        async with self._manifest_reads.setdefault(series, anyio.Lock()):
            done, manifest = known()
            if done:
                return manifest
            began = time.monotonic()
            data = await self._sink.get(f"{self._manifest_root}{series.series}.json")
            if data is not None:
                try:
                    manifest = manifest_of(json.loads(data))
                except ValueError as exc:  # json.JSONDecodeError is one
                    raise _BadRecord(f"the manifest of a series is unreadable: {exc}") from exc
            self._manifests[series] = (manifest, began)
        return manifest

    async def _in_volumes(
        self, series: SeriesId, members: Sequence[Member], kept: Mapping[str, _Kept]
    ) -> dict[str, tuple[str, int, tuple[int, ...], str]] | None:
        """Where the held members not in memory here are in volumes of ``series`` already
        written (key, index, the volume's shape and dtype), or None when one is in none."""
        prefix = self.volume_prefix(series)
        wanted = {m.sop_instance_uid for m in members if m.held and m.sop_instance_uid not in kept}
        found: dict[str, tuple[str, int, tuple[int, ...], str]] = {}
        for key in sorted(await self._sink.keys(prefix), reverse=True):
            rest = key[len(prefix) :]
            if "/" in rest or not rest.endswith(".json") or rest == "latest.json":
                continue
            data = await self._sink.get(key)
            if data is None:
                continue
            try:
                document = json.loads(data)
                npy = document["npy"]
                shape = tuple(int(v) for v in document["shape"])
                sops = [str(s["sop_instance_uid"]) for s in document["slices"]]
                dtype = str(document["dtype"])
            except (KeyError, TypeError, ValueError) as exc:
                raise _BadRecord("a volume's sidecar is unreadable") from exc
            if npy is None:
                continue
            for index, sop in enumerate(sops):
                if sop in wanted:
                    found.setdefault(sop, (str(npy), index, shape, dtype))
            if wanted <= found.keys():
                return found
        return None

    async def _write_npy(self, key: str, values: np.ndarray) -> None:
        """One slice's own ``.npy`` (a held slice written after all).

        Raises:
            SinkError: the write failed.
        """
        async with ArrayWriter(self._sink, key, values.shape, str(values.dtype)) as out:
            await out.write(values)

    async def _read_members(self, series: SeriesId, keys: list[str]) -> list[Member]:
        """The member records under ``keys``: this process's own, the rest read back (again
        for one held elsewhere: its worker may have written it since). A slice's own
        record wins over a shared one (it is written later: a held slice spilled)."""
        known = self._members.setdefault(series, {})
        kept = self._kept.get(series, {})
        out: dict[str, Member] = {}
        for key in [k for k in keys if _shared(k)]:
            for recorded in await self._shared_members(series, key):
                sop = recorded.sop_instance_uid
                current = known.get(sop)
                if current is None or (current.held and sop not in kept):
                    known[sop] = current = recorded
                out[sop] = current
        for key in [k for k in keys if not _shared(k)]:
            sop = _sop_of(key)
            member = known.get(sop)
            if member is None or (member.held and sop not in kept):
                data = await self._sink.get(key)
                if data is None:
                    continue  # removed meanwhile
                try:
                    member = member_from_json(json.loads(data))
                except (KeyError, TypeError, ValueError) as exc:
                    raise _BadRecord(f"member record {sop} is unreadable") from exc
                known[sop] = member
            out[sop] = member
        return list(out.values())

    async def _write_volume(
        self,
        plan: VolumePlan,
        npy_key: str | None,
        nifti_key: str | None,
        found: Mapping[str, tuple[str, int, tuple[int, ...], str]],
    ) -> None:
        """Stream the slices, in order, into the ``.npy`` (multipart when large) and the
        ``.nii.gz``, ``SLICES_IN_FLIGHT`` at a time: from memory where they are kept, else
        read back (their own outputs, or a volume that holds them)."""
        async with contextlib.AsyncExitStack() as stack:
            out = None
            if npy_key is not None:
                out = await stack.enter_async_context(
                    ArrayWriter(self._sink, npy_key, plan.shape, plan.dtype)
                )
            nifti = _NiftiWriter(plan) if nifti_key is not None else None
            for start in range(0, len(plan.members), SLICES_IN_FLIGHT):
                batch = plan.members[start : start + SLICES_IN_FLIGHT]
                arrays = [
                    a.astype(plan.dtype, copy=False)
                    for a in await self._read_slices(plan.series, batch, plan.shape[1:], found)
                ]
                slab = np.concatenate(arrays)
                if out is not None:
                    await out.write(slab)
                if nifti is not None:
                    await anyio.to_thread.run_sync(nifti.add, slab)
                if self._hook is not None:  # its own copy: the writers keep views of theirs
                    await self._to_hook(plan, start, np.concatenate(arrays))
            if nifti is not None and nifti_key is not None:
                body = await anyio.to_thread.run_sync(nifti.finish)
                await self._sink.put(nifti_key, body, NIFTI_TYPE)

    async def _to_hook(self, plan: VolumePlan, first: int, slab: np.ndarray) -> None:
        """Hand one slab to ``SERIES_HOOK`` on the device thread, copied to the device.

        Raises:
            ProcessingError: the hook raised (the volume is tried again later).
        """
        hook, thread, affine = self._hook, self._thread, plan.affine
        assert hook is not None
        assert thread is not None
        assert affine is not None  # a refused plan writes no volume
        series = plan.series

        def give() -> None:  # on the device thread
            array: Any = slab
            if thread.backend == "cuda":
                import cupy

                array = cupy.asarray(slab)
            hook(
                HookSlab(
                    series.study,
                    series.series,
                    series.frame_of_reference,
                    plan.version,
                    plan.shape,
                    plan.dtype,
                    affine,
                    first,
                    len(slab),
                    thread.backend,
                    array,
                )
            )

        try:
            await asyncio.wrap_future(thread.call(give))
        except Exception as exc:
            raise ProcessingError(f"SERIES_HOOK raised {type(exc).__name__}: {exc}") from exc

    async def _read_slices(
        self,
        series: SeriesId,
        members: tuple[Member, ...],
        rows: tuple[int, ...],
        found: Mapping[str, tuple[str, int, tuple[int, ...], str]],
    ) -> list[np.ndarray]:
        """The slices' arrays, in their order: kept ones from memory, the rest read back
        at once.

        Raises:
            SinkError: a slice could not be read, or is not the shape planned.
        """
        kept = self._kept.get(series, {})
        values: list[np.ndarray | None] = [None] * len(members)
        errors: list[IngestError] = []

        async def read(index: int, member: Member) -> None:
            try:
                values[index] = await self._read_slice(member, rows, found)
            except IngestError as exc:  # raised below, ungrouped
                errors.append(exc)

        async with anyio.create_task_group() as group:
            for index, member in enumerate(members):
                held = kept.get(member.sop_instance_uid)
                if held is not None:
                    values[index] = held.values
                else:
                    group.start_soon(read, index, member)
        if errors:
            raise errors[0]
        out = [v for v in values if v is not None]
        for member, array in zip(members, out, strict=True):
            if array.shape != (1, *rows):
                raise _BadRecord(
                    f"slice {member.sop_instance_uid} has shape {array.shape}, not {(1, *rows)}"
                )
        return out

    async def _read_slice(
        self,
        member: Member,
        rows: tuple[int, ...],
        found: Mapping[str, tuple[str, int, tuple[int, ...], str]],
    ) -> np.ndarray:
        where = found.get(member.sop_instance_uid) if member.held else None
        if where is not None:  # a slice of a volume already written
            key, index, shape, dtype = where
            size = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
            offset = len(npy_header(shape, dtype)) + index * size
            data = await self._sink.get(key, offset, size)
            if data is None or len(data) != size:
                raise _BadRecord(f"slice {member.sop_instance_uid}'s volume is gone")
            return np.frombuffer(data, dtype=dtype).reshape(1, *shape[1:])
        data = await self._sink.get(member.npy)
        if data is None:
            raise _BadRecord(f"slice {member.sop_instance_uid}'s output is gone")
        values: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
        return values


class _NiftiWriter:
    """A volume's ``.nii.gz``, gzipped slab by slab (in a worker thread) as it is written.

    The compressed bytes are held until the volume's last slab: a gzip's length is
    not known before, and they are at most the volume's own bytes. The gzip header
    has no time or name in it, so the same volume gives the same bytes.
    """

    def __init__(self, plan: VolumePlan) -> None:
        assert plan.affine is not None  # a refused plan writes no volume
        dtype = nifti_dtype(plan.dtype)
        assert dtype is not None
        self._dtype = dtype
        self._zip = zlib.compressobj(NIFTI_GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: gzip
        self._out = [self._zip.compress(nifti_header(plan.shape, dtype, plan.affine))]

    def add(self, slab: np.ndarray) -> None:
        self._out.append(self._zip.compress(slab.astype(self._dtype, copy=False).tobytes()))

    def finish(self) -> list[memoryview]:
        self._out.append(self._zip.flush())
        return [memoryview(b) for b in self._out if b]


def _nifti_able(shape: tuple[int, ...], dtype: str) -> bool:
    """Whether a volume (or its slices) can be a NIfTI-1 image (monochrome, a type it has)."""
    return len(shape) == 3 and nifti_dtype(dtype) is not None


class _BadRecord(SinkError):
    retriable = False


@dataclass(slots=True)
class _Marker:
    """A series' pending marker's PUTs in this process: ``asked``, the calls of ``_mark``
    so far; ``landed``, how many of them the last PUT that landed answers (it began
    after them)."""

    lock: anyio.Lock = dataclasses.field(default_factory=anyio.Lock)
    asked: int = 0
    landed: int = 0


@dataclass(slots=True)
class _Records:
    """A series' shared member records (``members/held-TOKEN-N.json``) in this process: the
    held members waiting for one, those it wrote (their slices) and those of others it
    read (a record is written once: it never changes)."""

    pending: dict[str, Member] = dataclasses.field(default_factory=dict)
    written: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    read: dict[str, tuple[Member, ...]] = dataclasses.field(default_factory=dict)
    lock: anyio.Lock = dataclasses.field(default_factory=anyio.Lock)
    full: anyio.Event = dataclasses.field(default_factory=anyio.Event)  # write now
    writing: bool = False  # a task of ``run``'s writes the pending ones
    count: int = 0  # records written: the next one's number


async def _all(calls: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run ``calls`` at once; the first error of theirs is raised, ungrouped.

    Raises:
        IngestError: one of them failed.
    """
    errors: list[IngestError] = []

    async def one(call: Callable[[], Awaitable[None]]) -> None:
        try:
            await call()
        except IngestError as exc:  # raised below, ungrouped
            errors.append(exc)

    async with anyio.create_task_group() as group:
        for call in calls:
            group.start_soon(one, call)
    if errors:
        raise errors[0]


def _sop_of(key: str) -> str:
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def _shared(key: str) -> bool:
    """Whether a member record's key is a shared record of held members, not one slice's."""
    return key.rsplit("/", 1)[-1].startswith(_HELD_RECORD_PREFIX)


def _series_json(series: SeriesId) -> dict[str, str]:
    return {
        "study_instance_uid": series.study,
        "series_instance_uid": series.series,
        "frame_of_reference_uid": series.frame_of_reference,
    }


def _series_of(path: str) -> SeriesId | None:
    parts = path.removesuffix(".json").split("/")
    return SeriesId(*parts) if len(parts) == 3 and all(parts) else None
