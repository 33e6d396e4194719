"""The decode workloads: compressed objects whose frames the worker decodes on the CPU.

- ``slide``: one VL Whole Slide Microscopy image of 256 x 256 JPEG Baseline tiles
  (YBR_FULL_422, ~19 KB a tile), about ``--slide-mb`` MiB, streamed to a file by
  ``write_jpeg_slide`` (never held whole) and uploaded by multipart upload;
- ``ct-j2k``, ``ct-htj2k``, ``ct-rle``: ``--ct`` CT slices (512 x 512, 12 bits
  stored in 16, signed) in JPEG 2000 Lossless, HTJ2K Lossless and RLE Lossless
  (``compressed_ct_series``), one object and one frame each.

Each object is also kept as a file under the bench's temporary folder
(``Workload.files``): the references that decode without fetching
(``pydicom-loop``, ``cpu-pool``) read them from there, the worker from S3.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
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

SLIDE_TILE = 256
CT_SIZE = 512


def pydicom_plugins(syntax: str) -> list[str]:
    """The decoding plugins pydicom has for ``syntax`` here (what ``pixel_array`` may use)."""
    from pydicom.pixels.decoders.base import get_decoder

    return list(get_decoder(syntax).available_plugins)


def slide_grid(slide_mb: int) -> tuple[int, int]:
    """(across, down) tiles of a near-square slide of about ``slide_mb`` MiB.

    The writer reuses its 61 distinct tiles cyclically, so the mean tile is the
    difference between a slide of 61 tiles and one of 1, over 60.
    """
    from ingest.embedded.samples_slide import jpeg_slide_bytes

    one = len(jpeg_slide_bytes(tiles_across=1, tiles_down=1))
    per_tile = (len(jpeg_slide_bytes(tiles_across=61, tiles_down=1)) - one) / 60
    tiles = max(1, round(slide_mb * MiB / per_tile))
    across = math.ceil(math.sqrt(tiles))
    return across, math.ceil(tiles / across)


def _slide(
    target: S3Target, client: Any, slide_mb: int, tmpdir: Path, progress: Callable[[str], None]
) -> Workload:
    from ingest.embedded.samples_slide import write_jpeg_slide

    across, down = slide_grid(slide_mb)
    name = f"slide-jpeg-{across}x{down}x{SLIDE_TILE}.dcm"
    progress(f"writing the slide ({across} x {down} JPEG tiles) to a temporary file")
    info = write_jpeg_slide(tmpdir / name, tiles_across=across, tiles_down=down, tile=SLIDE_TILE)
    assert info.path is not None
    progress(f"uploading the slide ({info.size / 1e6:.0f} MB, multipart)")
    key = f"bench/slide/{name}"
    size = upload_file_multipart(client, target.source_bucket, key, info.path)
    return Workload(
        "slide", (BenchObject(key, size),), frames=info.frames,
        frame_bytes=SLIDE_TILE * SLIDE_TILE * 3, files=(info.path,), syntax=info.syntax,
        info=(("tiles", (across, down, SLIDE_TILE)),
              ("total_matrix", (info.total_rows, info.total_columns)),
              ("offset_table", info.offset_table),
              ("pydicom_plugins", pydicom_plugins(info.syntax))),
    )  # fmt: skip


def _series(
    target: S3Target, client: Any, name: str, count: int, tmpdir: Path,
    progress: Callable[[str], None],
) -> Workload:  # fmt: skip
    from ingest.embedded.samples_compressed import compressed_ct_series

    syntax = DECODE_WORKLOADS[name]
    progress(f"encoding and uploading {count} CT slices for {name}")
    folder = tmpdir / name
    folder.mkdir(parents=True, exist_ok=True)

    def put(item: tuple[str, bytes]) -> tuple[BenchObject, Path]:
        key = f"bench/{name}/{item[0].rsplit('/', 1)[-1]}"
        path = folder / key.rsplit("/", 1)[-1]
        path.write_bytes(item[1])
        client.put_object(Bucket=target.source_bucket, Key=key, Body=item[1])
        return BenchObject(key, len(item[1])), path

    series = compressed_ct_series(syntax, count, CT_SIZE, CT_SIZE)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(put, series))
    return Workload(
        name, tuple(o for o, _ in done), frames=count, frame_bytes=CT_SIZE * CT_SIZE * 2,
        files=tuple(p for _, p in done), syntax=syntax,
        info=(("pydicom_plugins", pydicom_plugins(syntax)),),
    )  # fmt: skip


def prepare_decode_workloads(
    target: S3Target,
    names: list[str],
    ct_count: int,
    slide_mb: int,
    tmpdir: Path,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Workload]:
    """Write, keep under ``tmpdir`` and upload the decode workloads among ``names``.

    Raises:
        ValueError: ``ct_count`` or ``slide_mb`` below 1.
        botocore.exceptions.ClientError: an upload failed.
    """
    if ct_count < 1 or slide_mb < 1:
        raise ValueError("decode workloads need --ct and --slide-mb of 1 or more")
    client = target.client()
    out: dict[str, Workload] = {}
    try:
        for name in names:
            if name == "slide":
                out[name] = _slide(target, client, slide_mb, tmpdir, progress)
            elif name in DECODE_WORKLOADS:
                out[name] = _series(target, client, name, ct_count, tmpdir, progress)
    finally:
        client.close()
    return out
