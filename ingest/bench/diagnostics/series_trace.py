"""Trace a series volume's last steps and its parts' PUTs, in ``series_cost``'s passes.

A diagnostic, not a test (pytest does not collect it). It runs
``ingest.bench.diagnostics.series_cost`` (same arguments) and wraps, on the
classes and for this process only, the assembler's steps (``assemble``, the
plan's reads, the writing, the marker's removal), the streamed volume's
(``finish``, each part's PUT, ``complete``) and the sink's listings, deletes and
part uploads, to time each call::

    .venv/bin/python -m ingest.bench.diagnostics.series_trace --slices 300 --passes 1 \\
        --device cpu --set series_slices=hold
    python3 -m ingest.bench.diagnostics.series_trace --device cuda --slices 300 --passes 1 \\
        --set series_slices=hold                                  # on the GPU machine

After ``series_cost``'s own lines it prints every call that ended after the last
volume pass's last ``assemble`` began (seconds from that start: start, end,
length), then every part upload of that pass (its length and size) and their
median and largest. docs/benchmarks.md quotes its figures.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ingest.bench.diagnostics import series_cost
from ingest.pipeline import series
from ingest.sink import output

# (start, end, what, its first argument shortened)
_CALLS: list[tuple[float, float, str, str]] = []
_PARTS: list[tuple[float, float, int, int]] = []  # start, end, part number, bytes


def _timed(cls: type, name: str) -> None:
    inner: Callable[..., Awaitable[Any]] = getattr(cls, name)

    @functools.wraps(inner)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await inner(*args, **kwargs)
        finally:
            what = str(args[1])[:48] if len(args) > 1 else ""
            _CALLS.append((began, time.perf_counter(), f"{cls.__name__}.{name}", what))

    setattr(cls, name, timed)


def _parts_timed() -> None:
    inner = output.OutputSink._upload_part

    async def timed(
        self: output.OutputSink, key: str, upload: str | None, number: int, body: list[memoryview]
    ) -> str:
        began = time.perf_counter()
        try:
            return await inner(self, key, upload, number, body)
        finally:
            _PARTS.append((began, time.perf_counter(), number, sum(map(len, body))))

    output.OutputSink._upload_part = timed  # type: ignore[method-assign,assignment]


def main() -> None:
    args = series_cost.arguments().parse_args()
    for name in ("assemble", "_write_plan", "_read_members", "_spill_series", "_forget"):
        _timed(series.SeriesAssembler, name)
    for name in ("finish", "complete", "_put"):
        _timed(series._Stream, name)
    for name in ("keys", "delete"):
        _timed(output.OutputSink, name)
    _parts_timed()
    anyio.run(series_cost.main, args)
    assembled = [c for c in _CALLS if c[2] == "SeriesAssembler.assemble"]
    if not assembled:
        print("no volume was assembled")
        return
    start = assembled[-1][0]
    print("the last volume's steps (s from its assemble: start, end, length)")
    for began, ended, what, argument in sorted(c for c in _CALLS if c[1] >= start):
        print(f"{began - start:8.3f} {ended - start:8.3f} {ended - began:7.3f} {what} {argument}")
    # the last volume pass's parts: those begun after the volume before it was written
    before = max((ended for _, ended, _, _ in assembled[:-1]), default=float("-inf"))
    parts = [p for p in _PARTS if p[0] > before]
    lengths = [ended - began for began, ended, _, _ in parts]
    for began, ended, number, size in sorted(parts):
        print(f"part {number}: {ended - began:.3f} s, {size / 2**20:.1f} MiB")
    if lengths:
        median, largest = statistics.median(lengths), max(lengths)
        print(f"{len(lengths)} parts: median {median:.3f} s, largest {largest:.3f} s")


if __name__ == "__main__":
    main()
