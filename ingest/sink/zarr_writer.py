"""Writing a slide as an OME-Zarr image (``SLIDE_LAYOUT=ome-zarr``): a PUT a tile.

The pipeline hands the writer a slide's output values in frame order, as it
hands the ``.npy`` writer (``ingest.sink.output.ArrayWriter``) any object's; each
whole frame becomes its chunk (``ingest.sink.ngff``) and goes up as one PUT
through the sink's own ``OutputSink.put`` (presigned on the sink's S3 client,
retried, its TLS, proxy and server-side encryption), while later frames are
still decoding. At most ``SINK_PARTS_IN_FLIGHT`` x 8 MiB of chunks are in
flight, the same bytes the ``.npy`` writer holds in parts, so memory stays
bounded whatever the slide's size.

Order, so that no reader takes a partial image for a whole one: the image's
metadata is deleted first (``.zattrs`` first), then every chunk is written,
then a sparse slide's empty cells, then ``0/.zarray``, ``.zgroup`` and
``.zattrs`` last. A failure on the way (or a cancellation) leaves chunks and no
metadata; the object's next try writes the same keys with the same bytes.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import numpy.typing as npt

from ingest.errors import SinkError
from ingest.sink.background import BackgroundPuts
from ingest.sink.ngff import CHUNK_TYPE, ZarrPlan

if TYPE_CHECKING:
    from ingest.sink.output import OutputSink

MAX_CHUNKS_IN_FLIGHT = 1024  # a bound on tasks whatever the bytes allow (tiny tiles)


def chunks_in_flight(parts_in_flight: int, part_bytes: int, chunk_bytes: int) -> int:
    """Chunks of one image uploading at once: as many as fit the bytes the ``.npy``
    writer would hold in parts (``parts_in_flight`` x ``part_bytes``), at least one."""
    return max(1, min(MAX_CHUNKS_IN_FLIGHT, parts_in_flight * part_bytes // chunk_bytes))


class ZarrWriter:
    """Streams one slide into its OME-Zarr image. ``async with`` it, then ``write`` the
    output values in frame order, as an ``ArrayWriter``'s; the metadata is written when
    the block ends without an error."""

    def __init__(
        self, sink: OutputSink, plan: ZarrPlan, shape: tuple[int, ...], dtype: str, part: int
    ) -> None:
        frame_shape = (plan.tile_rows, plan.tile_columns) + ((plan.samples,) * (plan.samples > 1))
        if tuple(shape) != (plan.frames, *frame_shape) or np.dtype(dtype) != np.dtype(plan.dtype):
            raise _PermanentSinkError(
                f"output {shape} {dtype} is not the slide's {plan.frames} tiles of {frame_shape}"
            )
        self._sink = sink
        self.plan = plan
        self._frame_shape = frame_shape
        self._frame_bytes = plan.chunk_bytes
        self._partial = bytearray()  # a frame split between two writes (native chunks)
        self._next = 0  # the next frame's index
        # the chunks in flight: as many bytes as the ``.npy`` writer's parts
        self._puts = BackgroundPuts(chunks_in_flight(sink.parts_in_flight, part, plan.chunk_bytes))
        self.chunks_written = 0

    async def __aenter__(self) -> ZarrWriter:
        for key in self.plan.metadata_keys_to_clear():
            await self._sink.delete(key)
        await self._puts.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self._puts.__aexit__(exc_type, exc, tb)
        if exc is None:
            self._puts.raise_failed()
            await self._finish()
        return None

    async def write(self, values: np.ndarray | None) -> None:
        """Append output values (whole frames or not, C order, the image's dtype).

        Raises:
            SinkError: more values than the slide has frames, or an earlier PUT failed.
        """
        if values is None:
            raise _PermanentSinkError("no host values to write (the device kept them)")
        self._puts.raise_failed()
        array = np.ascontiguousarray(values)
        if array.dtype != np.dtype(self.plan.dtype):
            raise _PermanentSinkError(f"{array.dtype} values for a {self.plan.dtype} image")
        data = array.reshape(-1).view(np.uint8)
        if self._partial:  # complete the split frame first
            take = min(len(data), self._frame_bytes - len(self._partial))
            self._partial += data[:take].tobytes()
            data = data[take:]
            if len(self._partial) == self._frame_bytes:
                frame = np.frombuffer(bytes(self._partial), dtype=self.plan.dtype)
                self._partial = bytearray()
                await self._put_frame(frame.reshape(self._frame_shape))
        whole = len(data) // self._frame_bytes
        if whole:
            frames = data[: whole * self._frame_bytes].view(self.plan.dtype)
            await self._put_frames(frames.reshape(whole, *self._frame_shape))
        if len(data) > whole * self._frame_bytes:
            self._partial += data[whole * self._frame_bytes :].tobytes()

    async def _put_frame(self, frame: npt.NDArray[Any]) -> None:
        await self._put_frames(frame[None])

    async def _put_frames(self, frames: npt.NDArray[Any]) -> None:
        """Frames ``_next`` on, each its chunk's PUT. The chunks (an RGB tile's samples
        made planes: a strided copy of ~0.5 ms a 256 x 256 tile) are made in a thread,
        a write's frames at once, so the event loop only starts the PUTs."""
        first = self._next
        if first + len(frames) > self.plan.frames:
            raise _PermanentSinkError(f"more than the slide's {self.plan.frames} frames")
        self._next += len(frames)
        bodies = await anyio.to_thread.run_sync(self._chunks, first, frames)
        for index, body in enumerate(bodies, first):
            await self._start(self.plan.chunk_key(self.plan.cell(index)), body)

    def _chunks(self, first: int, frames: npt.NDArray[Any]) -> list[memoryview]:
        return [
            self.plan.chunk(index, frame).reshape(-1).view(np.uint8).data
            for index, frame in enumerate(frames, first)
        ]

    async def _start(self, key: str, body: memoryview) -> None:
        await self._puts.start(functools.partial(self._put, key, body))

    async def _put(self, key: str, body: memoryview) -> None:
        await self._sink.put(key, [body], CHUNK_TYPE)
        self.chunks_written += 1

    async def _finish(self) -> None:
        """The empty cells of a sparse slide, then the metadata, ``.zattrs`` last."""
        if self._next != self.plan.frames or self._partial:
            raise _PermanentSinkError(f"{self._next} of the slide's {self.plan.frames} frames")
        fill = memoryview(self.plan.fill_chunk())
        async with self._puts:
            for cell in self.plan.empty_cells():
                self._puts.raise_failed()
                await self._start(self.plan.chunk_key(cell), fill)
        self._puts.raise_failed()
        for key, document in self.plan.metadata():
            await self._sink.put_json(key, document)


class _PermanentSinkError(SinkError):
    retriable = False
