"""The worker: one task group wiring consumer, object tasks, device stage and commits.

::

    services task group
    ├── DeviceStage.run           batches chunks onto the device thread
    ├── commit loop, audit digests, health probe
    ├── SeriesAssembler.run       (SERIES=volume) series whose quiet period ended
    └── work scope (cancelled at the drain deadline)
        └── objects task group
            ├── intake (cancelled by stop())   poll -> parse -> dedupe -> spawn
            └── one task per object            process -> outputs, series -> result -> audit

Backpressure: ``max_objects_in_flight`` object tasks at most, the ring bounds
the bytes in flight, the device stage's stream the chunks waiting for it.

Order of durability per object: ``.npy`` and sidecar written, result (or
dead-letter) record acknowledged, audit record acknowledged; only then is the
offset marked finished, and commits move over finished offsets only.

Shutdown (``stop()``, wired to SIGTERM/SIGINT by the CLI): intake stops at
once; in-flight objects get ``shutdown_deadline_s`` to finish, then are
cancelled (their offsets stay uncommitted and are redelivered); within the
same deadline, series slices held in memory are written as outputs of their
own (``SERIES_SLICES=hold``); a final commit runs shielded; the consumer
leaves the group; clients close.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup, TaskStatus

from ingest.audit.publish import AuditPublisher, open_audit
from ingest.device.stage import DeviceStage
from ingest.dicom.decoders import DecodePool
from ingest.errors import IngestError, NotificationError, ProcessingError
from ingest.fetch.files import FileSource
from ingest.fetch.ring import PinnedRing
from ingest.fetch.s3 import S3Source, translate_s3_error
from ingest.fetch.sources import Sources
from ingest.hooks import enable_device_arrays, load_hook
from ingest.logs import bind_object, key_digest
from ingest.ops.health import Health, probe, serving
from ingest.ops.metrics import finished, stopped_summary, watching
from ingest.pipeline.jobs import Context
from ingest.pipeline.process import process_object
from ingest.pipeline.series import SeriesAssembler
from ingest.settings import Settings
from ingest.sink.output import OutputSink, output_dtype, output_keys
from ingest.sink.records import (
    Processed,
    dead_letter,
    failure_event,
    record_summary,
    sidecar,
    success_event,
)
from ingest.source.group import GroupMember
from ingest.source.kafka import Publisher, make_producer
from ingest.source.notifications import (
    ObjectRef,
    RecentObjects,
    object_identity,
    parse_notification,
)
from ingest.source.offsets import Partition
from ingest_gpu.thread import DeviceThread

log = structlog.get_logger("dicom_ingest.worker")
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One object (or bad notification) finished: what the demo and tests watch."""

    ref: ObjectRef | None
    processed: Processed | None
    error: IngestError | None


@dataclass(slots=True)
class WorkerStats:
    records: int = 0
    objects: int = 0
    processed: int = 0
    dead_lettered: int = 0
    skipped_events: int = 0
    duplicates: int = 0
    commits: int = 0


@dataclass(slots=True)
class _RecordProgress:
    partition: Partition
    offset: int
    summary: dict[str, Any]
    remaining: int = field(default=0)


