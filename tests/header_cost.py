"""Seconds to parse a multi-frame header: the raw per-frame walker against pydicom alone.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m tests.header_cost [FRAMES]

It builds a synthetic Enhanced-CT-like object with per-frame rescale values
(``ingest.samples.synthetic_multiframe``) and parses its header twice: as the
worker does (``ingest/dicom_frames.py`` reads the per-frame values), and with
that walker switched off, so pydicom reads every frame's functional groups.
docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import sys
import time
from unittest import mock

import ingest.dicom
import ingest.dicom_rescale
from ingest.samples import synthetic_multiframe


def seconds(data: bytes) -> float:
    started = time.perf_counter()
    ingest.dicom.parse_header(data[: 4 << 20], len(data))
    return time.perf_counter() - started


def main() -> None:
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    data = synthetic_multiframe(frames, 8, 8)
    print(f"{frames} frames, with the walker: {seconds(data):.3f} s")
    with mock.patch.object(ingest.dicom_rescale, "per_frame_rescale", return_value=None):
        print(f"{frames} frames, pydicom alone:   {seconds(data):.3f} s")


if __name__ == "__main__":
    main()
