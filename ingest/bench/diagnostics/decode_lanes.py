"""Does a compressed CT frame decode faster with more than one decode call under way?

A diagnostic, not a test (pytest does not collect it). On the GPU machine, with a
corpus written where imagecodecs is installed
(``python -m ingest.bench.workloads_compressed --write DIR``)::

    python3 -m ingest.bench.diagnostics.decode_lanes --corpus DIR [--workload ct-htj2k]
        [--frames 4800] [--batches 128,256] [--lanes 1,2,3] [--busy N]

It takes the frames of the corpus's slices of ``--workload`` (cycled to ``--frames``)
and times nvImageCodec decoding all of them into one device array:

- ``reference``: the bench's ceiling, nvImageCodec's Python module, one call a batch
  of 128, stream 0;
- ``calls L x B``: the worker's decoder (``ingest_gpu.decode.NvDecoder``), batches of B,
  L decoders in L threads, each on a stream of its own, taking the next batch as they
  finish one; L = 1 is the device thread as it is;
- ``ahead L x B``: one thread and L decoders (``ingest_gpu.nvimgcodec_api``), each
  batch's call started before the oldest of the L under way is waited for;
- ``split L x B``: the same, but each batch cut into L calls started together and all
  waited for before the next batch starts.

For each it prints frames/s (best of three passes) and the process's CPU a frame,
nvImageCodec's threads included. HTJ2K decodes its packet headers (tier 2) on the
host, so a call's host threads work and then wait for the device; calls that overlap
keep the cores busy through each other's device time. ``--busy N`` keeps N processes
spinning meanwhile, as the S3 server and the worker's own threads share the host.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ingest.bench.diagnostics.decode_backends import _spin


def _frames(corpus: Path, workload: str, count: int) -> tuple[list[bytes], Any]:
    """``count`` frames cycled over the corpus's slices, and the first slice's header."""
    from pydicom import dcmread
    from pydicom.encaps import generate_frames

    from ingest.bench.workloads_compressed import corpus_files

    paths = corpus_files(corpus, workload)
    if not paths:
        raise SystemExit(f"no {workload} objects in {corpus}")
    distinct: list[bytes] = []
    for path in paths:
        ds = dcmread(path)
        distinct.extend(generate_frames(ds.PixelData, number_of_frames=1))
    header = dcmread(paths[0], stop_before_pixels=True)
    return [bytes(f) for f in itertools.islice(itertools.cycle(distinct), count)], header


def _timed(run: Callable[[], None], count: int) -> tuple[float, float]:
    """(frames/s of the best of three passes, CPU seconds a frame over them)."""
    run()
    cpu0, best = time.process_time(), float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return count / best, (time.process_time() - cpu0) / (3 * count)


@dataclasses.dataclass
class _Case:
    """The frames, parsed once, and the device array they decode into."""

    frames: list[bytes]
    parsed: list[Any]
    fmt: Any
    arena: Any

    @property
    def count(self) -> int:
        return len(self.frames)


def _reference(case: _Case) -> Callable[[], None]:
    """The bench's ceiling, as its ``NvImageCodecReader`` calls nvImageCodec."""
    import cupy
    import numpy as np
    from nvidia import nvimgcodec

    from ingest_gpu.decode import OPTIONS

    decoder = nvimgcodec.Decoder(device_id=0, options=OPTIONS)
    params = nvimgcodec.DecodeParams(
        allow_any_depth=True, color_spec=nvimgcodec.ColorSpec.UNCHANGED
    )
    arrays = [np.frombuffer(f, np.uint8) for f in case.frames]

    def run() -> None:
        for first in range(0, case.count, 128):
            streams = [nvimgcodec.CodeStream(a) for a in arrays[first : first + 128]]
            decoder.decode(streams, params=params, cuda_stream=0)
        cupy.cuda.Device(0).synchronize()

    return run


