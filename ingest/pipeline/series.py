"""Series volumes, the IO: member records, pending markers, volumes written slice by slice.

With ``SERIES=volume`` every slice's sidecar (``ingest.sink.series.member_of``)
also leaves a member record under ``OUTPUT_URL + "series/" + STUDY/SERIES/FRAME_OF_REFERENCE
+ "/members/" + SOP + ".json"`` and a pending marker under ``series-pending/``,
both before the slice's offset is committed: the assembly's whole state is
durable outputs, so a worker killed at any point, or a partition that moves to
another worker, loses nothing. Then:

- when the data says the series is complete (Images in Acquisition), the slice
  that completes it writes the volume before its own offset is committed;
- else, ``SERIES_QUIET_S`` after a series' last slice arrived here, the
  assembler plans it from its member records (those of every worker) and
  writes what they make; at start-up, every pending marker is due after the
  same quiet period, so a series whose quiet period was cut short by a crash
  or a rebalance is still written.

A volume is ``.../VERSION.npy`` + ``.../VERSION.json`` (and ``latest.json``, a copy
of the newest sidecar written); its version names its members and their bytes,
so it is written once (an existing sidecar of that version is left as it is)
and a late slice makes a new version beside it. Its slices are read back
``SLICES_IN_FLIGHT`` at a time and streamed into one multipart upload, so the
assembler holds that many slices and the sink's parts in flight, whatever the
volume's size. A plan
the checks refuse (gaps, uneven steps, mixed sizes) is written as a sidecar
with ``npy`` null and the reasons.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Mapping
from typing import Any, Final

import anyio
import numpy as np
import structlog
from anyio.abc import TaskStatus

from ingest.errors import IngestError, ProcessingError, SinkError
from ingest.hooks import HookSlab, SeriesHook
from ingest.settings import Settings
from ingest.sink.output import OutputSink
from ingest.sink.series import (
    Member,
    SeriesId,
    VolumePlan,
    member_from_json,
    member_of,
    plan_volume,
)
from ingest_gpu.thread import DeviceThread

log = structlog.get_logger("ingest.series")

SLICES_IN_FLIGHT: Final = 8  # slices read back at once (the assembler's memory: as many)


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
        # the member records this process wrote or read, by series: active series only
        self._members: dict[SeriesId, dict[str, Member | None]] = {}
        self._due: dict[SeriesId, float] = {}  # when a series' quiet period ends
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # one assembly at a time
        self.volumes_written = 0

    def volume_prefix(self, series: SeriesId) -> str:
        return f"{self._root}{series.path}/"

    def _pending(self, series: SeriesId) -> str:
        return f"{self._pending_root}{series.path}.json"

    async def add(self, sidecar: Mapping[str, Any]) -> None:
        """Record one instance's membership (before its offset is committed); write the
        volume now when this slice completes its series by the data's count.

        Raises:
            SinkError: a member record, marker or volume could not be written.
        """
        found = member_of(sidecar)
        if found is None:
            return
        series, member = found
        prefix = self.volume_prefix(series)
        record = f"{prefix}members/{member.sop_instance_uid}.json"
        errors: list[IngestError] = []

        async def put(key: str, document: Mapping[str, Any]) -> None:
            try:
                await self._sink.put_json(key, document)
            except IngestError as exc:  # raised below, ungrouped
                errors.append(exc)

        async with anyio.create_task_group() as group:  # the two PUTs at once
            group.start_soon(put, record, member.as_json())
            group.start_soon(put, self._pending(series), _series_json(series))
        if errors:
            raise errors[0]
        members = self._members.get(series)
        if members is None:  # this process has not seen the series: what is durable already
            members = self._members[series] = {}
            for key in await self._sink.keys(f"{prefix}members/"):
                members.setdefault(_sop_of(key), None)  # read back when it is planned
        members[member.sop_instance_uid] = member
        self._due[series] = time.monotonic() + self._settings.series_quiet_s
        self._wake.set()
        total = member.images_in_acquisition
        if total is not None and len(members) >= total:
            await self.assemble(series, quiet=False)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write each series whose quiet period has ended; pending markers of earlier
        runs are due one quiet period after the start."""
        started = time.monotonic()
        for key in await self._sink.keys(self._pending_root):
            series = _series_of(key[len(self._pending_root) :])
            if series is not None:
                self._due.setdefault(series, started + self._settings.series_quiet_s)
        task_status.started()
        while True:
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

    async def assemble(self, series: SeriesId, *, quiet: bool) -> VolumePlan | None:
        """Plan the series from its member records and write the volume (once a version).

        ``quiet``: its quiet period has ended, so write what the members make; else
        only a series complete by the data's count is written. Returns the plan
        acted on, None when the series is not complete yet.

        Raises:
            SinkError: reading the members or slices, or writing the volume, failed.
        """
        async with self._lock:
            prefix = self.volume_prefix(series)
            keys = await self._sink.keys(f"{prefix}members/")
            members = await self._read_members(series, keys)
            plan = plan_volume(series, members)
            if not quiet and (not plan.complete_by_data or plan.refused):
                return None
            sidecar_key = f"{prefix}{plan.version}.json"
            if not await self._sink.keys(sidecar_key):  # each version is written once
                npy_key = None
                if not plan.refused:
                    npy_key = f"{prefix}{plan.version}.npy"
                    await self._write_volume(plan, npy_key)
                document = plan.as_json(npy_key)
                await self._sink.put_json(sidecar_key, document)
                await self._sink.put_json(f"{prefix}latest.json", document)
                self.volumes_written += 1
                log.info(
                    "series volume written",
                    slices=len(plan.members),
                    version=plan.version,
                    refused=len(plan.refused),
                )
            done = quiet or plan.complete_by_data
            if done and await self._sink.keys(f"{prefix}members/") == keys:  # none came since
                await self._sink.delete(self._pending(series))
                self._members.pop(series, None)
                self._due.pop(series, None)
            return plan

    async def _read_members(self, series: SeriesId, keys: list[str]) -> list[Member]:
        """The member records under ``keys``: this process's own, the rest read back."""
        known = self._members.setdefault(series, {})
        out: list[Member] = []
        for key in keys:
            sop = _sop_of(key)
            member = known.get(sop)
            if member is None:
                data = await self._sink.get(key)
                if data is None:
                    continue  # removed meanwhile
                try:
                    member = member_from_json(json.loads(data))
                except (KeyError, TypeError, ValueError) as exc:
                    raise _BadRecord(f"member record {sop} is unreadable") from exc
                known[sop] = member
            out.append(member)
        return out

    async def _write_volume(self, plan: VolumePlan, key: str) -> None:
        """Stream the slices, in order, into one ``.npy`` (multipart when large), reading
        them back ``SLICES_IN_FLIGHT`` at a time while the sink's parts go up."""
        async with self._sink.array(key, plan.shape, plan.dtype) as out:
            for start in range(0, len(plan.members), SLICES_IN_FLIGHT):
                batch = plan.members[start : start + SLICES_IN_FLIGHT]
                arrays = [
                    a.astype(plan.dtype, copy=False)
                    for a in await self._read_slices(batch, plan.shape[1:])
                ]
                for array in arrays:
                    await out.write(array)
                if self._hook is not None:
                    await self._to_hook(plan, start, np.concatenate(arrays))

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
        self, members: tuple[Member, ...], rows: tuple[int, ...]
    ) -> list[np.ndarray]:
        """The slices' arrays, read back at once, in their order.

        Raises:
            SinkError: a slice could not be read, or is not the shape planned.
        """
        values: list[np.ndarray | None] = [None] * len(members)
        errors: list[IngestError] = []

        async def read(index: int, member: Member) -> None:
            try:
                values[index] = await self._read_slice(member, rows)
            except IngestError as exc:  # raised below, ungrouped
                errors.append(exc)

        async with anyio.create_task_group() as group:
            for index, member in enumerate(members):
                group.start_soon(read, index, member)
        if errors:
            raise errors[0]
        return [v for v in values if v is not None]

    async def _read_slice(self, member: Member, rows: tuple[int, ...]) -> np.ndarray:
        data = await self._sink.get(member.npy)
        if data is None:
            raise _BadRecord(f"slice {member.sop_instance_uid}'s output is gone")
        values: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
        if values.shape != (1, *rows):
            raise _BadRecord(
                f"slice {member.sop_instance_uid} has shape {values.shape}, not {(1, *rows)}"
            )
        return values


class _BadRecord(SinkError):
    retriable = False


def _sop_of(key: str) -> str:
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def _series_json(series: SeriesId) -> dict[str, str]:
    return {
        "study_instance_uid": series.study,
        "series_instance_uid": series.series,
        "frame_of_reference_uid": series.frame_of_reference,
    }


def _series_of(path: str) -> SeriesId | None:
    parts = path.removesuffix(".json").split("/")
    return SeriesId(*parts) if len(parts) == 3 and all(parts) else None
