"""The CUDA driver API through ``ctypes``: the calls the device thread makes, no more.

The worker's CUDA path needs a context, a stream, events, device and pinned
memory, copies, one module and one kernel launch: about twenty calls into
``libcuda.so.1``, which the NVIDIA driver installs wherever CUDA runs. They are
made here rather than through a Python CUDA library for memory and for the GIL:

- **CuPy**'s ``import cupy`` costs more than half of the resident memory a CUDA
  worker holds before its ring (its core loads cuBLAS and cuBLASLt;
  ``python3 -m ingest.bench.diagnostics.rss_cost cuda`` measures it), against a
  ``ring + 300 MB`` target. A worker without a hook never imports it.
- **cuda-bindings** (NVIDIA's Cython bindings) is light to import but lets go
  of the GIL in every call. On the device thread that is a loss for the calls
  that only queue work: each release lets a reader thread or the event loop
  take the GIL, and getting it back waits up to the switch interval
  (``gpu/ingest_gpu/enqueue.py``).

So two handles on the same library: ``_HOLD`` (``ctypes.PyDLL``) keeps the GIL
for the calls that return at once (queueing copies, event records, the launch,
pointer queries), and ``_FREE`` (``ctypes.CDLL``) releases it for the calls
that may wait or take long (allocation, pinning, synchronisation, module
loading).

CuPy stays where a user wants it: the arrays handed to a hook are CuPy arrays
on this context's device (``ingest_gpu.transfer``), and a GPU for which no cubin ships
gets the kernel compiled by CuPy's NVRTC (``ingest_gpu.kernel``). CuPy works in the
same primary context as this module, so its arrays, ours and its kernels mix.

Contexts: the device's primary context (``cuDevicePrimaryCtxRetain``), the
one the CUDA runtime, CuPy and PyTorch use, made current on the threads that
call into the driver. It is retained once per process and never released, as
CuPy does; memory is freed with that context pushed, from whatever thread
drops the last reference.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from typing import Any

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR = 75, 76  # CUdevice_attribute
_STREAM_NON_BLOCKING = 1
_EVENT_DEFAULT = 0  # timing enabled
_MEMHOSTALLOC_PORTABLE = 1
_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2  # CUmemorytype

_p, _size, _uint, _int, _u64 = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_uint,
    ctypes.c_int,
    ctypes.c_uint64,
)
_pp = ctypes.POINTER(ctypes.c_void_p)


class Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D`` (cuda.h)."""

    _fields_ = [
        ("srcXInBytes", _size),
        ("srcY", _size),
        ("srcMemoryType", _int),
        ("srcHost", _p),
        ("srcDevice", _u64),
        ("srcArray", _p),
        ("srcPitch", _size),
        ("dstXInBytes", _size),
        ("dstY", _size),
        ("dstMemoryType", _int),
        ("dstHost", _p),
        ("dstDevice", _u64),
        ("dstArray", _p),
        ("dstPitch", _size),
        ("WidthInBytes", _size),
        ("Height", _size),
    ]


# name: (argument types, keeps the GIL)
_SIGNATURES: dict[str, tuple[list[Any], bool]] = {
    "cuGetErrorName": ([_int, ctypes.POINTER(ctypes.c_char_p)], True),
    "cuInit": ([_uint], False),
    "cuDeviceGetCount": ([ctypes.POINTER(_int)], False),
    "cuDeviceGet": ([ctypes.POINTER(_int), _int], False),
    "cuDeviceGetAttribute": ([ctypes.POINTER(_int), _int, _int], False),
    "cuDevicePrimaryCtxRetain": ([_pp, _int], False),
    "cuCtxSetCurrent": ([_p], False),
    "cuCtxPushCurrent_v2": ([_p], False),
    "cuCtxPopCurrent_v2": ([_pp], False),
    "cuStreamCreate": ([_pp, _uint], False),
    "cuStreamSynchronize": ([_p], False),
    "cuStreamDestroy_v2": ([_p], False),
    "cuEventCreate": ([_pp, _uint], False),
    "cuEventSynchronize": ([_p], False),
    "cuEventDestroy_v2": ([_p], False),
    "cuEventRecord": ([_p, _p], True),
    "cuEventElapsedTime": ([ctypes.POINTER(ctypes.c_float), _p, _p], True),
    "cuMemAlloc_v2": ([ctypes.POINTER(_u64), _size], False),
    "cuMemFree_v2": ([_u64], False),
    "cuMemHostAlloc": ([_pp, _size, _uint], False),
    "cuMemFreeHost": ([_p], False),
    "cuMemcpyHtoDAsync_v2": ([_u64, _p, _size, _p], True),
    "cuMemcpyDtoHAsync_v2": ([_p, _u64, _size, _p], True),
    "cuMemcpyDtoDAsync_v2": ([_u64, _u64, _size, _p], True),
    "cuMemcpy2DAsync_v2": ([ctypes.POINTER(Memcpy2D), _p], True),
    "cuModuleLoadData": ([_pp, ctypes.c_char_p], False),
    "cuModuleGetFunction": ([_pp, _p, ctypes.c_char_p], False),
    "cuLaunchKernel": ([_p, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _p, _pp, _pp], True),
    "cuPointerGetAttribute": ([_p, _int, _u64], True),
}


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is its ``CUresult``."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({name})")
        self.call = call
        self.code = code


