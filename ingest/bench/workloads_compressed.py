"""The decode workloads: compressed objects whose frames the worker decodes.

- ``slide``, ``slide-512``: one VL Whole Slide Microscopy image of 256 x 256 (512 x 512)
  JPEG Baseline tiles encoded by Pillow (YBR_FULL_422, ~19 KB a 256 x 256 tile), about
  ``--slide-mb`` MiB, streamed to a file by ``write_jpeg_slide`` (never held whole) and
  uploaded by multipart upload;
- ``ct-j2k``, ``ct-htj2k``, ``ct-rle``: ``--ct`` CT slices (512 x 512, 12 bits
  stored in 16, signed) in JPEG 2000 Lossless, HTJ2K Lossless and RLE Lossless
  (``compressed_ct_series``), one object and one frame each;
- ``ct-jpeg``: ``--ct`` 8-bit MONOCHROME2 JPEG Baseline slices (512 x 512, ~30 KB):
  the same CT slices windowed to 8 bits, encoded by Pillow at quality 90, as
  Secondary Capture objects of one frame (``jpeg_series_slice``): the shape of an
  archive's 8-bit single-frame images (secondary captures, exported X-ray and
  ultrasound frames), which decode to a byte a pixel;
- ``ct-htj2k-volume``, ``ct-j2k-volume``: the same series of ``--ct`` slices as one
  Enhanced CT object, a frame a slice (``write_ct_volume``), as scanners that write
  multi-frame objects store a series: the frames are the codestreams of the
  series' slices, written here or taken from the corpus.

Each object is also kept as a file (``Workload.files``): the references that decode
without fetching (``pydicom-loop``, ``cpu-pool``, ``nvimgcodec``, ``nvimgcodec-plugin``)
read them from there, the worker from S3.

HTJ2K is encoded by imagecodecs, which a machine may lack (the GPU machine does), so the
objects can be written beforehand into a corpus folder, ``DIR/<workload>/*.dcm``::

    python -m ingest.bench.workloads_compressed --write DIR [--ct N] [--slide-mb M]
        [--workloads ct-j2k,ct-htj2k,ct-rle,ct-jpeg]

and read from it by ``dicom-ingest bench --decode-corpus DIR``: each CT series named in
``--workloads`` must then be in DIR, and its ``--ct`` objects cycle over DIR's slices
(distinct keys, repeated bytes); the slide comes from ``DIR/slide`` when the corpus has
one, else it is written as without a corpus (Pillow only).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ingest.bench.measure import MiB
from ingest.bench.workloads import (
    DECODE_WORKLOADS,
    BenchObject,
    S3Target,
    Workload,
    upload_file_multipart,
)

SLIDES = {"slide": 256, "slide-512": 512}  # workload -> its tiles' side
CT_SIZE = 512
# A volume (one multi-frame object) takes its frames from the slices of its series
VOLUMES = {"ct-htj2k-volume": "ct-htj2k", "ct-j2k-volume": "ct-j2k"}
SERIES = tuple(n for n in DECODE_WORKLOADS if n not in SLIDES and n not in VOLUMES)
# The writer's default slices a series: 512 x 512 slices take 180 (J2K), 190 (HTJ2K),
# 230 (RLE) and 30 KB (8-bit JPEG), so 12 of each make ~7.5 MB, small enough to carry to
# the device
CORPUS_SLICES = 12
WRITE_HINT = "python -m ingest.bench.workloads_compressed --write DIR"


def pydicom_plugins(syntax: str) -> list[str]:
    """The decoding plugins pydicom has for ``syntax`` here (what ``pixel_array`` may use)."""
    from pydicom.pixels.decoders.base import get_decoder

    return list(get_decoder(syntax).available_plugins)


def slide_grid(slide_mb: int, tile: int = 256) -> tuple[int, int]:
    """(across, down) tiles of ``tile`` pixels of a near-square slide of about ``slide_mb`` MiB.

    The writer reuses its 61 distinct tiles cyclically, so the mean tile is the
    difference between a slide of 61 tiles and one of 1, over 60.
    """
    from ingest.embedded.samples_slide import jpeg_slide_bytes

    one = len(jpeg_slide_bytes(tiles_across=1, tiles_down=1, tile=tile))
    per_tile = (len(jpeg_slide_bytes(tiles_across=61, tiles_down=1, tile=tile)) - one) / 60
    tiles = max(1, round(slide_mb * MiB / per_tile))
    across = math.ceil(math.sqrt(tiles))
    return across, math.ceil(tiles / across)


def corpus_files(corpus: Path, name: str) -> list[Path]:
    """The corpus's objects of workload ``name`` (``corpus/name/*.dcm``), sorted."""
    return sorted((corpus / name).glob("*.dcm"))


