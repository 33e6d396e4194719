"""DeviceStage batching: a lone chunk goes at once, chunks gather while the device is busy,
up to ``batch_max_objects`` chunks and ``batch_max_bytes`` of their bytes.

The device thread is replaced by a twin whose batches finish only when the
test says so, so what is checked is the stage's policy, not timing.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
from dataclasses import dataclass
from typing import Any, cast

import anyio
import pytest

from ingest.device.stage import BATCHES_IN_FLIGHT, DeviceStage
from ingest.settings import load_settings
from ingest_gpu.jobs import ChunkJob, ChunkResult
from ingest_gpu.thread import DeviceThread

pytestmark = pytest.mark.anyio
MiB = 1024 * 1024


@dataclass
class Job:
    """What the stage reads of a ``ChunkJob``: its bytes, that it holds no codestreams,
    and ``on_consumed``."""

    label: int
    data: memoryview
    consumed: list[int]
    encoded: None = None

    def on_consumed(self) -> None:
        self.consumed.append(self.label)


def job(label: int, nbytes: int = 0, consumed: list[int] | None = None) -> ChunkJob:
    data = memoryview(bytearray(nbytes))
    return cast(ChunkJob, Job(label, data, consumed if consumed is not None else []))


class HeldThread:
    """A device-thread twin: records each batch; each finishes when ``finish`` is called."""

    backend = "cpu"

    def __init__(self) -> None:
        self._arrived = anyio.Event()
        self.batches: list[list[Job]] = []
        self.futures: list[concurrent.futures.Future[list[ChunkResult | BaseException]]] = []

    def submit(
        self, jobs: list[Any]
    ) -> concurrent.futures.Future[list[ChunkResult | BaseException]]:
        self.batches.append(list(jobs))
        future: concurrent.futures.Future[list[ChunkResult | BaseException]] = (
            concurrent.futures.Future()
        )
        self.futures.append(future)
        self._arrived.set()  # the stage submits on the event loop
        return future

    def labels(self) -> list[list[int]]:
        return [[j.label for j in batch] for batch in self.batches]

    async def wait_for(self, count: int) -> None:
        """Until ``count`` batches have been submitted (5 s at most)."""
        with anyio.fail_after(5):
            while len(self.batches) < count:
                self._arrived = anyio.Event()
                await self._arrived.wait()

    def finish(self, index: int) -> None:
        jobs = self.batches[index]
        self.futures[index].set_result(
            [ChunkResult(None, None, "cpu", float(j.label), 0.0, 0.0) for j in jobs]
        )


def stage(thread: HeldThread, **overrides: Any) -> DeviceStage:
    env = {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9",
        "DICOM_INGEST_OUTPUT_URL": "s3://out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
        "DICOM_INGEST_BATCH_MAX_OBJECTS": "4",
        **{f"DICOM_INGEST_{name.upper()}": value for name, value in overrides.items()},
    }
    return DeviceStage(cast(DeviceThread, thread), load_settings(env))


async def test_chunks_gather_while_the_device_is_busy_and_go_at_once_when_it_is_not() -> None:
    thread = HeldThread()
    device = stage(thread)
    async with anyio.create_task_group() as group:
        await group.start(device.run)
        first = []
        for n in range(BATCHES_IN_FLIGHT):
            first.append(await device.submit(job(n)))
            await thread.wait_for(len(first))
        assert thread.labels() == [[0], [1]]  # a device with room takes a lone chunk at once
        waiting = [await device.submit(job(n)) for n in range(2, 8)]
        await asyncio.sleep(0.05)
        assert len(thread.batches) == BATCHES_IN_FLIGHT  # both busy: the rest wait, gathering
        thread.finish(0)
        await thread.wait_for(3)
        assert thread.labels()[2] == [2, 3, 4, 5]  # everything queued, up to batch_max_objects
        assert (await first[0]).h2d_seconds == 0.0
        thread.finish(1)
        await thread.wait_for(4)
        assert thread.labels()[3] == [6, 7]
        thread.finish(2)
        thread.finish(3)
        assert [(await f).h2d_seconds for f in [first[1], *waiting]] == [1.0, *range(2, 8)]
        group.cancel_scope.cancel()


async def test_a_batch_wait_holds_a_batch_open_for_more() -> None:
    thread = HeldThread()
    device = stage(thread, batch_wait_ms="200")
    async with anyio.create_task_group() as group:
        await group.start(device.run)
        await device.submit(job(0))
        await asyncio.sleep(0.02)
        await device.submit(job(1))
        await thread.wait_for(1)
        assert thread.labels() == [[0, 1]]
        thread.finish(0)
        group.cancel_scope.cancel()


async def test_a_batch_holds_at_most_batch_max_bytes_and_a_larger_chunk_goes_alone() -> None:
    thread = HeldThread()
    device = stage(thread, batch_max_objects="8", batch_max_bytes=str(4 * MiB))
    async with anyio.create_task_group() as group:
        await group.start(device.run)
        busy = []
        for n in range(BATCHES_IN_FLIGHT):  # one batch each: the device has room
            busy.append(await device.submit(job(n)))
            await thread.wait_for(n + 1)
        # queued while the device is busy: 1 + 2 MiB fit, the next 2 MiB would not;
        # 5 MiB is over the bound on its own and goes alone; 512 bytes round up to 512
        sizes = {2: MiB, 3: 2 * MiB, 4: 2 * MiB, 5: 5 * MiB, 6: 100, 7: 512}
        waiting = [await device.submit(job(n, size)) for n, size in sizes.items()]
        thread.finish(0)
        await thread.wait_for(3)
        thread.finish(1)
        await thread.wait_for(4)
        thread.finish(2)
        await thread.wait_for(5)
        assert thread.labels()[2:] == [[2, 3], [4], [5]]
        thread.finish(3)
        await thread.wait_for(6)
        assert thread.labels()[5] == [6, 7]
        thread.finish(4)
        thread.finish(5)
        assert [(await f).h2d_seconds for f in [*busy, *waiting]] == [*range(8)]
        group.cancel_scope.cancel()


async def test_chunks_that_never_reach_the_device_are_handed_back_on_cancellation() -> None:
    thread = HeldThread()
    device = stage(thread, batch_max_bytes=str(MiB))
    consumed: list[int] = []
    async with anyio.create_task_group() as group:
        await group.start(device.run)
        for n in range(BATCHES_IN_FLIGHT):
            await device.submit(job(n))
            await thread.wait_for(n + 1)
        for n in (2, 3, 4):
            await device.submit(job(n, MiB, consumed))
        thread.finish(0)
        await thread.wait_for(3)
        await asyncio.sleep(0.05)
        # 3 was held back by the bound and now waits for the device; 4 is still queued
        assert thread.labels()[2] == [2]
        group.cancel_scope.cancel()
    assert consumed == [3, 4]  # their slot references went back: they never reached the device
