"""The bench's ``put-raw`` reader (the outputs' ceiling) on the session's real SeaweedFS:
it uploads, for each object, the ``.npy`` and sidecar the sink would write (sizes, and
values while they fit its sample), a large ``.npy`` as a multipart upload in the
sink's parts."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ingest.bench.config import BenchConfig, worker_settings
from ingest.bench.put_raw import PREFIX, PutRawReader, output_of
from ingest.bench.reader_runs import make_reader
from ingest.bench.readers import naive_values
from ingest.bench.report import ratios, targets
from ingest.bench.workloads import S3Target, ensure_buckets, prepare_workloads
from ingest.dicom.header import DicomHeader
from ingest.dicom.parse import parse_header
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.samples_slide import jpeg_slide_bytes
from ingest.embedded.stack import Stack
from ingest.sink.output import MIN_PART

SLICE_NPY = 128 + 512 * 512 * 4  # a (1, 512, 512) float32 .npy: its 128-byte header, values
LARGE_MB = 20  # 40 frames of 512 x 512: 40 MiB of float32 output, five full parts and one


def _target(stack: Stack, token: str) -> S3Target:
    c = stack.endpoints.credentials
    src, out = f"b-{token}-src", f"b-{token}-out"
    return S3Target(stack.s3.endpoint_url, c.region, c.access_key, c.secret_key, src, out)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_put_raw_uploads_the_outputs_the_sink_would_write(
    stack: Stack, fresh_names: Any, tmp_path: Path
) -> None:
    target = _target(stack, fresh_names.token)
    ensure_buckets(target)
    (mix,) = prepare_workloads(target, ["mix"], 2, LARGE_MB, tmp_path).values()
    config = BenchConfig(worker_settings=(("sink_parts_in_flight", "2"),))
    reader = make_reader("put-raw", config, target)
    assert isinstance(reader, PutRawReader)
    reader.prepare(mix)
    try:
        first = reader.run(mix)
        again = reader.run(mix)  # a measured run after the warm-up: the same keys again
    finally:
        reader.close()
    frames = LARGE_MB * 1024 * 1024 // (512 * 512 * 2)
    large_npy = 128 + frames * 512 * 512 * 4
    assert first["npy_bytes"] == large_npy + 2 * SLICE_NPY
    assert (first["multipart_objects"], first["parts"], first["part_size"]) == (1, 6, MIN_PART)
    assert (first["single_puts"], first["parts_in_flight"], first["put_threads"]) == (5, 2, 32)
    opened = first.pop("connections_opened"), again.pop("connections_opened")
    assert 0 < opened[0] <= opened[1]  # the pool's count so far: kept connections, reused
    assert again == first

    client = target.client()
    try:
        listed = client.list_objects_v2(Bucket=target.output_bucket, Prefix=PREFIX)["Contents"]
        sizes = {o["Key"].removeprefix(PREFIX): o["Size"] for o in listed}
        etags = {o["Key"].removeprefix(PREFIX): o["ETag"] for o in listed}
        large_key = f"{target.source_bucket}/{mix.objects[0].key}.npy"
        arrays = {
            obj.key: np.load(
                io.BytesIO(
                    client.get_object(
                        Bucket=target.output_bucket,
                        Key=f"{PREFIX}{target.source_bucket}/{obj.key}.npy",
                    )["Body"].read()
                )
            )
            for obj in mix.objects
        }
        sources = {
            o.key: _download(client, target.source_bucket, o.key, tmp_path) for o in mix.objects
        }
    finally:
        client.close()
    expected = {
        f"{target.source_bucket}/{o.key}{ext}" for o in mix.objects for ext in (".npy", ".json")
    }
    assert set(sizes) == expected
    assert sum(sizes.values()) == first["output_bytes"]  # every byte it counted, on the server
    assert sizes[large_key] == large_npy
    assert etags[large_key].strip('"').endswith("-6")  # multipart, six parts
    for obj in mix.objects[1:]:
        assert sizes[f"{target.source_bucket}/{obj.key}.npy"] == SLICE_NPY
    for key in expected - {k for k in expected if k.endswith(".npy")}:
        assert 500 < sizes[key] < 4000  # a sidecar
    for key, array in arrays.items():  # the values the worker writes (all of them, here)
        np.testing.assert_array_equal(array, naive_values(str(sources[key])))
    assert arrays[mix.objects[0].key].shape == (frames, 512, 512)


def _download(client: Any, bucket: str, key: str, into: Path) -> Path:
    path = into / key.replace("/", "_")
    path.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    return path


def test_the_sink_is_judged_against_put_raw_and_against_itself_with_the_sink_off() -> None:
    def entry(gb_per_s: float, objects_per_s: float) -> dict[str, Any]:
        median = {"gb_per_s": gb_per_s, "objects_per_s": objects_per_s, "peak_rss_bytes": 1e9}
        return {"status": "ok", "median": median, "ring_bytes": 8e8}

    report: dict[str, Any] = {
        "machine": {"gpu": "H200"},
        "results": {
            "large": {
                "put-raw": entry(0.30, 0.3),
                "ours": entry(0.27, 0.27),
                "ours-hook": entry(6.0, 6.0),
            },
            "ct": {
                "put-raw": entry(0.5, 900.0),
                "ours": entry(0.17, 330.0),
                "ours-hook": entry(0.29, 550.0),
            },
        },
    }
    report["ratios"] = ratios(report)
    rows = {(r["workload"], r["mode"]): r for r in report["ratios"]}
    assert rows[("large", "ours")]["ours_over_put_raw"] == pytest.approx(0.9)
    assert rows[("ct", "ours")]["sink_on_over_off"] == pytest.approx(0.6)
    assert rows[("ct", "ours-hook")]["ours_over_put_raw"] is None  # writes nothing
    found = {t["target"]: t for t in targets(report)}
    large = found["large: ours / put-raw"]
    assert (large["value"], large["status"]) == (pytest.approx(0.9), "met")
    ct = found["CT: ours / ours-hook objects/s"]
    assert (ct["value"], ct["status"]) == (pytest.approx(0.6), "missed")
    assert not [t for t in found if "put-raw" in t and "ours-hook" in t]


def test_put_raw_writes_what_the_settings_ours_runs_with_say() -> None:
    target = S3Target("http://127.0.0.1:1", "us-east-1", "k", "s", "src", "out")
    config = BenchConfig(worker_settings=(("output_dtype", "float16"),))
    settings = worker_settings(config, target, "127.0.0.1:9092", "t", "l", "ours")
    key, data = synthetic_ct_series(1)[0]
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    values = memoryview(bytes(range(10)))
    out = output_of(settings, target, key, len(data), "e", header, values)
    assert (out.total, out.multipart) == (128 + 512 * 512 * 2, False)
    assert b"".join(out.body(120, 30)) == out.header[120:] + bytes(range(10)) * 2 + b"\0\1"
    assert b"".join(out.body(128 + 13, 4)) == bytes((3, 4, 5, 6))  # the values repeat
    assert out.npy_key == f"{PREFIX}src/{key}.npy"
    document = json.loads(out.sidecar)
    assert (document["dtype"], document["shape"]) == ("float16", [1, 512, 512])
    assert document["output"] == {"npy": out.npy_key, "zarr": None, "json": out.json_key}


def test_put_raw_writes_a_slide_as_the_ome_zarr_writer_does() -> None:
    target = S3Target("http://127.0.0.1:1", "us-east-1", "k", "s", "src", "out")
    config = BenchConfig(worker_settings=(("output_dtype", "exact"), ("slide_layout", "ome-zarr")))
    settings = worker_settings(config, target, "127.0.0.1:9092", "t", "l", "ours")
    data = jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32, matrix=(50, 70))
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    out = output_of(settings, target, "s.dcm", len(data), "e", header, memoryview(bytes(range(7))))
    assert out.zarr is not None
    assert not out.multipart
    assert out.zarr.root == f"{PREFIX}src/s.dcm.zarr"
    assert out.zarr.chunk_bytes == 32 * 32 * 3
    assert [len(b"".join(out.chunk_body(k))) for k in range(6)] == [32 * 32 * 3] * 6
    document = json.loads(out.sidecar)
    assert document["output"] == {"npy": None, "zarr": out.zarr.root, "json": out.json_key}
