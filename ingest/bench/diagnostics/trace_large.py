"""Trace one large object through the worker: where its ranges and device round trips wait.

A diagnostic, not a test (pytest does not collect it). It starts the embedded
stack, uploads a synthetic multi-frame object of FRAMES 512x512 16-bit frames
twice (a warm-up and a measured copy), runs the real worker on each in hook
mode with the source hash off, and wraps (on the classes, for this process
only) the GETs on their threads, ``DeviceStage.submit``/``_dispatch``, the
runners' ``run`` (the device thread's batches), the CUDA events the device
thread waits on, and the in-order consumer to time every range, device round
trip, batch and wait::

    .venv/bin/python -m ingest.bench.diagnostics.trace_large 512 cpu --zero-cost-device
    python3 -m ingest.bench.diagnostics.trace_large 2048 cuda        # on the GPU machine
    python3 -m ingest.bench.diagnostics.trace_large 2048 cuda --variant part_size=8388608
    python3 -m ingest.bench.diagnostics.trace_large 4800 cuda --volume-corpus DIR

``--volume-corpus DIR`` traces an Enhanced CT volume of FRAMES compressed frames instead,
made as the bench's ``ct-htj2k-volume`` (``--volume-series``: ``ct-htj2k`` or ``ct-j2k``)
from the slices of a decode corpus (``python -m ingest.bench.workloads_compressed
--write DIR``), and adds its device decode calls to the trace.

Each ``--variant`` is a space-separated list of worker settings (and
``device_window_mb``, the pipeline's source bytes on the device) to trace in turn.

``--zero-cost-device`` replaces the CPU runner's work with nothing, so what is
left is the pipeline itself (reads, ordering, hand-offs). ``--profile device``
(or ``loop``) adds a cProfile table of the device thread (or of the event loop;
one of the two a run, since Python 3.12 lets one profiler run in a process at a
time). Its times are wall time: a thread waiting for the GIL is charged to the line
it waits on. docs/benchmarks.md quotes its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import io
import itertools
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer

from ingest.bench.diagnostics.startup import notification
from ingest.bench.workloads import S3Target
from ingest.device import stage as device
from ingest.embedded.samples import synthetic_multiframe
from ingest.embedded.stack import Stack, create_topics, embedded_stack
from ingest.fetch import ordered_reads, threaded_http
from ingest.fetch import s3 as fetch
from ingest.fetch.http_answer import Answer
from ingest.pipeline import jobs as object_jobs
from ingest.pipeline import large, streamed
from ingest.settings import Settings, load_settings
from ingest.worker import Outcome, Worker
from ingest_gpu import jobs
from ingest_gpu.jobs import ChunkJob, ChunkResult, consume
from ingest_gpu.thread import DeviceThread, cuda_unavailable_reason

Event = tuple[str, float, float, int]  # kind, start, end, size (bytes or batch length)
EVENTS: list[Event] = []
DEVICE_TIMES: list[tuple[float, float]] = []  # CUDA-event h2d and kernel seconds per chunk
RUNNER_STATS: dict[str, int | float] = {}
OUTCOMES: list[tuple[float, Any]] = []  # when each outcome was reported, and the outcome
PROFILES: dict[str, cProfile.Profile] = {}  # --profile: the device thread's, the loop's


def instrument() -> None:
    get_into = threaded_http.get_into  # what ingest.fetch.s3 calls on the GET threads
    submit = device.DeviceStage.submit
    dispatch = device.DeviceStage._dispatch
    next_read = ordered_reads.InOrder.__anext__

    def timed_get(
        pool: threaded_http.ConnectionPool,
        url: str,
        headers: dict[str, str],
        target: memoryview,
        transfer: threaded_http.Transfer | None = None,
    ) -> Answer:
        """On the GET's thread: the time a connection is busy with the range. Ranges after
        the first GET carry ``If-Match``; the first GET (the header probe) is left out."""
        t0 = time.perf_counter()
        answer = get_into(pool, url, headers, target, transfer)
        if "If-Match" in headers:
            EVENTS.append(("read", t0, time.perf_counter(), len(target)))
        return answer

    async def timed_submit(self: Any, job: ChunkJob) -> asyncio.Future[ChunkResult]:
        t0 = time.perf_counter()
        future = await submit(self, job)
        EVENTS.append(("submit", t0, time.perf_counter(), job.data.nbytes))

        def done(future: asyncio.Future[ChunkResult]) -> None:
            EVENTS.append(("device", t0, time.perf_counter(), job.data.nbytes))
            if not future.cancelled() and future.exception() is None:
                result = future.result()
                DEVICE_TIMES.append((result.h2d_seconds, result.kernel_seconds))

        future.add_done_callback(done)
        return future

    async def timed_dispatch(self: Any, batch: list[Any]) -> None:
        t0 = time.perf_counter()
        await dispatch(self, batch)
        EVENTS.append(("batch", t0, time.perf_counter(), len(batch)))

    async def timed_next(self: Any) -> tuple[Any, memoryview]:
        t0 = time.perf_counter()
        item = await next_read(self)
        EVENTS.append(("wait", t0, time.perf_counter(), 0))
        return item

    def timed_runner(cls: Any) -> None:
        run = cls.run

        def timed_run(self: Any, batch: Sequence[ChunkJob]) -> Any:
            t0 = time.perf_counter()
            try:
                return run(self, batch)
            finally:
                EVENTS.append(("run", t0, time.perf_counter(), len(batch)))
                RUNNER_STATS.update(self.stats())

        cls.run = timed_run

    timed_runner(jobs.CpuRunner)
    if cuda_unavailable_reason() is None:  # else the CPU runner is the one timed
        from ingest_gpu.decode import NvDecoder
        from ingest_gpu.transfer import CudaRunner

        timed_runner(CudaRunner)
        time_event_waits(CudaRunner)
        decode = NvDecoder.decode

        def timed_decode(self: Any, work: Any, stream_handle: int) -> Any:
            t0 = time.perf_counter()
            try:
                return decode(self, work, stream_handle)
            finally:
                frames = sum(len(encoded.frames) for encoded, _, _ in work)
                EVENTS.append(("decode", t0, time.perf_counter(), frames))

        NvDecoder.decode = timed_decode  # type: ignore[method-assign]
    parse_in_full = large._parse_in_full
    feed = streamed.FrameStream.feed

    def timed_parse(prefix: bytes, size: int, settings: Settings, geometry: bool = True) -> Any:
        t0 = time.perf_counter()
        try:
            return parse_in_full(prefix, size, settings, geometry)
        finally:
            EVENTS.append(("parse" if geometry else "parse_rescale", t0, time.perf_counter(), 0))

    def timed_feed(self: Any, view: memoryview) -> Any:
        t0 = time.perf_counter()
        try:
            return feed(self, view)
        finally:
            EVENTS.append(("split", t0, time.perf_counter(), len(view)))

    large._parse_in_full = timed_parse
    streamed.FrameStream.feed = timed_feed  # type: ignore[method-assign]
    fetch.get_into = timed_get  # type: ignore[attr-defined]
    device.DeviceStage.submit = timed_submit  # type: ignore[method-assign]
    device.DeviceStage._dispatch = timed_dispatch  # type: ignore[method-assign]
    ordered_reads.InOrder.__anext__ = timed_next  # type: ignore[method-assign]


def profile_device_thread() -> None:
    """cProfile the device thread of each worker (``DeviceThread._main``, queue waits and all)."""
    main = DeviceThread._main

    def profiled(self: Any, ready: Any) -> None:
        PROFILES["device thread"] = profile = cProfile.Profile()
        profile.runcall(main, self, ready)

    DeviceThread._main = profiled  # type: ignore[method-assign]


def print_profiles(callers_of: str | None) -> None:
    for name, profile in PROFILES.items():
        print(f"  -- cProfile, {name}, by own time:")
        stats = pstats.Stats(profile, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(22)
        if callers_of:
            stats.print_callers(callers_of)


def time_event_waits(runner: Any) -> None:
    """The device thread's waits on CUDA events (a copy's end, the batch's end)."""
    from ingest_gpu import driver

    class TimedEvent(driver.Event):
        def synchronize(self) -> None:
            t0 = time.perf_counter()
            super().synchronize()
            EVENTS.append(("event_wait", t0, time.perf_counter(), 0))

    def events_for(self: Any, count: int) -> list[Any]:
        while len(self._events) < count:
            self._events.append(TimedEvent(self._context))
        return list(self._events[:count])

    runner._events_for = events_for


