"""Where does the GPU start to beat the CPU at decoding, by syntax and frame size?

A diagnostic, not a test (pytest does not collect it)::

    python -m ingest.bench.diagnostics.decode_crossover --write DIR  # HTJ2K needs imagecodecs
    python -m ingest.bench.diagnostics.decode_crossover [--dir DIR] [--batch 64] [--seconds 1]
        [--processes N] [--cases jpeg-ybr,jpeg-mono,j2k,htj2k]

Cases: JPEG Baseline tiles of 16 to 512 px square, an H&E-like RGB tile stored as
YBR_FULL_422 (``jpeg-ybr``) and a windowed CT slice (``jpeg-mono``), written by
Pillow here; JPEG 2000 Lossless (``j2k``) and HTJ2K Lossless (``htj2k``) CT slices
(12 bits stored in 16, signed) of 64 to 512 px, read from DIR (``--write DIR`` writes
every case there, on a machine with imagecodecs) or encoded here when the encoders
are installed; a case neither found nor encodable is left out, and said so.

For each case one frame's codestream is decoded over and over for about
``--seconds``, two ways:

- GPU: nvImageCodec's batched call (``Decoder.decode``, ``--batch`` frames a call,
  the colour conversion the worker asks: YBR to RGB for the JPEG tile), output
  left on the device, one synchronisation at the end (as the bench's
  ``nvimgcodec`` reader);
- CPU: ``ingest.dicom.codec.decode_encapsulated`` in a ``ProcessPoolExecutor`` of
  one spawned process a core, frames sent in groups of at most 16 MiB decoded, at
  least four groups a process, the decoded arrays sent back (as the bench's
  ``cpu-pool`` reader and the worker's decoding pool).

It prints frames/s and decoded MB/s of both and GPU/CPU per case, then for each
syntax the smallest size from which the GPU is ahead at every larger size: below
it, frames are better sent to the CPU decoders. Without CUDA or nvImageCodec the
GPU columns are empty. Needs numpy, pydicom, Pillow, the pylibjpeg plugins, and on
the GPU side CuPy and nvImageCodec (its decoder with the backends installed: the
device carry has the nvJPEG and nvJPEG2000 extensions only, so no CPU fall-back
inside nvImageCodec; nvJPEG may still run a small JPEG's Huffman stage on the CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing
import os
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.uid import HTJ2KLossless, JPEG2000Lossless

from ingest.dicom.codec import Codec, codec_from_dataset, decode_encapsulated

JPEG_SIZES = (16, 32, 64, 128, 256, 512)
J2K_SIZES = (64, 128, 256, 512)
J2K_SYNTAXES = {"j2k": JPEG2000Lossless, "htj2k": HTJ2KLossless}
CASES = ("jpeg-ybr", "jpeg-mono", "j2k", "htj2k")
GROUP_BYTES = 16 * 1024 * 1024  # decoded bytes of one CPU task, as the worker's groups
TASKS_PER_PROCESS = 4
MAX_CPU_FRAMES = 500_000  # a CPU run's frames, whatever the rate


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    size: int
    codec: Codec
    frame: bytes
    rgb: bool  # the device converts YCbCr to RGB

    @property
    def frame_bytes(self) -> int:
        c = self.codec
        return c.rows * c.columns * c.samples_per_pixel * (c.bits_allocated // 8)


def _encode(name: str, size: int) -> bytes:
    """Case ``name`` at ``size`` as a DICOM object (ImportError: an encoder is missing)."""
    from ingest.embedded.samples_compressed import compressed_ct, jpeg_baseline

    if name == "jpeg-ybr":
        return jpeg_baseline("YBR_FULL_422", 0, size, size)
    if name == "jpeg-mono":
        return jpeg_baseline("MONOCHROME2", 0, size, size)
    return compressed_ct(J2K_SYNTAXES[name], 0, size, size)


def _object(name: str, size: int, folder: Path | None) -> bytes | None:
    path = folder / f"{name}-{size}.dcm" if folder is not None else None
    if path is not None and path.is_file():
        return path.read_bytes()
    try:
        return _encode(name, size)
    except ImportError:
        return None


def _case(name: str, size: int, data: bytes) -> Case:
    from pydicom import dcmread
    from pydicom.encaps import generate_frames

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        syntax = str(ds.file_meta.TransferSyntaxUID)
        codec = codec_from_dataset(ds, syntax)
        (frame,) = generate_frames(ds.PixelData, number_of_frames=1)
    return Case(name, size, codec, frame, rgb=name == "jpeg-ybr")


def gpu_missing() -> str | None:
    """None when CuPy sees a device and nvImageCodec is installed, else why not."""
    for module in ("cupy", "nvidia.nvimgcodec"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except (ImportError, ValueError):
            return f"{module} is not installed"
    import cupy

    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None if count else "no CUDA device"


class GpuDecode:
    """nvImageCodec's batched decode of one frame repeated, ``batch`` frames a call."""

    def __init__(self, batch: int) -> None:
        from nvidia import nvimgcodec

        self._nv, self.batch = nvimgcodec, batch
        self._decoder = nvimgcodec.Decoder(device_id=0, options=":fancy_upsampling=1")
        self._params = {
            rgb: nvimgcodec.DecodeParams(
                allow_any_depth=True,
                color_spec=nvimgcodec.ColorSpec.SRGB if rgb else nvimgcodec.ColorSpec.UNCHANGED,
            )
            for rgb in (False, True)
        }

    def _call(self, case: Case, array: np.ndarray) -> list[Any]:
        streams = [self._nv.CodeStream(array) for _ in range(self.batch)]
        images: list[Any] = self._decoder.decode(
            streams, params=self._params[case.rgb], cuda_stream=0
        )
        return images

    def rate(self, case: Case, seconds: float) -> float:
        import cupy

        array = np.frombuffer(case.frame, dtype=np.uint8)
        for image in self._call(case, array):  # warm-up, and a check of what comes back
            if image is None:
                raise RuntimeError(f"{case.name} {case.size}: nvImageCodec did not decode it")
            cai = image.__cuda_array_interface__
            if math.prod(cai["shape"]) * np.dtype(cai["typestr"]).itemsize != case.frame_bytes:
                raise RuntimeError(f"{case.name} {case.size}: decoded to {cai['shape']}")
        cupy.cuda.Device().synchronize()
        frames, held, started = 0, [], time.perf_counter()
        while time.perf_counter() - started < seconds or frames < 2 * self.batch:
            held = self._call(case, array)
            frames += len(held)
        cupy.cuda.Device().synchronize()
        del held
        return frames / (time.perf_counter() - started)