class _Library:
    """``libcuda.so.1`` with every function of ``_SIGNATURES`` typed."""

    def __init__(self) -> None:
        hold = ctypes.PyDLL("libcuda.so.1")
        free = ctypes.CDLL("libcuda.so.1")
        self.functions: dict[str, Any] = {}
        for name, (argtypes, keeps_gil) in _SIGNATURES.items():
            function = getattr(hold if keeps_gil else free, name)
            function.argtypes = argtypes
            function.restype = _int
            self.functions[name] = function

    def __call__(self, name: str, *args: Any) -> None:
        """Call ``name``; raises ``CudaError`` (``MemoryError`` when out of memory)."""
        code = self.functions[name](*args)
        if code != _CUDA_SUCCESS:
            raise self.error(name, code)

    def error(self, call: str, code: int) -> Exception:
        label = ctypes.c_char_p()
        self.functions["cuGetErrorName"](code, ctypes.byref(label))
        name = label.value.decode() if label.value else "unknown"
        if code == _CUDA_ERROR_OUT_OF_MEMORY:
            return MemoryError(f"{call} failed: CUDA error {code} ({name})")
        return CudaError(call, code, name)


@functools.cache
def library() -> _Library:
    """The driver, loaded and initialised once per process (``cuInit``: no context yet).

    Raises:
        OSError: ``libcuda.so.1`` cannot be loaded (no NVIDIA driver).
        CudaError: the driver refused to initialise (no device, a broken install).
    """
    lib = _Library()
    lib("cuInit", 0)
    return lib


def device_count() -> int:
    """CUDA devices visible to this process (OSError or CudaError where there is no driver)."""
    count = ctypes.c_int()
    library()("cuDeviceGetCount", ctypes.byref(count))
    return count.value


class Context:
    """A device's primary context; ``make_current`` on each thread that uses it."""

    def __init__(self, device_index: int) -> None:
        lib = library()
        device, handle = ctypes.c_int(), ctypes.c_void_p()
        lib("cuDeviceGet", ctypes.byref(device), device_index)
        lib("cuDevicePrimaryCtxRetain", ctypes.byref(handle), device.value)
        self.device_index = device_index
        self.handle = int(handle.value or 0)
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib("cuDeviceGetAttribute", ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, device.value)
        lib("cuDeviceGetAttribute", ctypes.byref(minor), _COMPUTE_CAPABILITY_MINOR, device.value)
        self.compute_capability = f"{major.value}{minor.value}"  # "90" on Hopper

    def make_current(self) -> None:
        library()("cuCtxSetCurrent", self.handle)


_contexts: dict[int, Context] = {}
_contexts_lock = threading.Lock()


def primary_context(device_index: int = 0) -> Context:
    """The device's primary context, retained on first use, made current on this thread."""
    with _contexts_lock:
        context = _contexts.get(device_index)
        if context is None:
            context = _contexts[device_index] = Context(device_index)
    context.make_current()
    return context


def _pushed(context: int, call: str, *args: Any) -> None:
    """``call`` with ``context`` current, from any thread (a finalizer's): errors ignored,
    since a free that fails at interpreter exit has nothing left to free."""
    lib = library()
    popped = ctypes.c_void_p()
    if lib.functions["cuCtxPushCurrent_v2"](context) != _CUDA_SUCCESS:
        return
    try:
        lib.functions[call](*args)
    finally:
        lib.functions["cuCtxPopCurrent_v2"](ctypes.byref(popped))


