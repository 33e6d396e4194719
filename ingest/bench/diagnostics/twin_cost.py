"""Time of the NumPy twin on a CT slice and on the bench's large object, float32 and float64.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.twin_cost

Both inputs take the float32 path (``ingest_gpu.preprocess.exact_in_float32``); each
is run again with that path switched off, so the float64 steps do the work.
"""

from __future__ import annotations

import time
from unittest import mock

import numpy as np

import ingest_gpu.preprocess
from ingest.embedded.samples_multiframe import frame_rescale as _frame_rescale
from ingest_gpu.formats import PixelFormat, Transform


def best_seconds(raw: np.ndarray, fmt: PixelFormat, transform: Transform, repeats: int) -> float:
    out = np.empty(fmt.total_elements, dtype=np.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ingest_gpu.preprocess.preprocess_numpy(raw, fmt, transform, 0, out)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    ct = PixelFormat(512, 512, 1, 1, 16, 12, True, False)
    frames = 64
    large = PixelFormat(512, 512, frames, 1, 16, 16, True, False)
    pairs = [_frame_rescale(i) for i in range(frames)]
    cases = [
        ("CT slice", ct, Transform((1.0,), (-1024.0,), True), 200, 1e6, "us"),
        (
            f"large object, {frames} frames",
            large,
            Transform(tuple(float(s) for s, _ in pairs), tuple(float(i) for _, i in pairs), True),
            5,
            None,
            "s/GB",
        ),
    ]
    for name, fmt, transform, repeats, scale, unit in cases:
        raw = rng.integers(-2048, 2047, fmt.total_elements, dtype=np.int16).view(np.uint8)
        per = scale if scale is not None else 1e9 / raw.nbytes
        fast = best_seconds(raw, fmt, transform, repeats) * per
        with mock.patch.object(ingest_gpu.preprocess, "exact_in_float32", return_value=False):
            slow = best_seconds(raw, fmt, transform, repeats) * per
        print(f"{name}: float32 {fast:.3g} {unit}, float64 {slow:.3g} {unit}")


if __name__ == "__main__":
    main()