def _cpu_rate(pool: ProcessPoolExecutor, processes: int, case: Case, seconds: float) -> float:
    started = time.perf_counter()
    for _ in range(8):  # one process, to size the run
        decode_encapsulated(case.codec, [case.frame])
    each = (time.perf_counter() - started) / 8
    frames = round(seconds * processes / max(each, 1e-7))
    frames = max(processes * TASKS_PER_PROCESS, min(MAX_CPU_FRAMES, frames))
    per = max(
        1, min(GROUP_BYTES // case.frame_bytes, math.ceil(frames / (TASKS_PER_PROCESS * processes)))
    )
    groups = [[case.frame] * min(per, frames - i) for i in range(0, frames, per)]
    warm = processes * 2  # each process's first frame of a syntax imports its plugin
    list(pool.map(decode_encapsulated, [case.codec] * warm, [[case.frame]] * warm))
    started = time.perf_counter()
    decoded = pool.map(decode_encapsulated, [case.codec] * len(groups), groups)
    done = sum(len(arr) for arr in decoded)
    return done / (time.perf_counter() - started)


def _write(folder: Path, cases: Sequence[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in cases:
        for size in JPEG_SIZES if name.startswith("jpeg") else J2K_SIZES:
            (folder / f"{name}-{size}.dcm").write_bytes(_encode(name, size))
    total = sum(p.stat().st_size for p in folder.glob("*.dcm"))
    print(f"{folder}: {len(list(folder.glob('*.dcm')))} objects, {total / 1e6:.2f} MB")


def crossover(rows: list[tuple[Case, float | None, float]]) -> dict[str, int | None]:
    """Per case name: the smallest size from which the GPU is ahead at every larger one."""
    out: dict[str, int | None] = {}
    for name in dict.fromkeys(c.name for c, _, _ in rows):
        mine = [(c.size, g is not None and g > cpu) for c, g, cpu in rows if c.name == name]
        ahead = None
        for size, gpu_first in sorted(mine, reverse=True):
            if not gpu_first:
                break
            ahead = size
        out[name] = ahead
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ingest.bench.diagnostics.decode_crossover")
    parser.add_argument("--write", type=Path, metavar="DIR", help="write every case to DIR")
    parser.add_argument("--dir", type=Path, metavar="DIR", help="read the cases from DIR")
    parser.add_argument("--batch", type=int, default=64, help="frames a GPU decode call")
    parser.add_argument("--seconds", type=float, default=1.0, help="about this long a case")
    parser.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--cases", default=",".join(CASES), help=",".join(CASES))
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    if args.write is not None:
        _write(args.write, names)
        return
    why = gpu_missing()
    gpu = GpuDecode(args.batch) if why is None else None
    context = multiprocessing.get_context("spawn")
    print(
        f"GPU: {why or f'nvImageCodec, {args.batch} frames a call'}; CPU: "
        f"{args.processes} processes; ~{args.seconds:g} s a case and side"
    )
    head = f"{'case':10} {'size':>5} {'bytes':>7} {'GPU fr/s':>10} {'CPU fr/s':>10}"
    print(f"{head} {'GPU MB/s':>9} {'CPU MB/s':>9} {'GPU/CPU':>8}")
    rows: list[tuple[Case, float | None, float]] = []
    with ProcessPoolExecutor(args.processes, mp_context=context) as pool:
        list(pool.map(_noop, range(args.processes * 2)))  # spawned and imported before timing
        for name in names:
            for size in JPEG_SIZES if name.startswith("jpeg") else J2K_SIZES:
                data = _object(name, size, args.dir)
                if data is None:
                    print(f"{name:10} {size:5} not in --dir and no encoder here: left out")
                    continue
                case = _case(name, size, data)
                cpu = _cpu_rate(pool, args.processes, case, args.seconds)
                on_gpu = gpu.rate(case, args.seconds) if gpu is not None else None
                rows.append((case, on_gpu, cpu))
                _print_row(case, on_gpu, cpu)
    if gpu is None:
        return
    print("GPU ahead from (every larger size too):")
    for name, smallest in crossover(rows).items():
        print(f"  {name:10} {'never' if smallest is None else f'{smallest} px'}")


def _noop(_: int) -> None:
    import ingest.dicom.codec  # noqa: F401  (the imports a decoding process makes)


def _print_row(case: Case, gpu: float | None, cpu: float) -> None:
    def mb(rate: float | None) -> str:
        return "-" if rate is None else f"{rate * case.frame_bytes / 1e6:.1f}"

    ratio = "-" if gpu is None else f"{gpu / cpu:.2f}"
    rate = "-" if gpu is None else f"{gpu:.0f}"
    print(
        f"{case.name:10} {case.size:5} {len(case.frame):7} {rate:>10} {cpu:10.0f} "
        f"{mb(gpu):>9} {mb(cpu):>9} {ratio:>8}"
    )


if __name__ == "__main__":
    main()
