"""What compressing a slide's OME-Zarr chunks would give and cost, on one core.

A diagnostic, not a test (pytest does not collect it); it needs numcodecs (the
extra ``dev`` installs it with zarr)::

    .venv/bin/python -m ingest.bench.diagnostics.zarr_codecs [--tile 256] [--quality 85]

The chunks are those ``SLIDE_LAYOUT=ome-zarr`` writes for the bench's slide: the
sample writer's distinct tissue tiles (``ingest.embedded.samples_slide``), JPEG
encoded at ``--quality`` and decoded by Pillow, as ``(3, tile, tile)`` uint8
planes. Each codec compresses every chunk five times on this thread (Blosc with
one thread); the ratio is the chunks' bytes over the compressed bytes, the rate
the chunks' bytes over the time.
"""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

import numpy as np
from numcodecs import LZ4, Blosc, Zstd
from PIL import Image

from ingest.embedded.samples_slide import jpeg_rgb, tissue_tile

DISTINCT = 61  # as many distinct tiles as the bench's slide has
ROUNDS = 5


def chunks(tile: int, quality: int) -> list[np.ndarray]:
    """The decoded distinct tiles, each as the chunk the writer makes: (3, tile, tile)."""
    out = []
    for k in range(DISTINCT):
        encoded = jpeg_rgb(tissue_tile(k, tile, tile), quality)
        decoded = np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB"))
        out.append(np.ascontiguousarray(np.moveaxis(decoded, -1, 0)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--quality", type=int, default=85)
    args = parser.parse_args()
    planes = chunks(args.tile, args.quality)
    raw = sum(c.nbytes for c in planes)
    Blosc.use_threads = False
    codecs: list[tuple[str, Any]] = [
        ("zstd level 1", Zstd(level=1)),
        ("blosc zstd 1 shuffle", Blosc("zstd", 1, Blosc.SHUFFLE)),
        ("blosc lz4 5 shuffle", Blosc("lz4", 5, Blosc.SHUFFLE)),
        ("lz4", LZ4()),
    ]
    print(f"{len(planes)} chunks of 3 x {args.tile} x {args.tile} uint8, JPEG q{args.quality}")
    for name, codec in codecs:
        started = time.perf_counter()
        packed = 0
        for _ in range(ROUNDS):
            packed += sum(len(codec.encode(c)) for c in planes)
        seconds = time.perf_counter() - started
        print(
            f"{name:22s} ratio {ROUNDS * raw / packed:5.2f}  "
            f"{ROUNDS * raw / seconds / 1e6:7.0f} MB/s of chunks, one core"
        )


if __name__ == "__main__":
    main()