def _calls(case: _Case, lanes: int, batch: int) -> Callable[[], None]:
    """``lanes`` threads, each with the worker's decoder and a stream of its own."""
    import cupy

    from ingest_gpu.decode import EncodedFrames, NvDecoder

    decoders = [NvDecoder(0, {}) for _ in range(lanes)]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(lanes)]
    jobs = []
    for first in range(0, case.count, batch):
        end = min(case.count, first + batch)
        encoded = EncodedFrames(
            tuple(case.frames[first:end]), "unchanged", tuple(case.parsed[first:end])
        )
        fmt = dataclasses.replace(case.fmt, frames=end - first)
        jobs.append([(encoded, fmt, case.arena[first].data.ptr)])

    def lane(k: int, queue: collections.deque[Any], lock: threading.Lock) -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.popleft()
            failed = decoders[k].decode(job, streams[k].ptr)
            if failed[0] is not None:
                raise RuntimeError(f"a batch did not decode: {failed[0]}")

    def run() -> None:
        queue, lock = collections.deque(jobs), threading.Lock()
        threads = [threading.Thread(target=lane, args=(k, queue, lock)) for k in range(lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in streams:
            s.synchronize()

    return run


def _ahead(
    case: _Case, lanes: int, batch: int, started: list[float], split: bool = False
) -> Callable[[], None]:
    """One thread, ``lanes`` decoders: each call started before the oldest is waited for;
    ``started`` adds up the time the start calls took. ``split``: each batch is cut into
    ``lanes`` calls, started together and all waited for before the next batch."""
    import cupy

    from ingest_gpu import nvimgcodec_api as api
    from ingest_gpu.decode import BACKENDS, OPTIONS

    lib = api.library()
    decoders = [
        api.Decoder(0, options=OPTIONS, backends=BACKENDS["hardware"]) for _ in range(lanes)
    ]
    stream = cupy.cuda.Stream(non_blocking=True)
    images = [
        api.Image(lib, case.arena[i].data.ptr, case.parsed[i].declared, "unchanged", stream.ptr)
        for i in range(case.count)
    ]
    starts = list(range(0, case.count, batch))

    def wait(pending: collections.deque[Any]) -> None:
        if not all(pending.popleft().wait()):
            raise RuntimeError("a frame did not decode")

    def run_split() -> None:
        part = -(-batch // lanes)
        for first in starts:
            end = min(case.count, first + batch)
            pending: collections.deque[Any] = collections.deque()
            for k, at in enumerate(range(first, end, part)):
                t0 = time.perf_counter()
                to = min(end, at + part)
                pending.append(decoders[k].start(case.parsed[at:to], images[at:to]))
                started[0] += time.perf_counter() - t0
            while pending:
                wait(pending)
        stream.synchronize()

    def run() -> None:
        pending: collections.deque[Any] = collections.deque()
        for n, first in enumerate(starts):
            if len(pending) == lanes:
                wait(pending)
            t0 = time.perf_counter()
            call = decoders[n % lanes].start(
                case.parsed[first : first + batch], images[first : first + batch]
            )
            pending.append(call)
            started[0] += time.perf_counter() - t0
        while pending:
            wait(pending)
        stream.synchronize()

    return run_split if split else run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--workload", default="ct-htj2k")
    parser.add_argument("--frames", type=int, default=4800)
    parser.add_argument("--batches", default="128,256,512")
    parser.add_argument("--lanes", default="1,2,3")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args(argv)

    import cupy

    from ingest_gpu.decode import parse_each
    from ingest_gpu.formats import PixelFormat

    frames, header = _frames(args.corpus, args.workload, args.frames)
    rows, columns = int(header.Rows), int(header.Columns)
    signed = bool(header.PixelRepresentation)
    fmt = PixelFormat(rows, columns, 1, 1, 16, int(header.BitsStored), signed, False)
    arena = cupy.zeros((len(frames), rows, columns), dtype=cupy.int16 if signed else cupy.uint16)
    case = _Case(frames, [], fmt, arena)
    for each in parse_each(frames, fmt, "unchanged"):
        if isinstance(each, Exception):
            raise SystemExit(f"a frame cannot go to the device: {each}")
        case.parsed.append(each)
    print(
        f"{case.count} frames of {args.workload},"
        f" {sum(map(len, frames)) / case.count / 1e3:.0f} KB each"
    )

    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        rate, cpu = _timed(_reference(case), case.count)
        print(f"reference   1 x 128: {rate:8.0f} frames/s, {cpu * 1e6:7.0f} CPU us a frame")
        for batch in (int(b) for b in args.batches.split(",")):
            for lanes in (int(n) for n in args.lanes.split(",")):
                rate, cpu = _timed(_calls(case, lanes, batch), case.count)
                print(
                    f"calls     {lanes:3d} x {batch:3d}: {rate:8.0f} frames/s,"
                    f" {cpu * 1e6:7.0f} CPU us a frame"
                )
                started = [0.0]
                rate, cpu = _timed(_ahead(case, lanes, batch, started), case.count)
                calls = 4 * -(-case.count // batch)
                print(
                    f"ahead     {lanes:3d} x {batch:3d}: {rate:8.0f} frames/s,"
                    f" {cpu * 1e6:7.0f} CPU us a frame;"
                    f" a start call {started[0] / calls * 1e3:.2f} ms"
                )
                if lanes > 1:
                    rate, cpu = _timed(_ahead(case, lanes, batch, [0.0], True), case.count)
                    print(
                        f"split     {lanes:3d} x {batch:3d}: {rate:8.0f} frames/s,"
                        f" {cpu * 1e6:7.0f} CPU us a frame"
                    )
    finally:
        stop.set()
        for p in spinners:
            p.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
