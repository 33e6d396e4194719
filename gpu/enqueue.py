"""Copies and event records issued to a stream without letting go of the GIL.

CuPy's runtime calls (``memcpyAsync``, ``Event.record``) release the GIL for
the few microseconds they take. On the device thread that is a loss: each
release lets a reader thread or the event loop take the GIL, and getting it
back waits until they let go (up to the switch interval). Traced on the H200
with a 1 GiB object, the device thread spent 1.4 ms a chunk where the same
work alone took 0.6 ms, and an H2D copy bracketed by events showed those
waits as copy time (``python -m tests.trace_large``).

So the enqueue calls go to the CUDA driver (``libcuda.so.1``, there wherever
CUDA runs) through ``ctypes.PyDLL``, which keeps the GIL during the call: an
event, its copy and the next event are issued back to back. Driver and
runtime share handles (a CUDA runtime stream or event is a driver one) and
the device thread's current context is the one CuPy made current. Where the
driver library cannot be loaded, CuPy's calls are used.
"""

from __future__ import annotations

import ctypes
from typing import Any


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D`` (cuda.h)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_HOST, _DEVICE = 1, 2  # CUmemorytype


class Enqueue:
    """``h2d``, ``h2d_2d``, ``d2h`` and ``record`` on streams; used by the device thread only.

    Raises (every method):
        RuntimeError: the driver refused the call (its CUresult in the message).
    """

    def __init__(self, cupy: Any) -> None:
        self._rt = cupy.cuda.runtime
        self.direct = False
        try:
            driver = ctypes.PyDLL("libcuda.so.1")
            self._record = driver.cuEventRecord
            self._h2d = driver.cuMemcpyHtoDAsync_v2
            self._d2h = driver.cuMemcpyDtoHAsync_v2
            self._2d = driver.cuMemcpy2DAsync_v2
            self._error_name = driver.cuGetErrorName
        except (OSError, AttributeError):
            return
        p, size = ctypes.c_void_p, ctypes.c_size_t
        self._record.argtypes = [p, p]
        self._h2d.argtypes = [ctypes.c_uint64, p, size, p]
        self._d2h.argtypes = [p, ctypes.c_uint64, size, p]
        self._2d.argtypes = [ctypes.POINTER(_Memcpy2D), p]
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for function in (self._record, self._h2d, self._d2h, self._2d, self._error_name):
            function.restype = ctypes.c_int
        self.direct = True

    def record(self, event: Any, stream: Any) -> None:
        if self.direct:
            self._check(self._record(event.ptr, stream.ptr), "cuEventRecord")
        else:
            event.record(stream)

    def h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        if self.direct:
            self._check(self._h2d(dst, src, nbytes, stream.ptr), "cuMemcpyHtoDAsync")
        else:
            self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyHostToDevice, stream.ptr)

    def h2d_2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: Any
    ) -> None:
        """``height`` rows of ``width`` bytes, one every ``spitch`` bytes of host memory at
        ``src``, to one every ``dpitch`` bytes of device memory at ``dst``."""
        if not (width and height):
            return
        if self.direct:
            copy = _Memcpy2D(
                srcMemoryType=_HOST, srcHost=src, srcPitch=spitch,
                dstMemoryType=_DEVICE, dstDevice=dst, dstPitch=dpitch,
                WidthInBytes=width, Height=height,
            )  # fmt: skip
            self._check(self._2d(ctypes.byref(copy), stream.ptr), "cuMemcpy2DAsync")
        else:
            self._rt.memcpy2DAsync(
                dst, dpitch, src, spitch, width, height, self._rt.memcpyHostToDevice, stream.ptr
            )

    def d2h(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        if self.direct:
            self._check(self._d2h(dst, src, nbytes, stream.ptr), "cuMemcpyDtoHAsync")
        else:
            self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyDeviceToHost, stream.ptr)

    def _check(self, result: int, call: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self._error_name(result, ctypes.byref(name))
            label = name.value.decode() if name.value else "unknown"
            raise RuntimeError(f"{call} failed: CUDA error {result} ({label})")
