"""Slides written as OME-Zarr images by the real worker, against the real broker (Tansu)
and S3 server (SeaweedFS), opened by independent readers: zarr-python over S3 (s3fs)
and ome-zarr-py (napari's reader) from the keys downloaded to a folder.

Each image's level 0 must equal the whole matrix that pydicom's decode of the
slide's tiles makes, placed by the standard's rules (tests/ingest/sink/slides.py),
with the pixel spacing in micrometres; a slide that cannot be one array is
dead-lettered with the reason; writing the same objects again gives the same keys
with the same bytes.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from ingest.embedded.stack import Stack
from tests import harness
from tests.ingest.sink import slides

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("aws_environment"),
]

zarr = pytest.importorskip("zarr")
s3fs = pytest.importorskip("s3fs")


LARGE_KEPT = [47, *range(0, 46, 2)]  # the last tile first, then every other one


def _objects() -> tuple[dict[str, bytes], dict[str, list[tuple[int, int]] | None]]:
    """The slides, and where each one's tiles go (None: TILED_FULL's order)."""
    full = slides.tiled_full(3, 2, 32)
    objects = {
        # the last row and column of tiles only partly inside the matrix
        "slide/edge.dcm": slides.tiled_full(3, 2, 32, matrix=(50, 70)),
        # larger than a part (64 KiB in these tests): read in ranges, decoded as they come
        "slide/large.dcm": slides.tiled_full(8, 6, 64),
        # frames 4, 0, 2 only, in that order, each placed by its Plane Position (Slide)
        "slide/sparse.dcm": slides.sparse(full, [4, 0, 2]),
        # two optical paths: six channels
        "slide/paths.dcm": slides.optical_paths(full, 2),
        # sparse and larger than a part: its per-frame places are read before the tiles
        "slide/large-sparse.dcm": slides.sparse(slides.tiled_full(8, 6, 64), LARGE_KEPT),
    }
    places: dict[str, list[tuple[int, int]] | None] = {k: None for k in objects}
    places["slide/sparse.dcm"] = [(1, 1), (0, 0), (0, 2)]
    places["slide/large-sparse.dcm"] = [divmod(k, 8) for k in LARGE_KEPT]
    return objects, places


async def _listing(stack: Stack, bucket: str, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` with its ETag."""
    found: dict[str, str] = {}
    async with harness.s3_client(stack) as s3:
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            found.update({item["Key"]: item["ETag"] for item in page.get("Contents", [])})
    return found


def _open_over_s3(stack: Stack, url: str) -> Any:
    """zarr-python's group at ``url`` (s3://...), through s3fs against the loopback server."""
    creds = stack.endpoints.credentials
    store = zarr.storage.FsspecStore.from_url(
        url,
        read_only=True,
        storage_options={
            "key": creds.access_key,
            "secret": creds.secret_key,
            "endpoint_url": stack.s3.endpoint_url,
            "client_kwargs": {"region_name": creds.region},
        },
    )
    return zarr.open_group(store=store, mode="r", zarr_format=2)


