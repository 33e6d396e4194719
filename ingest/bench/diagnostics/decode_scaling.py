"""Do pydicom's decoders scale across threads, or only across processes?

A diagnostic, not a test (pytest does not collect it)::

    python -m ingest.bench.diagnostics.decode_scaling [FRAMES] [SYNTAX_NAME ...]
    python -m ingest.bench.diagnostics.decode_scaling --write DIR   # the slices, as files
    python -m ingest.bench.diagnostics.decode_scaling --dir DIR [FRAMES] [SYNTAX_NAME ...]

For each compressed syntax it encodes one 512x512 CT slice
(``ingest.embedded.samples_compressed``; ``--dir`` reads them from files that
``--write`` made, where the encoders are not installed) and decodes it FRAMES times (default
64) with ``ingest.dicom.codec.decode_encapsulated``: in a loop, on as many
threads as there are cores, and on as many processes (spawned, the decoded
arrays sent back as the worker's decoding pool sends them). It prints frames/s
for each and the two ratios against the loop. A plugin that holds the GIL shows
threads/loop near 1; processes/loop near the core count when a frame costs
more than sending it and its result between processes.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

from pydicom import dcmread
from pydicom.encaps import generate_frames

from ingest.dicom.codec import Codec, codec_from_dataset, decode_encapsulated
from ingest.dicom.decoders import default_processes
from ingest.dicom.syntaxes import COMPRESSED


def _slice(syntax: str, folder: Path | None) -> bytes:
    if folder is not None:
        return (folder / f"{COMPRESSED[syntax]}.dcm").read_bytes()
    from ingest.embedded.samples_compressed import compressed_ct  # needs the encoders

    return compressed_ct(syntax)


def _case(syntax: str, folder: Path | None) -> tuple[Codec, bytes]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(_slice(syntax, folder)))
        codec = codec_from_dataset(ds, syntax)
        (frame,) = generate_frames(ds.PixelData, number_of_frames=1)
    return codec, frame


def _rate(run: Callable[[], None], frames: int) -> float:
    started = time.perf_counter()
    run()
    return frames / (time.perf_counter() - started)


def _on(pool: Executor, codec: Codec, frame: bytes, frames: int) -> Callable[[], None]:
    def run() -> None:
        futures = [pool.submit(decode_encapsulated, codec, [frame]) for _ in range(frames)]
        for future in futures:
            future.result()

    return run


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--write"]:
        from ingest.embedded.samples_compressed import CT_SYNTAXES

        folder = Path(args[1])
        folder.mkdir(parents=True, exist_ok=True)
        for uid in CT_SYNTAXES:
            (folder / f"{COMPRESSED[uid]}.dcm").write_bytes(_slice(uid, None))
        return
    source = None
    syntaxes: list[str]
    if args[:1] == ["--dir"]:
        source, args = Path(args[1]), args[2:]
        names = {path.stem for path in source.glob("*.dcm")}
        syntaxes = [uid for uid, name in COMPRESSED.items() if name in names]
    else:
        from ingest.embedded.samples_compressed import CT_SYNTAXES

        syntaxes = [str(uid) for uid in CT_SYNTAXES]
    frames = int(args[0]) if args else 64
    wanted = set(args[1:])
    workers = default_processes()
    context = multiprocessing.get_context("spawn")
    print(f"{workers} cores; frames/s decoding a 512x512 CT slice {frames} times")
    print(f"{'syntax':24} {'loop':>8} {'threads':>8} {'procs':>8} {'thr/loop':>9} {'proc/loop':>9}")
    with (
        ThreadPoolExecutor(workers) as threads,
        ProcessPoolExecutor(workers, mp_context=context) as processes,
    ):
        for syntax in syntaxes:
            name = COMPRESSED[syntax]
            if wanted and name not in wanted:
                continue
            codec, frame = _case(syntax, source)
            _on(processes, codec, frame, workers * 2)()  # warm: imports in every process
            started = time.perf_counter()
            for _ in range(frames):
                decode_encapsulated(codec, [frame])
            loop = frames / (time.perf_counter() - started)
            thr = _rate(_on(threads, codec, frame, frames), frames)
            proc = _rate(_on(processes, codec, frame, frames), frames)
            ratios = f"{thr / loop:9.2f} {proc / loop:9.2f}"
            print(f"{name:24} {loop:8.0f} {thr:8.0f} {proc:8.0f} {ratios}")


if __name__ == "__main__":
    main()
