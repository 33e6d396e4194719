"""Which shape of nvImageCodec decode call is fast on slide tiles?

A diagnostic, not a test (pytest does not collect it). On the GPU machine::

    python3 -m ingest.bench.diagnostics.decode_call_shapes 256 12000
    python3 -m ingest.bench.diagnostics.decode_call_shapes 512 4000

It writes a slide of TILES JPEG tiles of TILE pixels (Pillow, as the bench's ``slide``),
splits its frames with pydicom, and times nvImageCodec alone decoding all of them, one call
a batch, for every combination of: the batch size; outputs that nvImageCodec allocates or
images wrapping one device array (``nvimgcodec.as_image``, as the worker's arena); stream 0
or a stream of its own; ``CodeStream`` objects made in the loop or ahead of it (as the
worker's splitting thread does). It prints tiles/s, the best of three passes: what the
worker's device thread could reach with each shape, with nothing else running.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _tiles(tile: int, count: int) -> list[Any]:
    import numpy as np
    from pydicom import dcmread
    from pydicom.encaps import generate_frames

    from ingest.embedded.samples_slide import write_jpeg_slide

    across = max(1, int(count**0.5))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slide.dcm"
        write_jpeg_slide(path, tiles_across=across, tiles_down=max(1, count // across), tile=tile)
        ds = dcmread(path)
        frames = generate_frames(ds.PixelData, number_of_frames=int(ds.NumberOfFrames))
        return [np.frombuffer(frame, np.uint8) for frame in frames]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("tile", type=int, help="the tiles' side in pixels")
    parser.add_argument("tiles", type=int, help="how many tiles")
    parser.add_argument("--batches", default="64,128,256,512")
    args = parser.parse_args(argv)

    import cupy
    from nvidia import nvimgcodec

    frames = _tiles(args.tile, args.tiles)
    count = len(frames)
    decoder = nvimgcodec.Decoder(device_id=0, options=":fancy_upsampling=1")
    params = nvimgcodec.DecodeParams(allow_any_depth=True, color_spec=nvimgcodec.ColorSpec.SRGB)
    arena = cupy.empty((count, args.tile, args.tile, 3), dtype=cupy.uint8)
    own = cupy.cuda.Stream(non_blocking=True)
    ahead = [nvimgcodec.CodeStream(frame) for frame in frames]
    for stream in ahead:
        _ = stream.height  # parsed, as the worker's splitting thread leaves them
    wrapped: dict[tuple[int, int, int], list[Any]] = {}

    def images(first: int, end: int, handle: int) -> list[Any]:
        key = (first, end, handle)
        if key not in wrapped:
            wrapped[key] = [
                nvimgcodec.as_image(arena[i], cuda_stream=handle) for i in range(first, end)
            ]
        return wrapped[key]

    def run(batch: int, into: bool, own_stream: bool, made_ahead: bool) -> float:
        handle = own.ptr if own_stream else 0
        t0 = time.perf_counter()
        for first in range(0, count, batch):
            end = min(count, first + batch)
            streams = (
                ahead[first:end]
                if made_ahead
                else [nvimgcodec.CodeStream(f) for f in frames[first:end]]
            )
            outputs = {"images": images(first, end, handle)} if into else {}
            done = decoder.decode(streams, params=params, cuda_stream=handle, **outputs)
            if any(image is None for image in done):
                raise RuntimeError(f"a tile of batch {first}..{end} did not decode")
        (own if own_stream else cupy.cuda.Stream.null).synchronize()
        return time.perf_counter() - t0

    sizes = sum(len(frame) for frame in frames) / count / 1e3
    print(f"{count} tiles of {args.tile}, {sizes:.1f} KB each")
    for batch, into, own_stream, made_ahead in itertools.product(
        (int(b) for b in args.batches.split(",")), (False, True), (False, True), (False, True)
    ):
        best = min(run(batch, into, own_stream, made_ahead) for _ in range(3))
        print(
            f"batch {batch:4d} into={'arena' if into else 'own  '} "
            f"stream={'own' if own_stream else '0  '} ahead={made_ahead!s:5}: "
            f"{count / best:8.0f} tiles/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
