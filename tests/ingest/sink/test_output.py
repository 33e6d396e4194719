"""The output writer's memory bound: at most ``SINK_PARTS_IN_FLIGHT`` parts uploading at once;
and the headers of a part's PUT.

A twin of the sink's three multipart calls stands in for S3 (pure bookkeeping);
the real uploads are covered against SeaweedFS in tests/ingest/fetch/test_s3.py and
tests/ingest/test_worker.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import numpy as np
import pytest

from ingest.settings import Settings
from ingest.sink.output import MIN_PART, NPY_TYPE, ArrayWriter, OutputSink, PartUpload

pytestmark = pytest.mark.anyio


class _Sink:
    """What ``ArrayWriter`` calls on ``OutputSink``, counting uploads in flight."""

    def __init__(self, parts_in_flight: int) -> None:
        self.parts_in_flight = parts_in_flight
        self.uploading = 0
        self.most = 0
        self.parts: dict[int, bytes] = {}
        self.completed: list[dict[str, Any]] = []
        self.created = 0

    async def _create_upload(self, key: str) -> str:
        self.created += 1
        await anyio.sleep(0.01)  # parts sent meanwhile wait for this upload
        return "upload-1"

    async def _upload_part(
        self, key: str, upload_id: str | None, number: int, body: list[memoryview]
    ) -> str:
        self.uploading += 1
        self.most = max(self.most, self.uploading)
        await anyio.sleep(0.01 * (number % 3))  # parts finish out of order
        self.parts[number] = b"".join(bytes(v) for v in body)
        self.uploading -= 1
        return f"etag-{number}"

    async def _complete_upload(self, key: str, upload_id: str | None, parts: Any) -> None:
        self.completed = parts


@pytest.mark.parametrize("parts_in_flight", [1, 2, 4])
async def test_parts_in_flight_are_bounded_and_the_object_is_whole(parts_in_flight: int) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert defaults["sink_parts_in_flight"] == 4  # the default docs/configuration.md measures
    sink = _Sink(parts_in_flight)
    values = np.arange(10 * MIN_PART // 2, dtype=np.uint16)  # 10 parts of payload
    chunks = np.array_split(values, 7)  # chunk edges fall inside parts
    async with ArrayWriter(sink, "k.npy", values.shape, "uint16") as writer:  # type: ignore[arg-type]
        for chunk in chunks:
            await writer.write(chunk)
    assert sink.most == parts_in_flight
    body = b"".join(sink.parts[n] for n in sorted(sink.parts))
    assert body.endswith(values.tobytes())  # after the .npy header, every byte in order
    assert [p["PartNumber"] for p in sink.completed] == list(range(1, len(sink.parts) + 1))
    assert all(p["ETag"] == f"etag-{p['PartNumber']}" for p in sink.completed)


class _Source:
    """What ``OutputSink`` calls on ``S3Source`` for a part: a URL, then the PUT."""

    client = None

    def __init__(self) -> None:
        self.puts: list[tuple[str, dict[str, str], bytes]] = []

    async def presign(self, operation: str, **params: Any) -> str:
        return (
            f"http://s3.test/{params['Bucket']}/{params['Key']}?partNumber={params['PartNumber']}"
        )

    async def put_from(self, url: str, headers: dict[str, str], body: list[memoryview]) -> str:
        self.puts.append((url, headers, b"".join(body)))
        return '"etag"'


async def test_every_part_says_what_it_holds() -> None:
    """SeaweedFS gzips a part that has no Content-Type when its first bytes compress."""
    source = _Source()
    sink = OutputSink(source, Settings(output_url="s3://out/p/"))  # type: ignore[arg-type]
    etag = await sink._upload_part("p/k.npy", "upload-1", 3, [memoryview(b"ab"), memoryview(b"c")])
    assert etag == '"etag"'
    assert source.puts == [
        ("http://s3.test/out/p/k.npy?partNumber=3", {"Content-Type": NPY_TYPE}, b"abc")
    ]
    assert NPY_TYPE == "application/octet-stream"


async def test_parts_numbered_by_the_caller_in_any_order_make_one_upload() -> None:
    """A streamed series volume's parts: sent at once, out of order and with gaps in their
    numbers; one upload, completed with the parts in the order of their numbers."""
    sink = _Sink(4)
    upload = PartUpload(sink, "k.npy")  # type: ignore[arg-type]
    async with anyio.create_task_group() as group:
        for number in (9999, 10_000, 9998):
            group.start_soon(upload.put, number, [memoryview(bytes([number % 256]))])
    await upload.put(9997, [memoryview(b"header")])
    await upload.complete()
    assert sink.created == 1
    assert upload.numbers == [9997, 9998, 9999, 10_000]
    assert [p["PartNumber"] for p in sink.completed] == [9997, 9998, 9999, 10_000]
    assert all(p["ETag"] == f"etag-{p['PartNumber']}" for p in sink.completed)
