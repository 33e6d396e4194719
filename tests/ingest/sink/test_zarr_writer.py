"""The OME-Zarr writer's order and bounds, against a twin of the sink's PUT and DELETE:
chunks in flight bounded by the sink's part budget, frames split between writes, the
metadata deleted first and written last, and none of it written when a chunk fails.

The images it writes through the real sink, read back by zarr-python and
ome-zarr-py, are tested in tests/ingest/sink/test_zarr.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import numpy as np
import pytest

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.errors import SinkError
from ingest.sink.ngff import Origin, ZarrPlan, zarr_plan
from ingest.sink.zarr_writer import ZarrWriter, chunks_in_flight
from tests.ingest.sink import slides

pytestmark = pytest.mark.anyio


class _Sink:
    """What ``ZarrWriter`` calls on ``OutputSink``; fails the PUT of ``fail_key``."""

    def __init__(self, parts_in_flight: int, fail_key: str | None = None) -> None:
        self.parts_in_flight = parts_in_flight
        self.fail_key = fail_key
        self.events: list[tuple[str, str]] = []
        self.bodies: dict[str, bytes] = {}
        self.uploading = 0
        self.most = 0

    async def put(self, key: str, body: list[memoryview], content_type: str) -> None:
        self.uploading += 1
        self.most = max(self.most, self.uploading)
        try:
            # out of order, and long enough that the writer reaches its bound meanwhile
            await anyio.sleep(0.005 + 0.001 * (len(self.events) % 3))
            if key == self.fail_key:
                raise SinkError("put_object: 403 (the twin refuses)")
            self.bodies[key] = b"".join(bytes(v) for v in body)
            self.events.append(("put", key))
        finally:
            self.uploading -= 1

    async def put_json(self, key: str, document: Mapping[str, Any]) -> None:
        self.events.append(("json", key))

    async def delete(self, key: str) -> None:
        self.events.append(("delete", key))


def _plan(data: bytes) -> ZarrPlan:
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    return zarr_plan("out/k.zarr", Origin(header, "b", "k", None, "e", len(data)), "uint8", None)


async def _write(sink: _Sink, plan: ZarrPlan, pieces: list[np.ndarray], part: int) -> None:
    """Write ``pieces`` of output values, in order, into ``plan``'s image."""
    shape = (plan.frames, plan.tile_rows, plan.tile_columns, plan.samples)
    async with ZarrWriter(sink, plan, shape, "uint8", part) as writer:  # type: ignore[arg-type]
        for piece in pieces:
            await writer.write(piece)


def _values(plan: ZarrPlan) -> np.ndarray:
    shape = (plan.frames, plan.tile_rows, plan.tile_columns, plan.samples)
    return np.random.default_rng(7).integers(0, 256, shape, dtype=np.uint8)


async def test_order_bound_and_frames_split_between_writes() -> None:
    plan = _plan(slides.tiled_full(4, 3, 32))
    values = _values(plan)
    chunk = plan.chunk_bytes  # 3 KiB
    sink = _Sink(parts_in_flight=1)
    part = 3 * chunk  # three chunks' worth: at most three in flight
    await _write(sink, plan, np.array_split(values.reshape(-1), 7), part)  # edges inside frames
    assert sink.most == 3
    kinds = [kind for kind, _ in sink.events]
    assert kinds[:3] == ["delete"] * 3
    assert sink.events[0] == ("delete", "out/k.zarr/.zattrs")
    assert kinds[3:-3] == ["put"] * plan.frames
    assert sink.events[-3:] == [
        ("json", "out/k.zarr/0/.zarray"),
        ("json", "out/k.zarr/.zgroup"),
        ("json", "out/k.zarr/.zattrs"),
    ]
    for k in range(plan.frames):
        body = sink.bodies[plan.chunk_key(plan.cell(k))]
        assert body == np.moveaxis(values[k], -1, 0).tobytes()


async def test_a_failed_chunk_leaves_no_metadata() -> None:
    plan = _plan(slides.tiled_full(4, 3, 32))
    values = _values(plan)
    sink = _Sink(parts_in_flight=4, fail_key=plan.chunk_key((0, 1, 2)))
    with pytest.raises(SinkError, match="the twin refuses"):
        await _write(sink, plan, [frame[None] for frame in values], 8 << 20)
    assert not [e for e in sink.events if e[0] == "json"]


async def test_too_many_values_and_a_short_image_fail() -> None:
    plan = _plan(slides.tiled_full(2, 2, 32))
    values = _values(plan)
    sink = _Sink(parts_in_flight=4)
    with pytest.raises(SinkError, match="more than the slide's 4 frames"):
        await _write(sink, plan, [values, values[:1]], 8 << 20)
    with pytest.raises(SinkError, match="3 of the slide's 4 frames"):
        await _write(sink, plan, [values[:3]], 8 << 20)
    assert not [e for e in sink.events if e[0] == "json"]


def test_chunks_in_flight_follow_the_parts_budget() -> None:
    assert chunks_in_flight(4, 8 << 20, 256 * 256 * 3) == 170  # uint8 RGB 256 x 256
    assert chunks_in_flight(4, 8 << 20, 256 * 256 * 3 * 4) == 42  # float32
    assert chunks_in_flight(1, 8 << 20, 64 << 20) == 1  # a tile larger than the budget
    assert chunks_in_flight(256, 8 << 20, 64) == 1024  # tiny tiles: a bound on tasks
