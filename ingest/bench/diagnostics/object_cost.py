"""The worker's CPU per object and per tile, by thread and by stage: where the time of small
objects and small tiles goes.

A diagnostic, not a test (pytest does not collect it). It starts the embedded stack,
uploads a shape's objects, and runs the real worker in this process (hook mode, sink
``none``, the bench's no-op hook): a warm-up of ``--warm`` objects, then the measured
ones, all announced at once as the bench does. It reports

- the process's CPU per object (and per frame) over the measured objects, split by
  thread from ``/proc/self/task/*/stat`` (the event loop, the device thread, the GET
  threads, the decoding pool's feeders, aiokafka's and the others);
- for each busy thread, where its running samples fall: a sampler thread reads every
  thread's Python stack every ``--interval-ms`` (``sys._current_frames``), drops the
  stacks that wait (a selector, a lock, a queue), and charges each remaining sample to
  the innermost frame of the product (``ingest/...`` or ``gpu/...``: the stage that asked
  for the work) and to the innermost frame of all (the function that did it); the
  shares times the thread's CPU give microseconds per object. The event loop's own C code
  (uvloop) is not sampled: the loop thread's CPU outside Python frames shows only in its
  total.

::

    .venv/bin/python -m ingest.bench.diagnostics.object_cost ct --objects 600
    .venv/bin/python -m ingest.bench.diagnostics.object_cost slide --tiles 4000 --tile 256
    python3 -m ingest.bench.diagnostics.object_cost ct-htj2k --corpus DIR --device cuda

``ct``: uncompressed 512x512 CT slices, one object each; ``ct-htj2k``, ``ct-j2k``: the
series of a corpus written by ``ingest.bench.workloads_compressed`` (``--corpus``; cycled
over to ``--objects``) or, without one, written here by imagecodecs; ``slide``: one slide
of ``--tiles`` JPEG tiles of ``--tile`` pixels (Pillow).
Sampling costs the process about a tenth of a core; the per-thread CPU is exact, the split
inside a thread is a sample.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer

from ingest.bench.diagnostics.trace_large import prepare
from ingest.embedded.stack import Stack, embedded_stack
from ingest.logs import configure_logging
from ingest.worker import Outcome, Worker

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
# A stack whose innermost frame is one of these waits: its samples are not CPU
IDLE_LEAVES = {
    ("selectors.py", "select"),
    ("threading.py", "wait"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("thread.py", "_worker"),
    ("connection.py", "_recv_bytes"),
    ("connection.py", "_recv"),
    ("connection.py", "wait"),
    ("selectors.py", "_select"),
    ("object_cost.py", "_sample"),
    ("runners.py", "run"),  # the event loop in C (uvloop): polling, or its own callbacks
}
ROOTS = (f"{os.sep}ingest{os.sep}", f"{os.sep}gpu{os.sep}")


DECODE_CALLS: list[tuple[float, float, int]] = []  # start, end, frames of each device decode


def time_device_decodes() -> None:
    """Record every ``NvDecoder.decode`` (the device thread's batched decode): when and how
    many frames, to tell a starved decoder from a busy one."""
    try:
        from ingest_gpu.decode import NvDecoder
    except ImportError:
        return
    decode = NvDecoder.decode

    def timed(self: Any, work: Any, stream_handle: int) -> Any:
        t0 = time.perf_counter()
        try:
            return decode(self, work, stream_handle)
        finally:
            frames = sum(len(encoded.frames) for encoded, _, _ in work)
            DECODE_CALLS.append((t0, time.perf_counter(), frames))

    NvDecoder.decode = timed  # type: ignore[method-assign]


def thread_cpu(*, system_only: bool = False) -> dict[int, float]:
    """CPU seconds (user + system, or system alone) of each thread of this process, by
    native id."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user = 0 if system_only else int(fields[11])
        out[int(task.name)] = (user + int(fields[12])) / CLOCK_TICK
    return out


def _where(frame: Any) -> tuple[str, str]:
    """The innermost product frame and the innermost frame, as ``file:function``."""
    leaf = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
    owner = "(outside the product)"
    while frame is not None:
        path = frame.f_code.co_filename
        if any(root in path for root in ROOTS) and "diagnostics" not in path:
            package = path.rsplit(f"{os.sep}ingest{os.sep}", 1)[-1]
            package = package.rsplit(f"{os.sep}gpu{os.sep}", 1)[-1] if "gpu" in path else package
            prefix = "gpu/" if f"{os.sep}gpu{os.sep}" in path else "ingest/"
            owner = f"{prefix}{package}:{frame.f_code.co_name}"
            break
        frame = frame.f_back
    return owner, leaf


class Sampler:
    """Every thread's stack every ``interval`` seconds, the waiting ones dropped."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.owners: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.leaves: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._stop = threading.Event()
        self._on = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            if not self._on.is_set():
                continue
            natives = {t.ident: t.native_id for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me or ident not in natives:
                    continue
                code = frame.f_code
                if (Path(code.co_filename).name, code.co_name) in IDLE_LEAVES:
                    continue
                owner, leaf = _where(frame)
                native = natives[ident] or 0
                self.owners[native][owner] += 1
                self.leaves[native][leaf] += 1

    def measuring(self, on: bool) -> None:
        if on:
            self._on.set()
        else:
            self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def shape_objects(args: Any, folder: Path) -> tuple[list[tuple[str, bytes]], int]:
    """The measured shape's objects and the frames they hold."""
    if args.shape == "ct":
        from ingest.embedded.samples import synthetic_ct_series

        return list(synthetic_ct_series(args.objects, rows=512, columns=512)), args.objects
    if args.shape == "slide":
        from ingest.embedded.samples_slide import write_jpeg_slide

        across = max(1, int(args.tiles**0.5))
        down = max(1, args.tiles // across)
        path = folder / "slide.dcm"
        write_jpeg_slide(
            path, tiles_across=across, tiles_down=down, tile=args.tile, quality=args.quality
        )
        return [("slide/slide.dcm", path.read_bytes())], across * down
    slices = list(_series(args.shape, args.corpus))
    objects = [
        (f"{args.shape}/slice-{i:05d}.dcm", slices[i % len(slices)]) for i in range(args.objects)
    ]
    return objects, args.objects


def _series(shape: str, corpus: Path | None) -> Iterator[bytes]:
    if corpus is not None:
        for path in sorted((corpus / shape).glob("*.dcm")):
            yield path.read_bytes()
        return
    from pydicom.uid import HTJ2KLossless, JPEG2000Lossless

    from ingest.embedded.samples_compressed import compressed_ct

    syntax = {"ct-htj2k": HTJ2KLossless, "ct-j2k": JPEG2000Lossless}
    for index in range(16):
        yield compressed_ct(syntax[shape], index)


async def announce(
    stack: Stack, topic: str, bucket: str, objects: Sequence[tuple[str, bytes]]
) -> None:
    import json

    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        for key, body in objects:
            record = {
                "eventVersion": "2.1",
                "eventSource": "aws:s3",
                "eventName": "ObjectCreated:Put",
                "s3": {"bucket": {"name": bucket}, "object": {"key": key, "size": len(body)}},
            }
            await producer.send(topic, json.dumps({"Records": [record]}).encode())
        await producer.flush()
    finally:
        await producer.stop()


async def measure(stack: Stack, args: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        objects, frames = shape_objects(args, Path(tmp))
        warm, _ = shape_objects(
            argparse.Namespace(
                **{**vars(args), "objects": args.warm, "tiles": min(args.tiles, 500)}
            ),
            Path(tmp),
        )
    warm = [(f"warm/{key}", body) for key, body in warm]
    overrides = {
        "device": args.device,
        "sink": "none",
        "hook": "ingest.bench.ours:bench_hook",
        **dict(item.split("=", 1) for item in args.set),
    }
    settings, bucket = prepare(stack, dict([*warm, *objects]), overrides)
    os.environ.update(stack.endpoints.environment())  # the worker's S3 credentials
    outcomes: list[Outcome] = []
    wanted = anyio.Event()
    target = [len(warm)]

    def on_outcome(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) >= target[0]:
            wanted.set()

    sampler = Sampler(args.interval_ms / 1000)
    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await announce(stack, settings.source_topic, bucket, warm)
        await wanted.wait()
        wanted = anyio.Event()
        target[0] += len(objects)
        names = {t.native_id: t.name for t in threading.enumerate()}
        before, t0 = thread_cpu(), time.perf_counter()
        before_system = thread_cpu(system_only=True)
        DECODE_CALLS.clear()
        sampler.measuring(True)
        profile = cProfile.Profile(time.thread_time) if args.profile else None
        if profile is not None:
            profile.enable()  # the event loop's thread only, its CPU time (not GIL waits)
        await announce(stack, settings.source_topic, bucket, objects)
        await wanted.wait()
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        sampler.measuring(False)
        after, wall = thread_cpu(), time.perf_counter() - t0
        after_system = thread_cpu(system_only=True)
        names |= {t.native_id: t.name for t in threading.enumerate()}
        worker.stop()
    sampler.close()
    failed = [o for o in outcomes if o.error is not None]
    system = {tid: after_system[tid] - before_system.get(tid, 0.0) for tid in after_system}
    report(args, objects, frames, before, after, system, wall, names, sampler, len(failed))
    if DECODE_CALLS:
        busy = sum(end - start for start, end, _ in DECODE_CALLS)
        first, last = DECODE_CALLS[0][0] - t0, DECODE_CALLS[-1][1] - t0
        sizes = sorted(n for _, _, n in DECODE_CALLS)
        print(
            f"   device decodes: {len(DECODE_CALLS)} calls, frames a call median "
            f"{sizes[len(sizes) // 2]} (max {sizes[-1]}); in them {busy:.3f} s of the "
            f"{wall:.3f} s; first starts at {first:.3f} s, last ends at {last:.3f} s"
        )
    if args.reference and args.shape != "ct":
        rate = reference_rate(args.shape, objects, frames)
        print(
            f"   nvImageCodec batched on the same frames: {rate:.0f} frames/s; "
            f"the worker {frames / wall / rate:.2f}x"
        )


def reference_rate(shape: str, objects: Sequence[tuple[str, bytes]], frames: int) -> float:
    """nvImageCodec's batched decode of the objects' frames (the bench's ``nvimgcodec``
    reader, the codestreams held in memory), frames/s: the best of three passes after a
    warm-up. A series is cut to its first 2,000 objects."""
    from pydicom import dcmread

    from ingest.bench.decode_gpu import NvImageCodecReader
    from ingest.bench.workloads import BenchObject, Workload

    kept = objects[:2000]
    count = frames if len(kept) == len(objects) else len(kept)
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"{index}.dcm" for index in range(len(kept))]
        for path, (_, body) in zip(files, kept, strict=True):
            path.write_bytes(body)
        ds = dcmread(files[0], stop_before_pixels=True)
        frame_bytes = ds.Rows * ds.Columns * ds.SamplesPerPixel * ds.BitsAllocated // 8
        workload = Workload(
            shape,
            tuple(BenchObject(key, len(body)) for key, body in kept),
            frames=count,
            frame_bytes=frame_bytes,
            files=tuple(files),
        )
        reader = NvImageCodecReader()
        reader.prepare(workload)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            reader.run(workload)
            times.append(time.perf_counter() - t0)
        reader.close()
    return count / min(times[1:])


def report(
    args: Any,
    objects: Sequence[tuple[str, bytes]],
    frames: int,
    before: dict[int, float],
    after: dict[int, float],
    system: dict[int, float],
    wall: float,
    names: dict[int | None, str],
    sampler: Sampler,
    failed: int,
) -> None:
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(used.values())
    count = len(objects)
    print(
        f"== {args.shape} on {args.device}: {count} objects, {frames} frames, {wall:.2f} s "
        f"({count / wall:.0f} objects/s, {frames / wall:.0f} frames/s); failed {failed}"
    )
    print(
        f"   process CPU {total:.2f} s: {total / count * 1e3:.3f} ms an object, "
        f"{total / frames * 1e6:.1f} us a frame"
    )
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for tid in used:
        by_name[names.get(tid, "(ended)").rstrip("0123456789_-")].append(tid)
    rows = sorted(by_name.items(), key=lambda kv: -sum(used[t] for t in kv[1]))
    for name, tids in rows:
        cpu = sum(used[t] for t in tids)
        if cpu < 0.02 * total:
            continue
        kernel = sum(system.get(t, 0.0) for t in tids)
        print(
            f"-- {name} ({len(tids)} threads): {cpu / frames * 1e6:.1f} us a frame "
            f"({kernel / frames * 1e6:.1f} of them in the kernel)"
        )
        for table in (sampler.owners, sampler.leaves):
            merged: collections.Counter[str] = collections.Counter()
            for tid in tids:
                merged.update(table.get(tid, {}))
            samples = sum(merged.values())
            for where, n in merged.most_common(args.top):
                print(
                    f"     {n / samples * cpu / frames * 1e6:8.1f} us  {n / samples:5.1%}  {where}"
                )
            print("     --")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=("ct", "ct-htj2k", "ct-j2k", "slide"))
    parser.add_argument("--objects", type=int, default=600)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--tiles", type=int, default=4000)
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--quality", type=int, default=85, help="the slide's JPEG quality")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval")
    parser.add_argument("--reference", action="store_true", help="nvImageCodec batched too")
    parser.add_argument("--set", action="append", default=[], help="a worker setting, NAME=VALUE")
    parser.add_argument(
        "--profile", type=Path, default=None, help="cProfile the event loop's thread into FILE"
    )
    args = parser.parse_args(argv)
    configure_logging(json=True, level=logging.INFO)  # the worker's own lines, as it writes them

    time_device_decodes()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1000)
    with embedded_stack() as stack:
        anyio.run(measure, stack, args, backend_options={"use_uvloop": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
