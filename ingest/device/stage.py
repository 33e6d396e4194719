"""The async side of the device stage: batching chunks for the dedicated device thread.

Object tasks call ``DeviceStage.process(job)``; the stage gathers requests from
a bounded memory stream into batches, hands each batch to
``ingest_gpu.thread.DeviceThread`` and resolves every request when the batch's
``concurrent.futures.Future`` completes. Two batches may be in flight so the
device thread always has the next one queued while the loop waits.

A batch leaves as soon as the thread can take it (fewer than two in flight),
with every request queued by then, up to ``batch_max_objects`` chunks and
``batch_max_bytes`` of their source bytes (a larger chunk goes alone): batches
fill while the device is busy, and an idle device gets a lone chunk at once.
The byte bound is the device arenas' bound (``gpu/ingest_gpu/transfer.py``: they grow to
a batch's size, to a power of two): without it a large object's four 32 MiB
chunks and a CT slice in one batch would grow the input arena from 128 to 256 MiB
in the middle of a run. A fixed wait after the first request (``batch_wait_ms``,
0 by default) only delays the device (``python -m ingest.bench.diagnostics.trace_large
2048 cuda --variant batch_wait_ms=2`` shows it). Nothing here blocks the event
loop: the thread does all CUDA work and the loop only awaits futures.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ingest import metrics
from ingest.errors import ProcessingError
from ingest.settings import Settings
from ingest_gpu.decode import nvimgcodec_unavailable_reason
from ingest_gpu.jobs import arena_nbytes, consume
from ingest_gpu.thread import ChunkJob, ChunkResult, DeviceThread

BATCHES_IN_FLIGHT = 2


@dataclass(slots=True)
class _Request:
    job: ChunkJob
    done: asyncio.Future[ChunkResult]


class _Batch:
    """The requests of one batch and the arena bytes their chunks take."""

    def __init__(self, first: _Request) -> None:
        self.requests = [first]
        self.nbytes = _arena_bytes(first.job)

    def add(self, request: _Request, max_bytes: int) -> _Request | None:
        """Take ``request``, or give it back when it would take the batch past ``max_bytes``."""
        nbytes = _arena_bytes(request.job)
        if self.nbytes + nbytes > max_bytes:
            return request
        self.requests.append(request)
        self.nbytes += nbytes
        return None


def _arena_bytes(job: ChunkJob) -> int:
    """What ``job`` takes in the input arena: its bytes, or its frames' decoded bytes."""
    return arena_nbytes(job.sample_nbytes if job.encoded is not None else job.data.nbytes)


class DeviceStage:
    """Batches chunk jobs onto one ``DeviceThread``. Start ``run`` in a task group."""

    def __init__(self, thread: DeviceThread, settings: Settings) -> None:
        self.thread = thread
        self._max = settings.batch_max_objects
        self._max_bytes = settings.batch_max_bytes
        self._wait = settings.batch_wait_ms / 1000.0
        send, receive = anyio.create_memory_object_stream[_Request](settings.stage_buffer)
        self._send: MemoryObjectSendStream[_Request] = send
        self._receive: MemoryObjectReceiveStream[_Request] = receive
        self._in_flight = anyio.Semaphore(BATCHES_IN_FLIGHT)
        self.batches = 0
        self.jobs = 0
        # frames go to the device's decoder (ingest_gpu.decode) only where it can run
        self.decodes = (
            settings.gpu_decode == "auto"
            and thread.backend == "cuda"
            and nvimgcodec_unavailable_reason() is None
        )

    @property
    def backend(self) -> str:
        return self.thread.backend

    async def process(self, job: ChunkJob) -> ChunkResult:
        """Preprocess one chunk; returns its result or raises ``ProcessingError``."""
        return await (await self.submit(job))

    async def submit(self, job: ChunkJob) -> asyncio.Future[ChunkResult]:
        """Queue one chunk (waits only while the stage's buffer is full); its future result.

        The future raises ``ProcessingError``. Cancelling it before its batch
        finishes drops the result; the job's ``on_consumed`` still runs.
        """
        done: asyncio.Future[ChunkResult] = asyncio.get_running_loop().create_future()
        try:
            await self._send.send(_Request(job, done))
        except BaseException:
            consume(job)  # it never reaches the device: hand its slot reference back now
            raise
        return done

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Gather and dispatch batches until cancelled.

        A cancellation hands back (``on_consumed``) every chunk taken from the
        queue or still in it that never reached the device thread.
        """
        async with self._send, self._receive, anyio.create_task_group() as group:
            task_status.started()
            batch: _Batch | None = None  # taken, not yet dispatched
            held: _Request | None = None  # taken, past the last batch's byte bound
            try:
                while True:
                    try:
                        first = held if held is not None else await self._receive.receive()
                    except anyio.EndOfStream:
                        return
                    batch, held = _Batch(first), None
                    if self._wait:
                        with anyio.move_on_after(self._wait):
                            while held is None and len(batch.requests) < self._max:
                                held = batch.add(await self._receive.receive(), self._max_bytes)
                    await self._in_flight.acquire()  # meanwhile, requests queue up behind
                    while held is None and len(batch.requests) < self._max:
                        try:
                            held = batch.add(self._receive.receive_nowait(), self._max_bytes)
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    group.start_soon(self._dispatch, batch.requests)
                    batch = None
            finally:
                left = [*(batch.requests if batch else []), *([held] if held else [])]
                for request in left + self._queued():
                    consume(request.job)

    def _queued(self) -> list[_Request]:
        """The requests still in the queue (taken out of it)."""
        queued = []
        while True:
            try:
                queued.append(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return queued

    @metrics.timed_async("device")
    async def _dispatch(self, batch: list[_Request]) -> None:
        try:
            future = self.thread.submit([r.job for r in batch])
            self.batches += 1
            self.jobs += len(batch)
            try:
                outcomes = await asyncio.wrap_future(future)
            except Exception as exc:
                outcomes = [exc] * len(batch)
            for request, outcome in zip(batch, outcomes, strict=True):
                if request.done.done():
                    continue  # the object task was cancelled meanwhile
                if isinstance(outcome, BaseException):
                    error = ProcessingError(f"{type(outcome).__name__}: {outcome}")
                    error.__cause__ = outcome
                    request.done.set_exception(error)
                else:
                    request.done.set_result(outcome)
        finally:
            self._in_flight.release()
