"""Host buffers for the ring: page-locked (pinned) when CUDA is used, anonymous memory otherwise.

Only pinned memory lets a host-to-device copy run asynchronously at full speed;
pageable memory is staged by the driver through a pinned buffer of its own, at a
fraction of the rate. Pinned memory is allocated on the device thread
(``DeviceThread.alloc_host`` does that), where the device's context is current,
through the driver (``ingest_gpu.driver``). Every buffer's usable region starts on a
64 KiB boundary: the allocation is over-sized by one alignment and the region
offset into it.

``COUNTERS`` counts every host allocation made here, so a benchmark can show
that steady state allocates nothing per object.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from typing import Any

import numpy as np

ALIGNMENT = 64 * 1024


class AllocationCounters:
    """Host allocations made through this module; thread-safe."""

    _FIELDS = ("pinned_allocations", "pinned_bytes", "pageable_allocations", "pageable_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._FIELDS, 0)

    def add(self, nbytes: int, *, pinned: bool) -> None:
        kind = "pinned" if pinned else "pageable"
        with self._lock:
            self._values[f"{kind}_allocations"] += 1
            self._values[f"{kind}_bytes"] += nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


COUNTERS = AllocationCounters()


class HostBuffer:
    """``nbytes`` of host memory starting on a 64 KiB boundary.

    ``view`` is a writable memoryview of exactly ``nbytes``; ``address`` is its
    first byte. ``close`` drops this object's hold on the memory: it is freed
    once no view of it is alive any more (views hold the allocation), so a
    view kept past ``close`` never dangles.
    """

    __slots__ = ("_address", "_owner", "_pinned", "_view", "nbytes")

    def __init__(self, owner: Any, view: memoryview, address: int, *, pinned: bool) -> None:
        self._owner = owner
        self._view: memoryview | None = view
        self._address = address
        self._pinned = pinned
        self.nbytes = len(view)

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ValueError("host buffer is closed")
        return self._view

    @property
    def address(self) -> int:
        return self._address

    @property
    def pinned(self) -> bool:
        return self._pinned

    def close(self) -> None:
        """Release this buffer; idempotent."""
        view, self._view = self._view, None
        if view is not None:
            # BufferError: someone holds a buffer exported from it; it goes with them.
            with contextlib.suppress(BufferError):
                view.release()
        owner, self._owner = self._owner, None
        if isinstance(owner, mmap.mmap):
            # BufferError: views sliced from ours are alive; the mmap goes when they do.
            with contextlib.suppress(BufferError):
                owner.close()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pinned_memory(nbytes: int, device_index: int = 0) -> Any:
    """Exactly ``nbytes`` of page-locked memory (``cuMemHostAlloc``), freed with the object.

    Not ``cupy.cuda.alloc_pinned_memory``: its pool rounds every request up to a
    power of two (a 768 MiB ring would lock 1 GiB, a 512 MiB one twice its size;
    ``python3 -m ingest.bench.diagnostics.rss_cost``) and keeps freed blocks
    locked for reuse; and the worker does not import CuPy. The result supports
    the buffer protocol; ``ctypes.addressof`` gives its first byte.
    """
    from ingest_gpu import driver

    return driver.pinned_array(driver.primary_context(device_index), nbytes)


def alloc_host(nbytes: int, *, pinned: bool, device_index: int = 0) -> HostBuffer:
    """Allocate ``nbytes`` of host memory, 64 KiB aligned.

    ``pinned=True`` takes page-locked memory from the CUDA driver for
    ``device_index``'s context (call it on the device thread); otherwise an
    anonymous private mapping, page-aligned by the kernel.

    Raises:
        ValueError: ``nbytes`` is negative.
        OSError: ``pinned=True`` where there is no CUDA driver.
        MemoryError: the allocation failed.
    """
    if nbytes < 0:
        raise ValueError(f"cannot allocate {nbytes} bytes")
    total = nbytes + ALIGNMENT
    owner: Any
    if pinned:
        owner = pinned_memory(total, device_index)
        base = ctypes.addressof(owner)
        whole = np.frombuffer(owner, dtype=np.uint8, count=total)  # holds the allocation
    else:
        owner = mmap.mmap(-1, total)
        probe = ctypes.c_char.from_buffer(owner)
        base = ctypes.addressof(probe)
        del probe  # a live export would keep the mmap from closing
        whole = np.frombuffer(owner, dtype=np.uint8)
    offset = -base % ALIGNMENT
    view = whole[offset : offset + nbytes].data
    COUNTERS.add(total, pinned=pinned)
    return HostBuffer(owner, view, base + offset, pinned=pinned)
