"""Pinned H2D copies queued back to back against one at a time on an idle stream.

The bench's reference for "H2D / pinned copy" queues copies back to back and
times them with one pair of events, so the driver's cost of issuing each copy
is hidden behind the copies still running. A worker's copy is timed by the
events on either side of it; when the stream is idle (the sink's two 8 MiB
chunks in flight often leave it so), that interval also holds the time from the
first event until the copy reaches the DMA engine. This prints both rates for
each size, issued through ``ingest_gpu.driver`` as the worker's copies are.
``--copy-threads N`` runs N threads copying
64 MiB host arrays meanwhile (NumPy releases the GIL), the kind of host memory
traffic a sink-mode worker makes while its copies run (its results leaving
the pinned staging, its PUTs' sends).

    python3 -m ingest.bench.diagnostics.h2d_idle [--copy-threads N] [MiB ...]  (default: 0; 8 32)

Needs a CUDA device; not a test (the file name keeps pytest away).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ingest_gpu import driver
from ingest_gpu.enqueue import Enqueue

COPIES = 32
MiB = 1 << 20


@contextmanager
def host_copies(threads: int) -> Iterator[None]:
    """``threads`` threads copying 64 MiB between host arrays until the block ends."""
    stop = threading.Event()

    def copy() -> None:
        source, target = np.ones(64 * MiB, np.uint8), np.empty(64 * MiB, np.uint8)
        while not stop.is_set():
            np.copyto(target, source)

    workers = [threading.Thread(target=copy) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ingest.bench.diagnostics.h2d_idle")
    parser.add_argument("--copy-threads", type=int, default=0)
    parser.add_argument("sizes", nargs="*", type=int, default=[8, 32])
    args = parser.parse_args(argv)
    with host_copies(args.copy_threads):
        return measure(args.sizes)


def measure(sizes: list[int]) -> int:
    context = driver.primary_context(0)
    stream = driver.Stream(context)
    issue = Enqueue()
    start, end = driver.Event(context), driver.Event(context)
    for mib in sizes:
        nbytes = mib * MiB
        host = driver.pinned_array(context, nbytes)
        device = driver.DeviceMemory(context, nbytes)
        source = ctypes.addressof(host)
        for _ in range(3):  # warm-up
            issue.h2d(device.ptr, source, nbytes, stream)
        stream.synchronize()
        issue.record(start, stream)
        for _ in range(COPIES):
            issue.h2d(device.ptr, source, nbytes, stream)
        issue.record(end, stream)
        end.synchronize()
        queued = nbytes * COPIES / driver.elapsed_ms(start, end) / 1e6
        each = []
        for _ in range(COPIES):  # the stream is idle before each of these
            issue.record(start, stream)
            issue.h2d(device.ptr, source, nbytes, stream)
            issue.record(end, stream)
            end.synchronize()
            each.append(driver.elapsed_ms(start, end))
        idle = nbytes * COPIES / sum(each) / 1e6
        median_us = statistics.median(each) * 1000
        extra_us = median_us - nbytes / queued / 1e3
        print(
            f"{mib} MiB: back to back {queued:.1f} GB/s; one at a time on an idle stream "
            f"{idle:.1f} GB/s ({idle / queued:.3f}x; median {median_us:.0f} us a copy, "
            f"{extra_us:.0f} us more than at the queued rate)"
        )
        device.close()
        del host
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