async def test_slides_as_ome_zarr_read_by_zarr_python_and_ome_zarr(
    stack: Stack, tmp_path: Path
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects, places = _objects()
    full = slides.tiled_full(3, 2, 32)
    refused = {"slide/planes.dcm": slides.edited(full, TotalPixelMatrixFocalPlanes=2)}
    ct_key, ct = next((k, v) for k, v in harness.corpus().items() if k.startswith("ct/"))
    uploads = {**objects, **refused, ct_key: ct}
    await harness.upload(stack, names.source_bucket, uploads.items())
    notifications = [harness.aws_notification(names.source_bucket, [k]) for k in uploads]
    await harness.publish(stack, names.source_topic, notifications)
    settings = harness.make_settings(stack, names, slide_layout="ome-zarr", output_dtype="exact")

    run = await harness.run_worker(settings, stop_after=len(uploads))

    assert sorted(o.ref.key for o in run.outcomes if o.ref and o.processed) == sorted(
        [*objects, ct_key]
    )
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    base = f"out/{names.source_bucket}"
    assert results[ct_key]["output"]["npy"] == f"{base}/{ct_key}.npy"  # not a slide: .npy
    assert results[ct_key]["output"]["zarr"] is None
    for key, data in objects.items():
        root = f"{base}/{key}.zarr"
        assert results[key]["output"] == {
            "npy": None,
            "zarr": root,
            "json": f"{base}/{key}.json",
        }
        if key == "slide/paths.dcm":  # each path's tiles are the same tiles again
            expected = np.concatenate([slides.expected_matrix(full)] * 2)
        else:
            expected = slides.expected_matrix(data, places[key])
        group = await anyio.to_thread.run_sync(
            _open_over_s3, stack, f"s3://{names.output_bucket}/{root}"
        )
        level0 = group["0"]
        assert level0.shape == expected.shape, key
        assert level0.dtype == np.uint8, key
        assert level0.chunks == (3, *_tile(data)), key
        assert np.array_equal(await anyio.to_thread.run_sync(level0.__getitem__, ...), expected)
        multiscale = group.attrs["multiscales"][0]
        assert [a["name"] for a in multiscale["axes"]] == ["c", "y", "x"]
        scale = multiscale["datasets"][0]["coordinateTransformations"][0]["scale"]
        assert scale == [1.0, 0.25, 0.25], key  # Pixel Spacing 0.00025 mm
        assert group.attrs["dicom_ingest"]["sop_instance_uid"] == results[key]["sop_instance_uid"]
    # a sparse slide's cells without a tile are written, as the fill value
    sparse_keys = await _listing(stack, names.output_bucket, f"{base}/slide/sparse.dcm.zarr/0/")
    assert len(sparse_keys) == 6 + 1  # every cell of the 3 x 2 grid, and .zarray
    large = await _listing(stack, names.output_bucket, f"{base}/slide/large-sparse.dcm.zarr/0/")
    assert len(large) == 48 + 1

    dlq = await harness.read_json_topic(stack, names.dlq_topic)
    assert [(d["key"], d["reason"], d["step"]) for d in dlq] == [
        ("slide/planes.dcm", "layout_refused", "sink")
    ]
    assert "2 focal planes" in dlq[0]["error"]
    assert await _listing(stack, names.output_bucket, f"{base}/slide/planes.dcm") == {}

    # ome-zarr-py (napari's reader), from the keys downloaded to a folder
    ome = pytest.importorskip("ome_zarr.reader")
    io = pytest.importorskip("ome_zarr.io")
    key = "slide/edge.dcm"
    root = f"{base}/{key}.zarr"
    for name in await _listing(stack, names.output_bucket, root + "/"):
        target = tmp_path / "edge.zarr" / name.removeprefix(root + "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await harness.get_object(stack, names.output_bucket, name))

    def read_ome() -> tuple[np.ndarray, dict[str, Any]]:
        node = next(iter(ome.Reader(io.parse_url(str(tmp_path / "edge.zarr")))()))
        return np.asarray(node.data[0].compute()), node.metadata

    level0, metadata = await anyio.to_thread.run_sync(read_ome)
    assert np.array_equal(level0, slides.expected_matrix(objects[key]))
    assert [a["name"] for a in metadata["axes"]] == ["c", "y", "x"]
    assert metadata["coordinateTransformations"][0][0]["scale"] == [1.0, 0.25, 0.25]
    assert metadata["channel_names"] == ["R", "G", "B"]

    # the same objects again (another group reads the topic from its start): same keys,
    # same bytes, metadata included
    before = await _listing(stack, names.output_bucket, f"{base}/slide/")
    again = dataclasses.replace(names, group=names.group + "-again")
    await harness.run_worker(
        harness.make_settings(stack, again, slide_layout="ome-zarr", output_dtype="exact"),
        stop_after=len(uploads),
    )
    after = await _listing(stack, names.output_bucket, f"{base}/slide/")
    sidecars = {k for k in before if k.endswith(".json")}
    assert {k: v for k, v in after.items() if k not in sidecars} == {
        k: v
        for k, v in before.items()
        if k not in sidecars  # sidecars: their timings differ
    }


def _tile(data: bytes) -> tuple[int, int]:
    ds = slides.read(data)
    return int(ds.Rows), int(ds.Columns)
