"""Trace one large object through the worker: where its ranges and device round trips wait.

A diagnostic, not a test (pytest does not collect it). It starts the embedded
stack, uploads a synthetic multi-frame object of FRAMES 512x512 16-bit frames
twice (a warm-up and a measured copy), runs the real worker on each in hook
mode with the source hash off, and wraps (on the classes, for this process
only) ``S3Source.read_into``, ``DeviceStage.submit``/``_dispatch`` and the
in-order consumer to time every range, device round trip and wait::

    .venv/bin/python -m tests.trace_large 512 cpu --zero-cost-device
    python3 -m tests.trace_large 2048 cuda        # on the GPU machine

``--zero-cost-device`` replaces the CPU runner's work with nothing, so what is
left is the pipeline itself (reads, ordering, hand-offs). docs/benchmarks.md
quotes its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import anyio

from gpu import jobs
from gpu.jobs import ChunkJob, ChunkResult, consume
from ingest import device, fetch, pipeline
from ingest.samples import synthetic_multiframe
from ingest.stack import Stack, embedded_stack
from tests import harness

Event = tuple[str, float, float, int]  # kind, start, end, size (bytes or batch length)
EVENTS: list[Event] = []


def instrument() -> None:
    read_into = fetch.S3Source.read_into
    submit = device.DeviceStage.submit
    dispatch = device.DeviceStage._dispatch
    next_read = pipeline._InOrder.__anext__

    async def timed_read(self: Any, where: Any, head: Any, rng: Any, into: Any) -> None:
        t0 = time.perf_counter()
        await read_into(self, where, head, rng, into)
        EVENTS.append(("read", t0, time.perf_counter(), rng.length))

    async def timed_submit(self: Any, job: ChunkJob) -> asyncio.Future[ChunkResult]:
        t0 = time.perf_counter()
        future = await submit(self, job)
        EVENTS.append(("submit", t0, time.perf_counter(), job.data.nbytes))
        future.add_done_callback(
            lambda _: EVENTS.append(("device", t0, time.perf_counter(), job.data.nbytes))
        )
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

    fetch.S3Source.read_into = timed_read  # type: ignore[method-assign,assignment]
    device.DeviceStage.submit = timed_submit  # type: ignore[method-assign]
    device.DeviceStage._dispatch = timed_dispatch  # type: ignore[method-assign]
    pipeline._InOrder.__anext__ = timed_next  # type: ignore[method-assign]


def zero_cost_device() -> None:
    def run(self: Any, batch: Sequence[ChunkJob]) -> list[ChunkResult | BaseException]:
        for job in batch:
            consume(job)
        return [ChunkResult(None, None, "cpu", 0.0, 0.0, 0.0) for _ in batch]

    jobs.CpuRunner.run = run  # type: ignore[method-assign,assignment]


def report(label: str, size: int) -> None:
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
    print(
        f"  device round trip: median {statistics.median(durations('device')) * 1e3:.1f} ms; "
        f"{len(batches)} batches of {statistics.mean(batches):.2f} chunks on average"
    )


async def trace(stack: Stack, frames: int, backend: str) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    data = synthetic_multiframe(frames, 512, 512)
    await harness.upload(stack, names.source_bucket, [("warm.dcm", data), ("big.dcm", data)])
    settings = harness.make_settings(
        stack, names, device=backend, part_size=str(8 << 20), ring_slots="32",
        sink="none", hook="ingest.bench_ours:bench_hook", source_hash="none",
        fetch_concurrency="16",
    )  # fmt: skip
    for key in ("warm.dcm", "big.dcm"):
        EVENTS.clear()
        note = harness.aws_notification(names.source_bucket, [key])
        await harness.publish(stack, names.source_topic, [note])
        await harness.run_worker(settings, stop_after=1)
        report(key, len(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("frames", type=int, help="512x512 16-bit frames (2048 = 1 GiB)")
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--zero-cost-device", action="store_true")
    args = parser.parse_args()
    instrument()
    if args.zero_cost_device:
        zero_cost_device()
    with embedded_stack() as stack:
        os.environ.update(stack.endpoints.environment())
        anyio.run(trace, stack, args.frames, args.device, backend="asyncio")


if __name__ == "__main__":
    main()