class Stream:
    """A non-blocking stream (it does not wait on the legacy default stream)."""

    def __init__(self, context: Context) -> None:
        handle = ctypes.c_void_p()
        library()("cuStreamCreate", ctypes.byref(handle), _STREAM_NON_BLOCKING)
        self.handle = int(handle.value or 0)
        self._finalizer = weakref.finalize(
            self, _pushed, context.handle, "cuStreamDestroy_v2", self.handle
        )

    def synchronize(self) -> None:
        library()("cuStreamSynchronize", self.handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, the handle): CuPy's
        ``Stream.from_external`` and cuda.core take this stream as it is."""
        return (0, self.handle)

    def close(self) -> None:
        self._finalizer()


class Event:
    """A timing event; record it with ``ingest_gpu.enqueue.Enqueue.record``."""

    def __init__(self, context: Context) -> None:
        handle = ctypes.c_void_p()
        library()("cuEventCreate", ctypes.byref(handle), _EVENT_DEFAULT)
        self.handle = int(handle.value or 0)
        self._finalizer = weakref.finalize(
            self, _pushed, context.handle, "cuEventDestroy_v2", self.handle
        )

    def synchronize(self) -> None:
        library()("cuEventSynchronize", self.handle)

    def close(self) -> None:
        self._finalizer()


def elapsed_ms(start: Event, end: Event) -> float:
    """Milliseconds between two recorded, completed events."""
    ms = ctypes.c_float()
    library()("cuEventElapsedTime", ctypes.byref(ms), start.handle, end.handle)
    return float(ms.value)


class DeviceMemory:
    """``nbytes`` of device memory (``cuMemAlloc``), freed with the object or ``close``."""

    def __init__(self, context: Context, nbytes: int) -> None:
        ptr = ctypes.c_uint64()
        library()("cuMemAlloc_v2", ctypes.byref(ptr), max(nbytes, 1))
        self.ptr = int(ptr.value)
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _pushed, context.handle, "cuMemFree_v2", self.ptr)

    def close(self) -> None:
        self._finalizer()


class PinnedBlock:
    """A block of page-locked host memory (``cuMemHostAlloc``); freed when collected."""

    def __init__(self, context: Context, nbytes: int) -> None:
        ptr = ctypes.c_void_p()
        library()("cuMemHostAlloc", ctypes.byref(ptr), max(nbytes, 1), _MEMHOSTALLOC_PORTABLE)
        self.ptr = int(ptr.value or 0)
        weakref.finalize(self, _pushed, context.handle, "cuMemFreeHost", self.ptr)


def pinned_array(context: Context, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    """Exactly ``nbytes`` of page-locked host memory as a ``ctypes`` array.

    The array supports the buffer protocol (``np.frombuffer``, ``memoryview``)
    and holds its ``PinnedBlock``: the memory is unpinned and freed once the
    array and every view of it are gone, so no view ever dangles.

    Raises:
        MemoryError: the driver could not pin that much.
    """
    block = PinnedBlock(context, nbytes)
    array = (ctypes.c_char * nbytes).from_address(block.ptr)
    array.block = block  # type: ignore[attr-defined]
    return array


def memory_type(address: int) -> int:
    """``MEMORYTYPE_HOST`` for pinned host memory, ``MEMORYTYPE_DEVICE``, or 0 for
    memory the driver does not know (pageable host memory)."""
    kind = ctypes.c_uint()
    code = library().functions["cuPointerGetAttribute"](
        ctypes.byref(kind), _POINTER_ATTRIBUTE_MEMORY_TYPE, address
    )
    return int(kind.value) if code == _CUDA_SUCCESS else 0


class Module:
    """A loaded cubin and one of its kernels (kept loaded for the process's life)."""

    def __init__(self, image: bytes, kernel_name: str) -> None:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        lib = library()
        lib("cuModuleLoadData", ctypes.byref(module), image)
        lib("cuModuleGetFunction", ctypes.byref(function), module, kernel_name.encode())
        self.function = int(function.value or 0)


def launch(
    function: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    pointers: tuple[int, ...],
    stream: int,
) -> None:
    """Launch ``function`` on ``stream`` with device pointers as its arguments (GIL kept)."""
    values = [ctypes.c_uint64(p) for p in pointers]
    args = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    library()("cuLaunchKernel", function, *grid, *block, 0, stream, args, None)
