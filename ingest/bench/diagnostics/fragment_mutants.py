"""Mutated Encapsulated Uncompressed objects: each is refused, or read as pydicom reads it.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.fragment_mutants [COUNT]

It makes COUNT (3,000) mutants (1-3 byte flips, sets, insertions, deletions or
a truncation, half of them in the Pixel Data's items) of three Encapsulated
Uncompressed objects (a Basic Offset Table, none, an Extended Offset Table),
runs each the way the worker does (header, the read plan at 64 KiB parts, the
item checks of every chunk, the NumPy twin) and compares what it gives with
``tests.reference`` (pydicom's ``generate_frames``). It fails on any object the
worker would process differently from the reference, or on any error that is
not an ``IngestError`` (a crash), and prints the counts. The mutants are drawn
from a fixed seed, so a failure reproduces.
"""

from __future__ import annotations

import random
import sys

import numpy as np

from gpu.jobs import ChunkJob, CpuRunner
from ingest.dicom.fragments import check_items
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded.samples import synthetic_rgb
from ingest.errors import IngestError
from ingest.pipeline.jobs import pixel_chunks
from tests import bad_inputs
from tests.reference import reference_array

PIXEL_DATA = b"\xe0\x7f\x10\x00OB"


def mutant(base: bytes, rng: random.Random) -> bytes:
    data = bytearray(base)
    for _ in range(rng.randint(1, 3)):
        start = data.rfind(PIXEL_DATA)
        if not data:
            break
        at = rng.randrange(start if start >= 0 and rng.random() < 0.5 else 0, len(data))
        kind = rng.choice(("flip", "set", "insert", "delete", "truncate"))
        if kind == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "set":
            data[at] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0x20))
        elif kind == "insert":
            data[at:at] = rng.randbytes(rng.randint(1, 12))
        elif kind == "delete":
            del data[at : at + rng.randint(1, 40)]
        else:
            del data[at:]
    return bytes(data)


def as_the_worker_reads(data: bytes) -> np.ndarray:
    """The float32 values the worker would write, or the IngestError it would raise."""
    header = parse_header(data, len(data), max_header_bytes=bad_inputs.MAX_HEADER_BYTES)
    if not isinstance(header, DicomHeader):
        raise IngestError("the header does not end inside the object")
    part = bad_inputs.PART_SIZE if len(data) > bad_inputs.PART_SIZE else len(data) + 16
    values = []
    for chunk in pixel_chunks(header, part):
        view = memoryview(data)[chunk.range.start : chunk.range.end]
        if len(view) < chunk.range.length:
            raise IngestError("a range past the end (the worker's GET would fail)")
        check_items(view, chunk)
        job = ChunkJob(
            chunk.samples(view), header.pixel, header.transform(None, "float32"),
            chunk.first_element, lambda: None, pitch=chunk.pitch,
        )  # fmt: skip
        (result,) = CpuRunner().run([job])
        if isinstance(result, BaseException):
            raise result
        assert result.host is not None
        values.append(result.host)
    return np.concatenate(values)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rng = random.Random(5)
    bases = (
        bad_inputs.encapsulated_small(),
        bad_inputs.encapsulated_large(),
        synthetic_rgb(6, 20, 21, encapsulated="extended"),
    )
    processed = refused = 0
    for _ in range(count):
        data = mutant(rng.choice(bases), rng)
        try:
            ours = as_the_worker_reads(data)
        except IngestError:
            refused += 1
            continue
        expected = reference_array(data, None, "float32").ravel()
        if not np.array_equal(ours, expected, equal_nan=True):
            raise SystemExit(f"processed differently from pydicom: {data[:16]!r}...")
        processed += 1
    print(f"{count} mutants: {processed} processed as pydicom reads them, {refused} refused")


if __name__ == "__main__":
    main()