class Worker:
    """The long-running worker. ``await run()`` until ``stop()`` (or cancellation)."""

    def __init__(
        self,
        settings: Settings,
        on_outcome: Callable[[Outcome], None] | None = None,
        member: GroupMember | None = None,  # one whose join is under way (the CLI's)
    ) -> None:
        self.settings = settings
        self.stats = WorkerStats()
        self._on_outcome = on_outcome
        self._member = member or GroupMember(settings)
        self._commits = self._member.commits
        self._recent = RecentObjects()
        self._running: dict[tuple[str, str, str, str], anyio.Event] = {}
        self._intake_scope = anyio.CancelScope()
        self._work_scope = anyio.CancelScope()
        self._in_flight = 0  # object (and bad-record) tasks running
        self.health = Health()
        self.health_port: int | None = None
        self._consumer: Any = self._member.consumer
        self._producer: Any = None
        self._publisher: Publisher | None = None
        self._audit: AuditPublisher | None = None
        self._ctx: Context | None = None
        self.series: SeriesAssembler | None = None  # with SERIES=volume and an S3 sink

    def stop(self) -> None:
        """Graceful stop: no new records; in-flight work gets the shutdown deadline."""
        self.health.stopping = True
        self._intake_scope.cancel()
        self._work_scope.deadline = min(
            self._work_scope.deadline, anyio.current_time() + self.settings.shutdown_deadline_s
        )

    @property
    def backend(self) -> str:
        return self._ctx.device.backend if self._ctx else "unknown"

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped.

        A broker outage is waited out (``/readyz`` reports it meanwhile).

        Raises:
            BrokerRejected: the broker refused a result, dead-letter or audit message
                for good (nothing unfinished was committed; a restart redoes it).
            ConfigError: the user hook cannot be loaded, or needs CuPy that is
                not installed.
        """
        s, t0 = self.settings, time.monotonic()
        # A thread wanting the GIL waits this long; device and GET threads yield it often.
        sys.setswitchinterval(s.gil_switch_ms / 1000.0)
        async with AsyncExitStack() as stack:
            # The group join first (ingest/source/group.py): the broker holds it while
            # the device, the ring and the clients start; the first poll waits for it.
            await self._member.start()
            stack.push_async_callback(self._member.aclose)  # idempotent; again below
            # The device's set-up and the ring's (pinned) memory come on the device
            # thread while the clients start here.
            thread = DeviceThread(s.device, jpeg=s.jpeg_decoder)
            self.health.device_busy_s, self.health.device_stall_s = thread.busy_s, s.device_stall_s
            ready = asyncio.wrap_future(thread.launch())
            stack.push_async_callback(anyio.to_thread.run_sync, thread.close)  # idempotent
            memory = asyncio.wrap_future(thread.alloc_host_soon(s.slot_size * s.ring_slots))
            source = S3Source(s)
            await source.__aenter__()
            stack.push_async_callback(_close, source.aclose)
            files = FileSource(s) if s.file_roots else None
            if files is not None:
                stack.push_async_callback(files.aclose)
            self._producer = make_producer(s)
            await self._producer.start()
            stack.push_async_callback(_close, self._producer.stop)
            self._publisher = Publisher(self._producer, s)
            self._audit = await stack.enter_async_context(open_audit(s, self._publisher))
            stack.push_async_callback(self._member.aclose)  # leaves the group, promptly
            hook = load_hook(s.hook) if s.hook else None
            sink = OutputSink(source, s)
            if s.series == "volume" and s.sink == "s3":
                spec = s.series_hook
                series_hook = load_hook(spec, "DICOM_INGEST_SERIES_HOOK") if spec else None
                self.series = SeriesAssembler(s, sink, series_hook, thread)
                if self.series.holding:  # held slices are written before a revoke commits
                    self._commits.revoking = self.series.spill
            decoders = DecodePool(s.decode_processes)
            stack.push_async_callback(decoders.aclose)
            clients_up = time.monotonic()
            try:
                ring = PinnedRing(await memory, s.slot_size, s.ring_slots)
            except RuntimeError:  # queued behind a set-up that failed: raise what it raised
                await ready
                raise
            waited = round(time.monotonic() - clients_up, 3)  # the device's, past the clients'
            stack.push_async_callback(ring.aclose)
            # The thread finishes its queued copies before the ring's memory goes.
            stack.push_async_callback(anyio.to_thread.run_sync, thread.close)
            stage = DeviceStage(thread, s)
            if hook is not None or s.series_hook:
                await anyio.to_thread.run_sync(enable_device_arrays, thread)
            self._ctx = Context(s, Sources(source, files), sink, ring, stage, decoders, hook)
            stack.enter_context(watching(self, ring, thread))  # for /metrics
            if s.health_port:
                self.health_port = await stack.enter_async_context(
                    serving(self.health, s.health_host, s.health_port)
                )
            async with anyio.create_task_group() as services:
                await services.start(stage.run)
                services.start_soon(self._commits.loop)
                services.start_soon(self._audit.run)  # digests, spool
                services.start_soon(probe, self.health, self._check_broker, self._check_s3)
                if self.series is not None:  # series whose quiet period ended, pending ones
                    await services.start(self.series.run)
                # What start-up made (modules, clients, S3's service models) lives as long as
                # the worker: frozen, the collector's full passes no longer walk it (a pass
                # over it stopped every thread for 0.1-0.3 s).
                gc.freeze()
                stack.callback(gc.unfreeze)
                log.info(
                    "worker started",
                    backend=stage.backend,
                    worker=s.worker_id,
                    start_s=round(time.monotonic() - t0, 3),
                    device_wait_s=waited,
                    file_reader=files.reader if files is not None else None,
                )
                task_status.started()
                with self._work_scope:
                    async with anyio.create_task_group() as objects:
                        with self._intake_scope:
                            await self._intake(objects)
                    # held series slices are written, so the final commit covers them
                    await self._commits.stopping()
                with anyio.CancelScope(shield=True):
                    await self._commits.now()
                services.cancel_scope.cancel()
        self.stats.commits = self._commits.count
        log.info("worker stopped", **stopped_summary(self.stats, thread))

    async def _intake(self, objects: TaskGroup) -> None:
        """Poll, parse, spawn; keep polling (paused) while every object slot is busy.

        Polling never stops for long, however slow the objects are, so the
        group does not evict us for exceeding ``max_poll_interval_ms``.
        """
        limit = self.settings.max_objects_in_flight
        while True:
            free = 0 if self._audit and self._audit.paused else limit - self._in_flight
            assignment = self._consumer.assignment()
            if free <= 0:
                self._consumer.pause(*assignment)
            elif self._consumer.paused():
                self._consumer.resume(*self._consumer.paused())
            try:
                batch = await self._consumer.getmany(
                    timeout_ms=100 if free <= 0 else 500, max_records=max(1, free)
                )
            except KafkaError as exc:
                log.warning("poll failed", error=type(exc).__name__)
                self.health.broker_error = type(exc).__name__
                await anyio.sleep(1.0)
                continue
            self.health.polled(len(assignment))
            for tp, records in batch.items():
                for record in records:
                    self._take(objects, tp, record)

    def _take(self, objects: TaskGroup, tp: TopicPartition, record: Any) -> None:
        partition = (tp.topic, tp.partition)
        self._commits.consumed(partition, record.offset)
        self.stats.records += 1
        summary = record_summary(
            tp.topic, tp.partition, record.offset, record.timestamp, record.value
        )
        progress = _RecordProgress(partition, record.offset, summary)
        try:
            note = parse_notification(record.value, roots=self.settings.file_roots)
        except NotificationError as exc:
            progress.remaining = 1
            self._spawn(objects, self._fail(progress, None, exc))
            return
        self.stats.skipped_events += note.skipped
        fresh, waiting = [], []
        for ref in note.objects:
            ident = object_identity(ref)
            if ident is not None and ident in self._running:
                waiting.append(self._running[ident])  # a repeat of an object in flight
            elif self._recent.stale(ref) or self._recent.contains(ref):
                self.stats.duplicates += 1  # finished before: nothing to do
            else:
                fresh.append(ref)
        if not fresh and not waiting:
            self._finish(progress)
            return
        progress.remaining = len(fresh) + len(waiting)
        for done in waiting:
            self.stats.duplicates += 1
            self._spawn(objects, self._after(done, progress))
        for ref in fresh:
            self.stats.objects += 1
            ident = object_identity(ref)
            finished = anyio.Event()
            if ident is not None:  # registered now, so a repeat in this same poll sees it
                self._running[ident] = finished
            self._spawn(objects, self._object(progress, ref, ident, finished))

    async def _after(self, original: anyio.Event, progress: _RecordProgress) -> None:
        """A repeat finishes only when the object it repeats has finished durably.

        Finishing it at once could commit its offset while the original's
        offset (revoked and redelivered meanwhile) is forgotten: a crash then
        would lose the object.
        """
        await original.wait()
        self._finish(progress)

    def _spawn(self, objects: TaskGroup, work: Coroutine[Any, Any, None]) -> None:
        """Start one object task; intake pauses while ``max_objects_in_flight`` are running."""

        async def run() -> None:
            try:
                await work
            finally:
                self._in_flight -= 1
                self._commits.task_ended()

        self._in_flight += 1
        objects.start_soon(run)

    async def _object(
        self,
        progress: _RecordProgress,
        ref: ObjectRef,
        ident: tuple[str, str, str, str] | None,
        finished: anyio.Event,
    ) -> None:
        bind_object(ref.key, progress.partition, progress.offset)  # this task's log lines
        try:
            await self._handle(progress, ref)
            self._recent.seen(ref)  # only what finished durably counts as seen
            finished.set()  # repeats waiting on it may finish too
        finally:
            if ident is not None:
                del self._running[ident]

    async def _handle(self, progress: _RecordProgress, ref: ObjectRef) -> None:
        assert self._ctx is not None
        assert self._publisher is not None
        assert self._audit is not None
        try:
            done = await process_object(self._ctx, ref)
            written = self.settings.sink == "s3"
            dtype = output_dtype(self.settings, done.header)
            document = sidecar(done, self.settings.window, dtype, written)
            if written:
                await self._ctx.sink.put_json(done.sidecar_key, document)
            hold = None
            if self.series is not None:  # durable before the offset is committed
                hold = await self.series.add(document, progress.partition)
        except IngestError as exc:
            await self._fail(progress, ref, exc)
            return
        except Exception as exc:  # a bug must cost one object, not the worker
            log.exception("internal error", key=key_digest(ref.key))
            await self._fail(progress, ref, internal_error(exc))
            return
        # The result and the audit record go out together (one produce request when
        # they meet within linger_ms), then both acknowledgements are awaited.
        result = await self._publisher.enqueue_result(document, ref.key.encode())
        await self._audit.record(success_event(done))
        await self._publisher.confirm(*result)
        self.stats.processed += 1
        log.info("processed", key=key_digest(ref.key), size=done.head.size)
        self._report(Outcome(ref, done, None), progress)
        if hold is None:
            self._finish(progress)
        else:  # a slice held in memory: its offset waits for its series' volume
            hold.then(lambda: self._finish(progress))

    async def _fail(
        self, progress: _RecordProgress, ref: ObjectRef | None, error: IngestError
    ) -> None:
        """Dead-letter an object or a bad record, audit it, and mark it finished."""
        assert self._publisher is not None
        assert self._audit is not None
        if self.series is not None and ref is not None:  # values it kept of the object
            self.series.discard(output_keys(self.settings, ref.bucket, ref.key)[0])
        document = dead_letter(progress.summary, ref, error, self.settings.worker_id)
        await self._publisher.dead_letter(document, ref.key.encode() if ref else None)
        await self._audit.record(failure_event(ref, error))
        self.stats.dead_lettered += 1
        log.warning(
            "dead-lettered",
            reason=error.reason,
            step=error.step,
            error=type(error).__name__,
            detail=str(error),
            attempts=error.attempts,
            key=key_digest(ref.key) if ref else None,
        )
        self._report(Outcome(ref, None, error), progress)
        self._finish(progress)

    def _report(self, outcome: Outcome, progress: _RecordProgress) -> None:
        finished(outcome.ref, outcome.processed, outcome.error, progress.summary["timestamp"])
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    def _finish(self, progress: _RecordProgress) -> None:
        progress.remaining -= 1
        if progress.remaining <= 0:
            self._commits.finished(progress.partition, progress.offset)

    async def _check_broker(self) -> None:
        await self._consumer.topics()  # a metadata round trip

    async def _check_s3(self) -> None:
        assert self._ctx is not None
        bucket = self.settings.output_bucket
        try:
            await self._ctx.source.client.head_bucket(Bucket=bucket)
        except Exception as exc:  # named: a wrong secret (403) is not a missing bucket (404)
            endpoint = self.settings.s3_endpoint_url or "AWS S3"
            raise translate_s3_error(exc, f"HeadBucket {bucket!r} at {endpoint}") from exc


def internal_error(exc: BaseException) -> ProcessingError:
    """A bug's dead-letter error: its type and where it was raised. Not its message,
    which may hold any value the code had in hand (the log has the traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = ""
    if tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "?")
        where = f" in {module}.{tb.tb_frame.f_code.co_name}, line {tb.tb_lineno}"
    return ProcessingError(f"internal error: {type(exc).__name__}{where}")


async def _close(aclose: Callable[[], Awaitable[None]]) -> None:
    """Close a client even when the worker is being cancelled, within a bound (as the
    consumer's ``GroupMember.aclose`` does: see there why)."""
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        await aclose()