def _header(path: Path) -> Any:
    from pydicom import dcmread

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcmread(path, stop_before_pixels=True)


def frame_bytes(ds: Any) -> int:
    """Bytes of one of ``ds``'s frames as ``pixel_array`` returns it (from its header)."""
    return int(ds.Rows) * int(ds.Columns) * int(ds.SamplesPerPixel) * int(ds.BitsAllocated) // 8


def series_slice(name: str, index: int) -> bytes:
    """Slice ``index`` of the series workload ``name`` (one of ``SERIES``), as written here.

    Raises:
        ImportError: its encoder is not installed here (HTJ2K needs imagecodecs).
    """
    from ingest.embedded.samples_compressed import compressed_ct, jpeg_series_slice

    if name == "ct-jpeg":
        return jpeg_series_slice(index, CT_SIZE, CT_SIZE)
    return compressed_ct(DECODE_WORKLOADS[name], index, CT_SIZE, CT_SIZE)


def _write_slide(folder: Path, slide_mb: int, tile: int) -> Any:
    from ingest.embedded.samples_slide import write_jpeg_slide

    across, down = slide_grid(slide_mb, tile)
    path = folder / f"slide-jpeg-{across}x{down}x{tile}.dcm"
    return write_jpeg_slide(path, tiles_across=across, tiles_down=down, tile=tile)


