"""Seconds to parse a header: the raw readers against pydicom alone.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.header_cost [FRAMES] [--volume-corpus DIR]

It builds a synthetic Enhanced-CT-like object with per-frame rescale values
(``ingest.embedded.samples.synthetic_multiframe``) and parses its header three ways:
the layout only (``per_frame=False``, what a large object waits for before its
reads start), without the frames' plane positions (``geometry=False``, what a
compressed object's frames wait for), in full as the worker then does
(``ingest/dicom/frames.py`` reads the per-frame values), and with that walker
switched off, so pydicom reads every frame's functional groups. Then a CT slice
of the bench's series, read straight from its bytes (``ingest/dicom/direct.py``)
and by pydicom. ``--volume-corpus DIR`` parses the header of the bench's
``ct-htj2k-volume`` of FRAMES frames instead of the synthetic object (made from a decode
corpus's slices, as ``trace_large --volume-corpus`` makes it): its per-frame groups
hold plane positions besides the rescale values.
docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

import ingest.dicom.parse
import ingest.dicom.rescale
from ingest.embedded.samples import synthetic_ct_series, synthetic_multiframe


def seconds(data: bytes, per_frame: bool = True, repeats: int = 5, geometry: bool = True) -> float:
    """The best of ``repeats`` parses (the first one warms pydicom up)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ingest.dicom.parse.parse_header(
            data[: 4 << 20], len(data), per_frame=per_frame, geometry=geometry
        )
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("frames", type=int, nargs="?", default=2048)
    parser.add_argument("--volume-corpus", type=Path, help="the bench's HTJ2K volume instead")
    args = parser.parse_args()
    frames = args.frames
    if args.volume_corpus is None:
        data = synthetic_multiframe(frames, 8, 8)
    else:
        from ingest.bench.diagnostics.trace_large import volume

        data = volume(args.volume_corpus, "ct-htj2k", frames)
    print(f"{frames} frames, layout only:        {seconds(data, per_frame=False):.4f} s")
    print(f"{frames} frames, no plane positions: {seconds(data, geometry=False):.4f} s")
    print(f"{frames} frames, with the walker:    {seconds(data):.4f} s")
    with mock.patch.object(ingest.dicom.rescale, "per_frame_rescale", return_value=None):
        print(f"{frames} frames, pydicom alone:      {seconds(data):.4f} s")
    ct = synthetic_ct_series(1)[0][1]
    print(f"CT slice, read directly:     {seconds(ct, repeats=200) * 1e6:.0f} us")
    with mock.patch.object(ingest.dicom.parse, "read_plain_header", return_value=None):
        print(f"CT slice, pydicom alone:     {seconds(ct, repeats=200) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
