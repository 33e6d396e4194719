"""``ours``: the real ``Worker`` driven by real notifications through the broker.

Two modes: ``ours`` with the S3 sink on (``.npy`` + sidecar written, the
default), and ``ours-hook`` with ``DICOM_INGEST_SINK=none`` and ``bench_hook``
as the user hook, so the arrays stay where the device put them (on the GPU
machine: in GPU memory) and a hook receives them: the real-time analysis case.

One worker per configuration (settings), on a topic of its own. A pass
publishes one AWS-format notification per object and waits until the worker
reported every object (``on_outcome``). The notifications carry no ETag,
version or sequencer, so the worker never takes a later pass for a repeat.

- warm-up: ``warmup`` objects (a full pass of the workload, or one small
  object for sweep points) processed and discarded;
- ``repeats`` measured burst passes: every notification published at once;
  throughput = bytes / (last outcome - first publish);
- for ``paced`` workloads one more pass publishing at ``bench --paced-rate``
  (by default half the median burst rate), for latency at a sustainable load.

Latency of an object = the time its ``Outcome`` callback ran (after the
output, the sidecar, the acknowledged result event and the acknowledged audit
record) minus the time just before its notification was handed to the
producer (``perf_counter``, one clock, one process). Each latency summary
also has the medians of the worker's own ``Processed.timings``: the first GET,
parse, device (for a large object: the whole chunk loop, reads and output
parts included) and all of ``process_object``; ``rest_of_process_object`` is
what those parts leave out (for a small object: the ``.npy`` PUT and waits
for a ring slot or a GET thread); ``outside_process_object`` is the rest of
the latency (Kafka delivery to the worker, waiting for an in-flight permit,
the sidecar PUT, the result and audit produces), split at the object task's
start into ``delivery`` (the notification's trip through the broker to the
worker, until its object task began) and ``after_process_object`` (the
sidecar PUT and the acknowledged result and audit produces).

The worker's device stage and ring are read through ``worker._ctx`` (a
read-only peek the worker has no public API for yet); ``stage.submit`` is
wrapped on the instance to collect each chunk's host-to-device seconds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer

from ingest.bench.measure import Meter, percentile, summarize
from ingest.bench.workloads import BenchObject
from ingest.hooks import HookChunk
from ingest.settings import Settings
from ingest.worker import Outcome, Worker
from ingest_gpu.thread import ChunkJob, ChunkResult

ALLOCATION_COUNTERS = (
    "pinned_allocations",
    "pageable_allocations",
    "host_allocations",
    "device_allocations",
    "pinned_staging_allocations",
)
TIMING_FIELDS = ("first_get_ms", "parse_ms", "device_ms", "process_object_ms")
HOOK_SPEC = "ingest.bench.ours:bench_hook"
HOOK_COUNTS = {"chunks": 0, "elements": 0}


def bench_hook(chunk: HookChunk) -> None:
    """The ``ours-hook`` mode's user hook: takes each chunk (on the device) and does nothing.

    Runs on the worker's device thread; it only counts, so what is measured is
    the worker up to the point where a user's model would start.
    """
    HOOK_COUNTS["chunks"] += 1
    HOOK_COUNTS["elements"] += chunk.elements


def pass_limit_s(total_bytes: int) -> float:
    """How long one pass over ``total_bytes`` may take: generous, so a stall fails the
    run rather than hanging it (5 MB/s of source: compressed objects decode on the CPU)."""
    return 120.0 + total_bytes / 5e6


def notification(bucket: str, obj: BenchObject) -> bytes:
    record = {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": "ObjectCreated:Put",
        "s3": {"bucket": {"name": bucket}, "object": {"key": obj.key, "size": obj.size}},
    }
    return json.dumps({"Records": [record]}).encode()


@dataclass(slots=True)
class _Pass:
    expected: int
    sent: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    timings: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # perf_counter() as the worker's read of each object began
    started: dict[str, float] = field(default_factory=dict)
    finished: anyio.Event = field(default_factory=anyio.Event)

    def latencies_ms(self) -> list[float]:
        return [(self.done[k] - self.sent[k]) * 1000.0 for k in self.sent]

    def breakdown_ms(self) -> dict[str, float]:
        """Medians of the pipeline's own timings, and of the rest of each object's latency."""
        out: dict[str, float] = {}
        rows = [(k, t) for k, t in self.timings.items() if k in self.sent]
        for index, name in enumerate(TIMING_FIELDS):
            out[name] = statistics.median(t[index] * 1000.0 for _, t in rows) if rows else 0.0
        inner = [(t[-1] - sum(t[:-1])) * 1000.0 for _, t in rows]
        out["rest_of_process_object_ms"] = statistics.median(inner) if inner else 0.0
        rest = [(self.done[k] - self.sent[k] - t[-1]) * 1000.0 for k, t in rows]
        out["outside_process_object_ms"] = statistics.median(rest) if rest else 0.0
        # the outside split at the object task's start: before it, after process_object
        delivery = [(self.started[k] - self.sent[k]) * 1000.0 for k, _ in rows]
        after = [(self.done[k] - self.started[k] - t[-1]) * 1000.0 for k, t in rows]
        out["delivery_ms"] = statistics.median(delivery) if delivery else 0.0
        out["after_process_object_ms"] = statistics.median(after) if after else 0.0
        return out


class _Tracker:
    def __init__(self) -> None:
        self.current = _Pass(0)
        self.chunks: list[tuple[int, float, float]] = []  # bytes, h2d s, kernel s

    def begin(self, expected: int) -> _Pass:
        self.current = _Pass(expected)
        return self.current

    def on_outcome(self, outcome: Outcome) -> None:
        now = time.perf_counter()
        p = self.current
        key = outcome.ref.key if outcome.ref else "(bad record)"
        p.done[key] = now
        if outcome.error is not None:
            p.errors.append(f"{key}: {type(outcome.error).__name__}: {outcome.error}")
        if outcome.processed is not None:
            t = outcome.processed.timings
            p.timings[key] = (t.first_get_s, t.parse_s, t.device_s, t.total_s)
            p.started[key] = t.started_at
        if len(p.done) >= p.expected:
            p.finished.set()


def latency_summary(ms: Sequence[float], breakdown: dict[str, float]) -> dict[str, Any]:
    return {
        "breakdown_median": breakdown,
        "count": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms, default=0.0),
        "mean_ms": sum(ms) / len(ms) if ms else 0.0,
        "all_ms": [round(v, 3) for v in sorted(ms)],
    }


class OursRunner:
    """Runs one worker on ``topic`` and measures passes over lists of objects."""

    def __init__(
        self,
        settings: Settings,
        bucket: str,
        server_pids: Sequence[int],
        notify: Callable[[BenchObject], bytes] | None = None,
    ) -> None:
        """``notify``: the notification of an object (default: an S3 record in ``bucket``;
        the file-source diagnostic sends ``file://`` ones)."""
        self.settings = settings
        self._notify = notify or functools.partial(notification, bucket)
        self._pids = list(server_pids)
        self._tracker = _Tracker()
        self._producer: Any = None
        self.worker = Worker(settings, self._tracker.on_outcome)

    async def _pass(
        self, objects: Sequence[BenchObject], interval_s: float, limit_s: float
    ) -> tuple[_Pass, float]:
        p = self._tracker.begin(len(objects))
        deliveries = []
        start = time.perf_counter()
        for index, obj in enumerate(objects):
            if interval_s:
                await anyio.sleep(max(0.0, start + index * interval_s - time.perf_counter()))
            p.sent[obj.key] = time.perf_counter()
            message = self._notify(obj)
            deliveries.append(await self._producer.send(self.settings.source_topic, message))
        for delivery in deliveries:
            await delivery
        with anyio.fail_after(limit_s):
            await p.finished.wait()
        if p.errors:
            raise RuntimeError(f"ours: {len(p.errors)} objects failed, e.g. {p.errors[0]}")
        seconds = max(p.done.values()) - min(p.sent.values())
        return p, seconds

    def _stats(self) -> dict[str, Any]:
        ctx = self.worker._ctx
        assert ctx is not None
        ring = ctx.ring.stats()
        return {
            "device": dict(ctx.device.thread.stats()),
            "ring": {
                "slots": ring.slots,
                "slot_size": ring.slot_size,
                "waits": ring.waits,
                "acquired": ring.acquired,
                "small_acquired": ring.small_acquired,
                "pinned": ring.pinned,
            },
            "batches": ctx.device.batches,
            "jobs": ctx.device.jobs,
        }

    def _wrap_device_stage(self) -> None:
        ctx = self.worker._ctx
        assert ctx is not None
        stage = ctx.device
        original = stage.submit
        chunks = self._tracker.chunks

        async def submit(job: ChunkJob) -> asyncio.Future[ChunkResult]:
            future = await original(job)

            def record(done: asyncio.Future[ChunkResult]) -> None:
                if not done.cancelled() and done.exception() is None:
                    result = done.result()
                    chunks.append((job.data.nbytes, result.h2d_seconds, result.kernel_seconds))

            future.add_done_callback(record)
            return future

        stage.submit = submit  # type: ignore[method-assign]  # process() goes through it too

    async def measure(
        self,
        objects: Sequence[BenchObject],
        warmup: Sequence[BenchObject],
        repeats: int,
        paced: float | None,
        limit_s: float | None = None,
    ) -> dict[str, Any]:
        """Start the worker, warm up, run the passes, stop the worker; all figures.

        ``limit_s``: how long a pass may take (default ``pass_limit_s``; decoding
        workloads take longer a byte).
        """
        total = sum(o.size for o in objects)
        limit_s = limit_s or pass_limit_s(total)
        producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, acks="all", linger_ms=1
        )
        await producer.start()
        self._producer = producer
        try:
            async with anyio.create_task_group() as group:
                await group.start(self.worker.run)
                try:
                    result = await self._measure(objects, warmup, repeats, paced, total, limit_s)
                finally:
                    self.worker.stop()
        finally:
            await producer.stop()
        return result

    async def _measure(
        self,
        objects: Sequence[BenchObject],
        warmup: Sequence[BenchObject],
        repeats: int,
        paced: float | None,
        total: int,
        limit_s: float,
    ) -> dict[str, Any]:
        self._wrap_device_stage()
        await self._pass(warmup, 0.0, limit_s)
        before = self._stats()
        hook_chunks = HOOK_COUNTS["chunks"]
        self._tracker.chunks.clear()
        runs: list[dict[str, Any]] = []
        burst_ms: list[float] = []
        breakdown: dict[str, float] = {}
        for _ in range(repeats):
            with Meter(self._pids) as meter:
                p, seconds = await self._pass(objects, 0.0, limit_s)
            run = meter.result(total, len(objects), seconds=seconds)
            ms = p.latencies_ms()
            burst_ms += ms
            breakdown = p.breakdown_ms()  # of the last pass
            run.extra = {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
            runs.append(run.as_dict())
        after = self._stats()
        result: dict[str, Any] = {
            "status": "ok",
            "runs": runs,
            **summarize(runs),
            "warmup": f"{len(warmup)} objects processed first and discarded",
            "latency_burst": latency_summary(burst_ms, breakdown),
            "stats_after_warmup": before,
            "stats_after": after,
            "steady_state_allocations": {
                k: after["device"].get(k, 0) - before["device"].get(k, 0)
                for k in ALLOCATION_COUNTERS
                if k in after["device"]
            },
            "ring_bytes": self.settings.ring_slots * self.settings.part_size,
            "h2d": self._h2d(),
            "pool_result_arrays": after["device"].get("device_result_arrays", 0)
            - before["device"].get("device_result_arrays", 0),
            "hook_chunks": HOOK_COUNTS["chunks"] - hook_chunks,
        }
        if paced is not None and runs:
            rate = paced or float(result["median"]["objects_per_s"]) / 2.0
            p, seconds = await self._pass(objects, 1.0 / rate, limit_s)
            summary = latency_summary(p.latencies_ms(), p.breakdown_ms())
            result["latency_paced"] = {"rate_objects_per_s": rate, **summary}
        return result

    def _h2d(self) -> dict[str, Any]:
        chunks = self._tracker.chunks
        nbytes = sum(c[0] for c in chunks)
        seconds = sum(c[1] for c in chunks)
        return {
            "chunks": len(chunks),
            "bytes": nbytes,
            "copy_seconds": seconds,
            "kernel_seconds_sum": sum(c[2] for c in chunks),
            "gb_per_s": nbytes / seconds / 1e9 if seconds else None,
            "mean_chunk_bytes": nbytes / len(chunks) if chunks else 0,
            "note": "per-chunk copy time between CUDA events (ChunkResult.h2d_seconds); "
            "None on the CPU backend",
        }