def corpus_slide(path: Path, name: str = "slide") -> Workload:
    """A slide from the corpus, described from its header (no object uploaded yet)."""
    ds = _header(path)
    rows, columns = int(ds.Rows), int(ds.Columns)
    total = (int(ds.TotalPixelMatrixRows), int(ds.TotalPixelMatrixColumns))
    syntax = str(ds.file_meta.TransferSyntaxUID)
    return Workload(
        name,
        (),
        frames=int(ds.NumberOfFrames),
        frame_bytes=frame_bytes(ds),
        files=(path,),
        syntax=syntax,
        info=(
            ("tiles", (-(-total[1] // columns), -(-total[0] // rows), rows)),
            ("total_matrix", total),
            ("source", str(path)),
            ("pydicom_plugins", pydicom_plugins(syntax)),
        ),
    )


def _slide(
    target: S3Target,
    client: Any,
    name: str,
    slide_mb: int,
    tmpdir: Path,
    corpus: Path | None,
    progress: Callable[[str], None],
) -> Workload:
    tile = SLIDES[name]
    found = corpus_files(corpus, name) if corpus is not None else []
    if found:
        workload = corpus_slide(found[0], name)
    else:
        progress(f"writing the slide of {tile} x {tile} tiles to a temporary file")
        info = _write_slide(tmpdir, slide_mb, tile)
        assert info.path is not None
        workload = Workload(
            name,
            (),
            frames=info.frames,
            frame_bytes=tile * tile * 3,
            files=(info.path,),
            syntax=info.syntax,
            info=(
                ("tiles", (info.tiles_across, info.tiles_down, tile)),
                ("total_matrix", (info.total_rows, info.total_columns)),
                ("offset_table", info.offset_table),
                ("source", "generated"),
                ("pydicom_plugins", pydicom_plugins(info.syntax)),
            ),
        )
    path = workload.files[0]
    progress(f"uploading the slide ({path.stat().st_size / 1e6:.0f} MB, multipart)")
    key = f"bench/{name}/{path.name}"
    size = upload_file_multipart(client, target.source_bucket, key, path)
    return Workload(
        name,
        (BenchObject(key, size),),
        frames=workload.frames,
        frame_bytes=workload.frame_bytes,
        files=workload.files,
        syntax=workload.syntax,
        info=workload.info,
    )


def _generated_series(name: str, count: int, folder: Path) -> list[Path]:
    """``count`` slices of ``name`` encoded here, one file each under ``folder``.

    Raises:
        ValueError: an encoder is not installed here (HTJ2K needs imagecodecs).
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        try:
            data = series_slice(name, index)
        except ImportError as exc:
            raise ValueError(
                f"{name}: encoding needs {exc.name or exc}, not installed here; write the "
                f"series where it is ({WRITE_HINT}) and run with --decode-corpus DIR"
            ) from exc
        path = folder / f"slice-{index + 1:04d}.dcm"
        path.write_bytes(data)
        paths.append(path)
    return paths


def _series(
    target: S3Target,
    client: Any,
    name: str,
    count: int,
    tmpdir: Path,
    corpus: Path | None,
    progress: Callable[[str], None],
) -> Workload:
    syntax = DECODE_WORKLOADS[name]
    if corpus is None:
        progress(f"encoding {count} slices for {name}")
        source: Any = "generated"
        paths = _generated_series(name, count, tmpdir / name)
    else:
        found = corpus_files(corpus, name)
        if not found:
            there = sorted(p.parent.name for p in corpus.glob("*/*.dcm"))
            raise ValueError(
                f"{name}: no {corpus / name}/*.dcm in the decode corpus (it has: "
                f"{', '.join(sorted(set(there))) or 'nothing'}); write it with {WRITE_HINT}"
            )
        source = {"corpus": str(corpus / name), "distinct_slices": len(found)}
        paths = [found[index % len(found)] for index in range(count)]
    progress(f"uploading {count} slices for {name}")

    def put(item: tuple[int, Path]) -> BenchObject:
        key = f"bench/{name}/slice-{item[0] + 1:04d}.dcm"
        body = item[1].read_bytes()
        client.put_object(Bucket=target.source_bucket, Key=key, Body=body)
        return BenchObject(key, len(body))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        objects = tuple(pool.map(put, enumerate(paths)))
    return Workload(
        name,
        objects,
        frames=count,
        frame_bytes=frame_bytes(_header(paths[0])),
        files=tuple(paths),
        syntax=syntax,
        info=(("source", source), ("pydicom_plugins", pydicom_plugins(syntax))),
    )


def _volume(
    target: S3Target,
    client: Any,
    name: str,
    count: int,
    tmpdir: Path,
    corpus: Path | None,
    progress: Callable[[str], None],
) -> Workload:
    """The series ``VOLUMES[name]`` as one Enhanced CT object of ``count`` frames: its
    slices' codestreams in turn (from the corpus, or ``CORPUS_SLICES`` encoded here)."""
    from ingest.bench.decode import _frames_of
    from ingest.embedded.samples_compressed import write_ct_volume

    series, syntax = VOLUMES[name], DECODE_WORKLOADS[name]
    if corpus is None:
        progress(f"encoding {min(count, CORPUS_SLICES)} CT slices for {name}")
        slices = _generated_series(series, min(count, CORPUS_SLICES), tmpdir / series)
        source: Any = "generated"
    else:
        slices = corpus_files(corpus, series)
        if not slices:
            raise ValueError(
                f"{name}: no {corpus / series}/*.dcm in the decode corpus; "
                f"write it with {WRITE_HINT}"
            )
        source = {"corpus": str(corpus / series), "distinct_slices": len(slices)}
    distinct = [b"".join(_frames_of(path)[1]) for path in slices]
    path = tmpdir / name / f"volume-{count}.dcm"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fp:
        table = write_ct_volume(fp, syntax, [distinct[i % len(distinct)] for i in range(count)])
    progress(f"uploading {name} ({path.stat().st_size / 1e6:.0f} MB, {count} frames)")
    key = f"bench/{name}/{path.name}"
    size = upload_file_multipart(client, target.source_bucket, key, path)
    return Workload(
        name,
        (BenchObject(key, size),),
        frames=count,
        frame_bytes=CT_SIZE * CT_SIZE * 2,
        files=(path,),
        syntax=syntax,
        info=(
            ("source", source),
            ("offset_table", table),
            ("pydicom_plugins", pydicom_plugins(syntax)),
        ),
    )


def prepare_decode_workloads(
    target: S3Target,
    names: list[str],
    ct_count: int,
    slide_mb: int,
    tmpdir: Path,
    progress: Callable[[str], None] = lambda _: None,
    corpus: Path | None = None,
) -> dict[str, Workload]:
    """Write (or take from ``corpus``), keep under ``tmpdir`` and upload the decode
    workloads among ``names``.

    Raises:
        ValueError: ``ct_count`` or ``slide_mb`` below 1; a CT series that ``corpus``
            lacks, or (without a corpus) whose encoder is not installed.
        botocore.exceptions.ClientError: an upload failed.
    """
    if ct_count < 1 or slide_mb < 1:
        raise ValueError("decode workloads need --ct and --slide-mb of 1 or more")
    client = target.client()
    out: dict[str, Workload] = {}
    try:
        for name in names:
            if name in SLIDES:
                out[name] = _slide(target, client, name, slide_mb, tmpdir, corpus, progress)
            elif name in VOLUMES:
                out[name] = _volume(target, client, name, ct_count, tmpdir, corpus, progress)
            elif name in DECODE_WORKLOADS:
                out[name] = _series(target, client, name, ct_count, tmpdir, corpus, progress)
    finally:
        client.close()
    return out


def write_corpus(
    folder: Path, names: Sequence[str] = SERIES, count: int = CORPUS_SLICES, slide_mb: int = 0
) -> dict[str, tuple[int, int]]:
    """Write the CT series among ``names`` (``count`` slices each) and, with ``slide_mb``,
    a slide into ``folder/<workload>/``, replacing what those folders held; returns
    (files, bytes) per workload.

    Raises:
        ValueError: an unknown workload; an encoder not installed here.
        OSError: the folder cannot be written.
    """
    unknown = [n for n in names if n not in DECODE_WORKLOADS or n in VOLUMES]
    if unknown or count < 1:
        raise ValueError(f"--write: decode workloads {', '.join(SERIES)} and --ct >= 1")
    wanted = [n for n in names if n not in SLIDES] + (
        [n for n in SLIDES if n in names or n == "slide"] if slide_mb > 0 else []
    )
    written = {}
    for name in wanted:
        target = folder / name
        target.mkdir(parents=True, exist_ok=True)
        for old in corpus_files(folder, name):
            old.unlink()
        if name in SLIDES:
            paths = [_write_slide(target, slide_mb, SLIDES[name]).path]
        else:
            paths = _generated_series(name, count, target)
        written[name] = (len(paths), sum(p.stat().st_size for p in paths))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ingest.bench.workloads_compressed",
        description="write the decode workloads' objects for `dicom-ingest bench --decode-corpus`",
    )
    parser.add_argument("--write", type=Path, required=True, metavar="DIR")
    parser.add_argument("--ct", type=int, default=CORPUS_SLICES, help="slices a CT series")
    parser.add_argument("--slide-mb", type=int, default=0, help="MiB of slide (default: none)")
    parser.add_argument("--workloads", default=",".join(SERIES), help="the series to write")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    try:
        written = write_corpus(args.write, names, args.ct, args.slide_mb)
    except ValueError as exc:
        parser.error(str(exc))
    for name, (files, size) in written.items():
        print(f"{args.write / name}: {files} files, {size / 1e6:.2f} MB")
    print(f"total {sum(s for _, s in written.values()) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