def zero_cost_device() -> None:
    def run(self: Any, batch: Sequence[ChunkJob]) -> list[ChunkResult | BaseException]:
        for job in batch:
            consume(job)
        return [ChunkResult(None, None, "cpu", 0.0, 0.0, 0.0) for _ in batch]

    jobs.CpuRunner.run = run  # type: ignore[method-assign,assignment]


def idle_connections(reads: list[Event], limit: int) -> tuple[float, float]:
    """GET slots left unused while ranges still waited to start: connection-seconds, and
    that span (first start to last start) times ``limit``. Ranges held back by the
    in-order consumer's run-ahead bound or by a full ring show up here."""
    edges = sorted([(start, 1) for _, start, _, _ in reads] + [(end, -1) for _, _, end, _ in reads])
    last_start = max(start for _, start, _, _ in reads)
    idle, in_flight, previous = 0.0, 0, edges[0][0]
    for at, step in edges:
        if at > last_start:
            break
        idle += max(0, limit - in_flight) * (at - previous)
        in_flight, previous = in_flight + step, at
    return idle, (last_start - edges[0][0]) * limit


def report(label: str, size: int, limit: int) -> None:
    def durations(kind: str) -> list[float]:
        return [end - start for k, start, end, _ in EVENTS if k == kind]

    reads = [e for e in EVENTS if e[0] == "read"]
    start = min(e[1] for e in reads)
    total = max(e[2] for e in EVENTS if e[0] in ("read", "device")) - start
    read_s = durations("read")
    batches = [e[3] for e in EVENTS if e[0] == "batch"]
    print(f"== {label}: {total:.3f} s, {len(reads)} ranges, {size / 1e9 / total:.2f} GB/s")
    print(
        f"  range: median {statistics.median(read_s) * 1e3:.1f} ms, "
        f"in flight on average {sum(read_s) / total:.1f}"
    )
    print(f"  consumer waiting for the next range: {sum(durations('wait')):.3f} s of {total:.3f}")
    idle, span = idle_connections(reads, limit)
    print(
        f"  GET slots idle while ranges waited to start: {idle:.3f} of {span:.3f} "
        f"connection-seconds ({limit} at once)"
    )
    print(
        f"  device round trip: median {statistics.median(durations('device')) * 1e3:.1f} ms; "
        f"{len(batches)} batches of {statistics.mean(batches):.2f} chunks on average"
    )
    runs = sorted((start, end) for k, start, end, _ in EVENTS if k == "run")
    if runs:
        busy = sum(end - start for start, end in runs)
        gaps = [b[0] - a[1] for a, b in itertools.pairwise(runs)]
        print(
            f"  device thread busy {busy:.3f} s of {total:.3f}; per batch median "
            f"{statistics.median(end - start for start, end in runs) * 1e3:.2f} ms, "
            f"gap between batches median {statistics.median(gaps or [0.0]) * 1e3:.2f} ms"
        )
    decodes = [e for e in EVENTS if e[0] == "decode"]
    if decodes:
        frames = [e[3] for e in decodes]
        print(
            f"  device decode calls {len(decodes)}, {sum(durations('decode')):.3f} s, frames a call"
            f" median {statistics.median(frames):.0f} (min {min(frames)}, max {max(frames)})"
        )
    print(
        "  timeline (ms from the first range's start): "
        + ", ".join(
            f"{what} {(at - start) * 1e3:.0f}"
            for what, at in (
                ("first range read", min(e[2] for e in reads)),
                *[
                    (f"{kind} {'ends' if end else 'starts'}", e[2] if end else e[1])
                    for kind in ("parse_rescale", "parse", "split")
                    for e in [next((e for e in EVENTS if e[0] == kind), None)]
                    if e is not None
                    for end in (False, True)
                ],
                ("first submit", min((s for k, s, _, _ in EVENTS if k == "submit"), default=start)),
                ("last range read", max(e[2] for e in reads)),
                ("first batch", min((s for k, s, _, _ in EVENTS if k == "run"), default=start)),
                ("last batch done", max((e for k, _, e, _ in EVENTS if k == "run"), default=start)),
            )
        )
    )
    for at, outcome in OUTCOMES:
        if outcome.processed is not None:
            t = outcome.processed.timings
            print(
                f"  the object's own timings (ms): first GET {t.first_get_s * 1e3:.0f}, parse"
                f" {t.parse_s * 1e3:.0f}, device {t.device_s * 1e3:.0f},"
                f" total {t.total_s * 1e3:.0f};"
                f" from the first range's start: its read began {(t.started_at - start) * 1e3:.0f},"
                f" it ended {(t.started_at + t.total_s - start) * 1e3:.0f}, its outcome (records"
                f" acknowledged) {(at - start) * 1e3:.0f}"
            )
    submits = durations("submit")
    print(f"  consumer blocked in submit: {sum(submits):.3f} s")
    waits = durations("event_wait")
    if waits:
        h2d = sum(h for h, _ in DEVICE_TIMES)
        print(
            f"  device thread waiting on CUDA events {sum(waits):.3f} s; copies (CUDA events) "
            f"{h2d:.3f} s = {size / 1e9 / max(h2d, 1e-9):.1f} GB/s; "
            f"pageable copies {RUNNER_STATS.get('pageable_h2d_jobs')}"
        )


