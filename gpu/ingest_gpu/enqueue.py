"""Copies and event records issued to a stream without letting go of the GIL.

CuPy's runtime calls (``memcpyAsync``, ``Event.record``) release the GIL for
the few microseconds they take, and so do NVIDIA's cuda-bindings. On the
device thread that is a loss: each release lets a reader thread or the event
loop take the GIL, and getting it back waits until they let go (up to the
switch interval). Those waits can more than double the device thread's time
per chunk, and an H2D copy bracketed by events counts them as copy time
(``python -m ingest.bench.diagnostics.trace_large`` shows both).

So these calls go to the driver through ``ingest_gpu.driver``'s ``ctypes.PyDLL``
handle, which keeps the GIL during the call: an event, its copy and the next
event are issued back to back.
"""

from __future__ import annotations

import ctypes

from ingest_gpu.driver import MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Event, Memcpy2D, Stream, library


class Enqueue:
    """``h2d``, ``h2d_2d``, ``d2h``, ``d2d`` and ``record`` on streams (device thread only).

    Raises (every method):
        ingest_gpu.driver.CudaError: the driver refused the call (its CUresult in the message).
    """

    def __init__(self) -> None:
        self._lib = library()

    def record(self, event: Event, stream: Stream) -> None:
        self._lib("cuEventRecord", event.handle, stream.handle)

    def h2d(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        if nbytes:
            self._lib("cuMemcpyHtoDAsync_v2", dst, src, nbytes, stream.handle)

    def h2d_2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: Stream
    ) -> None:
        """``height`` rows of ``width`` bytes, one every ``spitch`` bytes of host memory at
        ``src``, to one every ``dpitch`` bytes of device memory at ``dst``."""
        if not (width and height):
            return
        copy = Memcpy2D(
            srcMemoryType=MEMORYTYPE_HOST,
            srcHost=src,
            srcPitch=spitch,
            dstMemoryType=MEMORYTYPE_DEVICE,
            dstDevice=dst,
            dstPitch=dpitch,
            WidthInBytes=width,
            Height=height,
        )
        self._lib("cuMemcpy2DAsync_v2", ctypes.byref(copy), stream.handle)

    def d2h(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        if nbytes:
            self._lib("cuMemcpyDtoHAsync_v2", dst, src, nbytes, stream.handle)

    def d2d(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        if nbytes:
            self._lib("cuMemcpyDtoDAsync_v2", dst, src, nbytes, stream.handle)
