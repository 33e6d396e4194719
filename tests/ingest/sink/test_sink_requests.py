"""The sink's small requests against the real SeaweedFS: listings (paged, odd keys), reads
(whole, ranged, missing) and deletes, through the data path's threads
(``S3Source.request_whole``)."""

from __future__ import annotations

import anyio
import pytest

from ingest.embedded.stack import Stack
from ingest.errors import SinkError
from ingest.fetch.s3 import S3Source
from ingest.sink.output import OutputSink
from tests import harness

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.usefixtures("aws_environment"),
]

ODD = ["a b/c+d.json", "x&y<z>.json", "日本/キー.json", "100%/é.json", "q?r#s=t.json"]


async def test_listings_reads_and_deletes(stack: Stack) -> None:
    names = harness.make_names("sinkreq")
    stack.s3.create_bucket(names.output_bucket)
    settings = harness.make_settings(stack, names)
    # more than one page: S3 answers at most 1,000 keys a page
    many = [f"many/{n:05d}.json" for n in range(1050)]
    async with S3Source(settings) as source:
        sink = OutputSink(source, settings)
        limit = anyio.CapacityLimiter(32)

        async def put(key: str) -> None:
            async with limit:
                await sink.put_json(key, {"key": key})

        async with anyio.create_task_group() as group:
            for key in [f"odd/{k}" for k in ODD] + many:
                group.start_soon(put, key)

        assert await sink.keys("odd/") == sorted(f"odd/{k}" for k in ODD)
        assert await sink.keys("many/") == many
        assert await sink.keys("none/") == []

        whole = await sink.get(f"odd/{ODD[1]}")
        assert whole == b'{"key":"odd/x&y<z>.json"}'
        assert await sink.get(f"odd/{ODD[1]}", 2, 3) == whole[2:5]
        assert await sink.get("odd/missing.json") is None

        await sink.delete(f"odd/{ODD[0]}")
        await sink.delete("odd/missing.json")  # S3 answers 204 for a key that is not there
        assert await sink.get(f"odd/{ODD[0]}") is None
        assert await sink.keys("odd/") == sorted(f"odd/{k}" for k in ODD[1:])


async def test_a_listing_of_a_missing_bucket_fails_at_once(stack: Stack) -> None:
    names = harness.make_names("sinkgone")  # its buckets are never made
    settings = harness.make_settings(stack, names)
    async with S3Source(settings) as source:
        sink = OutputSink(source, settings)
        with anyio.fail_after(10):  # not retried: the retry policy would take longer
            with pytest.raises(SinkError, match="list_objects_v2") as raised:
                await sink.keys("x/")
    assert not raised.value.retriable