def prepare(
    stack: Stack, objects: dict[str, bytes], overrides: dict[str, str]
) -> tuple[Settings, str]:
    """A worker's settings for this stack, with buckets, topics and a group of their own
    (the worker's defaults, then ``overrides``), and its source bucket, which holds
    ``objects``."""
    token = uuid.uuid4().hex[:10]
    creds = stack.s3.credentials
    target = S3Target(
        stack.s3.endpoint_url,
        creds.region,
        creds.access_key,
        creds.secret_key,
        f"trace-{token}-src",
        f"trace-{token}-out",
    )
    topics = {role: f"trace-{token}-{role}" for role in ("source", "results", "dlq", "audit")}
    for bucket in (target.source_bucket, target.output_bucket):
        stack.s3.create_bucket(bucket)
    create_topics(stack.kafka.bootstrap, list(topics.values()))
    client = target.client()
    try:
        for key, body in objects.items():
            client.put_object(Bucket=target.source_bucket, Key=key, Body=body)
    finally:
        client.close()
    env = {
        **stack.endpoints.environment(),
        "DICOM_INGEST_OUTPUT_URL": f"s3://{target.output_bucket}/out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
        "DICOM_INGEST_GROUP_ID": f"trace-{token}",
        **{f"DICOM_INGEST_{role.upper()}_TOPIC": topic for role, topic in topics.items()},
        **{f"DICOM_INGEST_{name.upper()}": value for name, value in overrides.items()},
    }
    return load_settings(env), target.source_bucket


