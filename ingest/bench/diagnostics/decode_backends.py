"""Which nvImageCodec backends decode slide tiles fastest, at what CPU cost, and do they
give the same pixels?

A diagnostic, not a test (pytest does not collect it). On the GPU machine::

    python3 -m ingest.bench.diagnostics.decode_backends 256 12000
    python3 -m ingest.bench.diagnostics.decode_backends 512 4000 --busy 8

It writes a slide of TILES JPEG tiles of TILE pixels (Pillow, as the bench's ``slide``),
splits its frames with pydicom and decodes all of them with each decoder configuration
(nvImageCodec's default backends, the hardware JPEG decoder alone or first, the CUDA
decoder with Huffman decoding on the host or on the device, the hybrid one), batches of
``--batch`` into one device array, ``CodeStream`` objects made ahead as the worker makes
them. For each it prints tiles/s (best of three passes), the process's CPU per tile (the
decoder's host threads included), and the largest difference from the default backends'
pixels. ``--busy N`` keeps N other processes spinning meanwhile: a worker's own threads,
the S3 server and the broker share the host's cores with the decoder, and a decoder whose
host threads do the Huffman decoding slows down with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ingest.bench.diagnostics.decode_call_shapes import _tiles


def _hold_gil(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2_000))


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _configs(nvimgcodec: Any) -> dict[str, dict[str, Any]]:
    kind = nvimgcodec.BackendKind
    backend = nvimgcodec.Backend
    fancy = ":fancy_upsampling=1"
    return {
        "default": {"options": fancy},
        "hw": {"options": fancy, "backends": [backend(kind.HW_GPU_ONLY)]},
        "hw-then-gpu": {
            "options": fancy,
            "backends": [backend(kind.HW_GPU_ONLY, load_hint=0.9), backend(kind.GPU_ONLY)],
        },
        "gpu": {"options": fancy, "backends": [backend(kind.GPU_ONLY)]},
        "gpu-huffman": {
            "options": f"{fancy} nvjpeg_cuda_decoder:hybrid_huffman_threshold=0",
            "backends": [backend(kind.GPU_ONLY)],
        },
        "hybrid": {"options": fancy, "backends": [backend(kind.HYBRID_CPU_GPU)]},
    }


def _worker_shapes(frames: list[Any], tile: int, batch: int, count: int) -> None:
    """The worker's ``NvDecoder`` on the same tiles, one call a batch as the device thread
    makes it, in four shapes: the stream (0 or one of its own) and where the frames'
    bytes are (pageable, or a pinned buffer as the ring's slots)."""
    import cupy
    import numpy as np

    from ingest_gpu.decode import EncodedFrames, NvDecoder, parse_each
    from ingest_gpu.formats import PixelFormat

    fmt = PixelFormat(tile, tile, 1, 3, 8, 8, False, False)
    arena = cupy.zeros((count, tile, tile, 3), dtype=cupy.uint8)
    sizes = [len(frame) for frame in frames]
    pinned_memory = cupy.cuda.alloc_pinned_memory(sum(sizes))
    pinned = np.frombuffer(pinned_memory, np.uint8, sum(sizes))
    views, at = [], 0
    for frame, size in zip(frames, sizes, strict=True):
        pinned[at : at + size] = frame
        views.append(pinned[at : at + size].data)
        at += size
    own = cupy.cuda.Stream(non_blocking=True)
    for where, source in (("pageable", [bytes(f) for f in frames]), ("pinned", views)):
        parsed = parse_each(source, fmt, "rgb")
        for stream_name, stream in (("0", cupy.cuda.Stream.null), ("own", own)):
            stats: dict[str, int | float] = {}
            decoder = NvDecoder(0, stats)

            def run(
                decoder: NvDecoder = decoder,
                stream: Any = stream,
                source: list[Any] = source,
                parsed: list[Any] = parsed,
            ) -> float:
                t0 = time.perf_counter()
                for first in range(0, count, batch):
                    end = min(count, first + batch)
                    encoded = EncodedFrames(
                        tuple(source[first:end]),
                        "rgb",
                        tuple(parsed[first:end]),
                    )
                    job = [
                        (
                            encoded,
                            dataclasses.replace(fmt, frames=end - first),
                            arena[first].data.ptr,
                        )
                    ]
                    failed = decoder.decode(job, stream.ptr)
                    if failed[0] is not None:
                        raise RuntimeError(f"batch {first}..{end}: {failed[0]}")
                stream.synchronize()
                return time.perf_counter() - t0

            run()
            cpu0 = time.process_time()
            best = min(run() for _ in range(3))
            cpu = (time.process_time() - cpu0) / (3 * count)
            print(
                f"NvDecoder frames {where:8s} stream {stream_name:3s}: {count / best:8.0f} tiles/s,"
                f" {cpu * 1e6:7.1f} CPU us a tile"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("tile", type=int, help="the tiles' side in pixels")
    parser.add_argument("tiles", type=int, help="how many tiles")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    parser.add_argument("--only", default="", help="comma-separated configurations")
    parser.add_argument(
        "--gil-busy",
        type=int,
        default=0,
        help="threads of this process running Python meanwhile (the GIL held as a worker's "
        "event loop and GET threads hold it), with the worker's 0.5 ms switch interval",
    )
    parser.add_argument(
        "--switch-us", type=float, default=500.0, help="the switch interval with --gil-busy"
    )
    parser.add_argument(
        "--worker-shapes",
        action="store_true",
        help="also the worker's own decoder (ingest_gpu.decode.NvDecoder), as the device "
        "thread calls it: on stream 0 and its own stream, frames in pageable and pinned memory",
    )
    args = parser.parse_args(argv)

    import cupy
    from nvidia import nvimgcodec

    frames = _tiles(args.tile, args.tiles)
    count = len(frames)
    params = nvimgcodec.DecodeParams(allow_any_depth=True, color_spec=nvimgcodec.ColorSpec.SRGB)
    streams = [nvimgcodec.CodeStream(frame) for frame in frames]
    for stream in streams:
        _ = stream.height
    reference: Any = None
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    holding = threading.Event()
    holders = [threading.Thread(target=_hold_gil, args=(holding,)) for _ in range(args.gil_busy)]
    if holders:
        sys.setswitchinterval(args.switch_us / 1e6)
    for thread in holders:
        thread.start()
    sizes = sum(len(frame) for frame in frames) / count / 1e3
    print(
        f"{count} tiles of {args.tile}, {sizes:.1f} KB each; batch {args.batch},"
        f" busy {args.busy}, GIL busy {args.gil_busy}"
    )
    wanted = {name for name in args.only.split(",") if name}
    try:
        for name, config in _configs(nvimgcodec).items():
            if wanted and name not in wanted and name != "default":
                continue
            try:
                decoder = nvimgcodec.Decoder(device_id=0, **config)
            except Exception as exc:  # a backend this machine lacks
                print(f"{name:12s}: not available ({exc})")
                continue
            arena = cupy.zeros((count, args.tile, args.tile, 3), dtype=cupy.uint8)
            images = [nvimgcodec.as_image(arena[i]) for i in range(count)]

            def run(decoder: Any = decoder, images: list[Any] = images) -> float:
                t0 = time.perf_counter()
                for first in range(0, count, args.batch):
                    end = min(count, first + args.batch)
                    done = decoder.decode(
                        streams[first:end], params=params, images=images[first:end]
                    )
                    if any(image is None for image in done):
                        raise RuntimeError(f"a tile of batch {first}..{end} did not decode")
                cupy.cuda.Stream.null.synchronize()
                return time.perf_counter() - t0

            try:
                run()  # warm-up
            except RuntimeError as exc:
                print(f"{name:12s}: {exc}")
                continue
            cpu0 = time.process_time()
            best = min(run() for _ in range(3))
            cpu = (time.process_time() - cpu0) / (3 * count)
            if reference is None:
                reference = arena
                diff = 0
            else:
                diff = int(cupy.abs(arena.astype(cupy.int16) - reference.astype(cupy.int16)).max())
            print(
                f"{name:12s}: {count / best:8.0f} tiles/s, {cpu * 1e6:7.1f} CPU us a tile, "
                f"max difference from default {diff}"
            )
        if args.worker_shapes:
            _worker_shapes(frames, args.tile, args.batch, count)
    finally:
        holding.set()
        for thread in holders:
            thread.join()
        stop.set()
        for process in spinners:
            process.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
