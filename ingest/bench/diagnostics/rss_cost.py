"""Resident memory of a worker process, step by step, before its first object.

A diagnostic, not a test (pytest does not collect it)::

    python3 -m ingest.bench.diagnostics.rss_cost [cuda|cpu]

It prints the process's resident set (``VmRSS``) after each step a worker
takes before it reads an object: the interpreter and NumPy, importing the
worker (aiokafka, botocore, pydicom, cryptography, structlog), starting the
device thread (the CUDA context and the shipped kernel, through the driver),
allocating the ring at the default size, and on CUDA importing CuPy, which
only a worker with a hook does. Each line splits the growth into anonymous
memory and file-backed pages (shared libraries, mostly), and at the end the
mappings that hold the most resident memory. docs/benchmarks.md quotes it to
say what the ``ring + 300 MB`` target meets in a CUDA process.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from collections.abc import Callable

MiB = 1024 * 1024


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(value.split()[0]) * 1024
    return out


def largest_mappings(count: int = 10) -> list[tuple[str, int]]:
    """Resident bytes per mapped file (or ``[anon]``), the largest first."""
    by_name: Counter[str] = Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif first == "Rss:":
                by_name[name] += int(line.split()[1]) * 1024
    return by_name.most_common(count)


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    steps: list[tuple[str, Callable[[], object]]] = []
    held: list[object] = []

    def import_worker() -> object:
        import ingest.worker

        return ingest.worker

    def import_cupy() -> object:
        import cupy

        return cupy

    def start_device() -> object:
        from ingest_gpu.thread import DeviceThread

        thread = DeviceThread(device)  # type: ignore[arg-type]
        thread.start()
        held.append(thread)
        return thread

    def allocate_ring() -> object:
        from ingest.settings import Settings
        from ingest_gpu.thread import DeviceThread

        defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
        part_size, slots = defaults["part_size"], defaults["ring_slots"]
        assert isinstance(part_size, int)
        assert isinstance(slots, int)
        thread = held[0]
        assert isinstance(thread, DeviceThread)
        ring = thread.alloc_host(part_size * slots)
        ring.view[::4096] = b"\1" * len(ring.view[::4096])  # touched, as reads will
        held.append(ring)
        return ring

    steps.append(("import the worker's modules", import_worker))
    steps.append((f"device thread started ({device})", start_device))
    steps.append(("ring allocated (default size)", allocate_ring))
    if device == "cuda":  # only a worker with a hook imports CuPy (its arrays)
        steps.append(("import cupy (a hook's arrays)", import_cupy))

    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset)')}")
    import numpy  # noqa: F401  (the first line's; ingest imports it anyway)

    before = status()
    print(f"{'step':40} {'RSS MiB':>8} {'+anon':>7} {'+file':>7} {'+shmem':>7}")
    print(f"{'python + numpy':40} {before['VmRSS'] / MiB:8.0f}")
    for label, step in steps:
        step()
        now = status()
        grew = {k: (now[k] - before[k]) / MiB for k in now}
        print(
            f"{label:40} {now['VmRSS'] / MiB:8.0f} {grew['RssAnon']:+7.0f} "
            f"{grew['RssFile']:+7.0f} {grew['RssShmem']:+7.0f}"
        )
        before = now
    print("largest resident mappings (MiB):")
    for name, size in largest_mappings():
        print(f"  {size / MiB:8.1f}  {name}")


if __name__ == "__main__":
    main()