async def announce(stack: Stack, topic: str, bucket: str, key: str) -> None:
    """A notification of ``key``, without its size (the worker's first GET is then
    one part, as for a notification that has none)."""
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, notification(bucket, key))
    finally:
        await producer.stop()


async def run_one(settings: Settings) -> None:
    """Run a worker until its first outcome.

    Raises:
        RuntimeError: that outcome is an error.
    """
    outcomes: list[Outcome] = []
    done = anyio.Event()

    def on_outcome(outcome: Outcome) -> None:
        OUTCOMES.append((time.perf_counter(), outcome))
        outcomes.append(outcome)
        done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await done.wait()
        worker.stop()
    if outcomes[0].error is not None:
        raise RuntimeError(f"{type(outcomes[0].error).__name__}: {outcomes[0].error}")


def volume(corpus: Path, series: str, frames: int) -> bytes:
    """An Enhanced CT object of ``frames`` frames, the corpus's ``series`` slices in turn,
    as the bench's volume workloads are made."""
    from ingest.bench.decode import _frames_of
    from ingest.bench.workloads import DECODE_WORKLOADS
    from ingest.bench.workloads_compressed import corpus_files
    from ingest.embedded.samples_compressed import write_ct_volume

    distinct = [b"".join(_frames_of(path)[1]) for path in corpus_files(corpus, series)]
    if not distinct:
        raise SystemExit(f"no {series} slices in {corpus}")
    out = io.BytesIO()
    write_ct_volume(
        out, DECODE_WORKLOADS[series], [distinct[i % len(distinct)] for i in range(frames)]
    )
    return out.getvalue()


async def trace(stack: Stack, frames: int, backend: str, variants: list[str], args: Any) -> None:
    if args.volume_corpus is None:
        data = synthetic_multiframe(frames, 512, 512)
    else:
        data = volume(args.volume_corpus, args.volume_series, frames)
    default_window = object_jobs.DEVICE_WINDOW_BYTES
    for variant in variants:
        overrides = dict(item.split("=", 1) for item in variant.split())
        window_mb = overrides.pop("device_window_mb", None)
        object_jobs.DEVICE_WINDOW_BYTES = int(window_mb) << 20 if window_mb else default_window
        settings, bucket = prepare(
            stack,
            {"warm.dcm": data, "big.dcm": data},
            {
                "device": backend,
                "sink": "none",
                "hook": "ingest.bench.ours:bench_hook",
                "source_hash": "none",
                **overrides,
            },
        )
        for key in ("warm.dcm", "big.dcm"):
            EVENTS.clear()
            OUTCOMES.clear()
            DEVICE_TIMES.clear()
            await announce(stack, settings.source_topic, bucket, key)
            loop_profile = cProfile.Profile()
            if args.profile == "loop":
                PROFILES["event loop (the whole worker run)"] = loop_profile
                loop_profile.enable()
            await run_one(settings)
            loop_profile.disable()
            window = object_jobs.device_plan(settings, backend).window
            label = f"{key} [{variant or 'defaults'}; {window} chunks on the device]"
            report(label, len(data), settings.fetch_concurrency)
            if args.profile is not None and key == "big.dcm":
                print_profiles(args.callers_of)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("frames", type=int, help="512x512 16-bit frames (2048 = 1 GiB)")
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--zero-cost-device", action="store_true")
    parser.add_argument(
        "--variant", action="append", help='settings to trace, e.g. "batch_wait_ms=0"'
    )
    parser.add_argument(
        "--profile", choices=["device", "loop"], help="cProfile the device thread or the event loop"
    )
    parser.add_argument("--callers-of", help="with --profile: who calls this, e.g. inspect.py:2686")
    parser.add_argument("--volume-corpus", type=Path, help="trace a compressed volume instead")
    parser.add_argument("--volume-series", default="ct-htj2k", choices=["ct-htj2k", "ct-j2k"])
    args = parser.parse_args()
    instrument()
    if args.profile == "device":
        profile_device_thread()
    if args.zero_cost_device:
        zero_cost_device()
    with embedded_stack() as stack:
        os.environ.update(stack.endpoints.environment())
        anyio.run(
            trace, stack, args.frames, args.device, args.variant or [""], args, backend="asyncio"
        )


if __name__ == "__main__":
    main()
