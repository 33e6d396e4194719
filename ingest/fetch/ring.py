"""PinnedRing: a fixed set of host memory slots, allocated once, handed out with backpressure.

Byte ranges of S3 objects are read straight into slots; the device stage copies
from them. The whole ring is one allocation made at start-up (page-locked when
CUDA is present, so host-to-device copies are truly asynchronous; page-aligned
anonymous memory otherwise), cut into ``slots`` slots of ``slot_size`` bytes,
each starting on a 64 KiB boundary. Nothing is allocated per object.

A slot is reference counted: whoever reads it (the hasher, the device stage)
``retain``\\s it first and ``release``\\s it when done; it returns to the free
list when the count drops to zero. The device thread releases through
``release_threadsafe``, which hands the release to the event loop, because the
free list and its semaphore belong to the loop.

``acquire`` waits while every slot is in use: that wait is the backpressure
that keeps memory bounded whatever the object sizes are.

Small objects (a CT slice is ~0.5 MB) get a small slot: ``acquire(nbytes)``
with ``nbytes <= small_size`` cuts a free slot into ``slot_size //
small_size`` small slots (a slab) and hands them out until it is full; the slot
goes back to the ring when its last small slot is freed. So a 32 MiB slot holds
32 slices in flight instead of one, within the same memory (a slab's views are
cut the first time its slot is cut, then reused).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

ALIGNMENT = 64 * 1024
SMALL_SLOT_SIZE = 1024 * 1024  # a 512x512 16-bit slice and its header fit


class HostMemory(Protocol):
    """What the ring needs from an allocation (``ingest_gpu.memory.HostBuffer`` fits)."""

    @property
    def view(self) -> memoryview: ...

    @property
    def pinned(self) -> bool: ...

    def close(self) -> None: ...


class _Home(Protocol):
    """Where a slot goes back to: the ring, or the slab it was cut from."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def take_back(self, slot: Slot) -> None: ...


class Slot:
    """One region of the ring. ``view`` is writable; its length is the slot's size."""

    __slots__ = ("_home", "_refs", "index", "view")

    def __init__(self, home: _Home, index: int, view: memoryview) -> None:
        self._home = home
        self._refs = 0
        self.index = index
        self.view = view

    def retain(self, count: int = 1) -> None:
        """Take ``count`` more references (call on the event loop)."""
        if self._refs <= 0:
            raise RuntimeError(f"slot {self.index} retained after it was returned")
        self._refs += count

    def release(self, count: int = 1) -> None:
        """Drop ``count`` references (call on the event loop); the last one frees the slot."""
        self._refs -= count
        if self._refs == 0:
            self._home.take_back(self)
        elif self._refs < 0:
            raise RuntimeError(f"slot {self.index} released more often than retained")

    def release_threadsafe(self) -> None:
        """Drop one reference from any thread (the device thread uses this)."""
        self._home.loop.call_soon_threadsafe(self.release)


class _Slab:
    """One of the ring's slots, cut into small slots."""

    def __init__(self, ring: PinnedRing, whole: Slot, small_size: int, first_index: int) -> None:
        self._ring = ring
        self.whole = whole
        count = len(whole.view) // small_size
        self.smalls = [
            Slot(self, first_index + i, whole.view[i * small_size : (i + 1) * small_size])
            for i in range(count)
        ]
        self.free: deque[Slot] = deque(self.smalls)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._ring.loop

    def take_back(self, slot: Slot) -> None:
        self.free.append(slot)
        self._ring._small_freed(self)


@dataclass(frozen=True, slots=True)
class RingStats:
    slots: int
    slot_size: int
    in_use: int  # slots, a slab counting as one
    small_in_use: int
    acquired: int  # slots and small slots handed out
    small_acquired: int
    waits: int
    pinned: bool


class PinnedRing:
    """The bounded ring of host slots. Create it on the event loop; ``aclose`` frees it."""

    def __init__(
        self, memory: HostMemory, slot_size: int, slots: int, small_size: int = SMALL_SLOT_SIZE
    ) -> None:
        """No small slots unless a slot holds two of ``small_size`` at least."""
        if slot_size % ALIGNMENT or small_size % ALIGNMENT:
            raise ValueError(f"slot sizes {slot_size}, {small_size} not multiples of {ALIGNMENT}")
        if len(memory.view) < slot_size * slots:
            raise ValueError("host memory is smaller than the ring")
        self._memory = memory
        self._loop = asyncio.get_running_loop()
        self._slots = [
            Slot(self, i, memory.view[i * slot_size : (i + 1) * slot_size]) for i in range(slots)
        ]
        self._free: deque[Slot] = deque(self._slots)
        self._available = anyio.Semaphore(slots)
        self.slot_size = slot_size
        self.small_size = small_size if 2 * small_size <= slot_size else 0
        self._slabs: dict[int, _Slab] = {}  # by slot index: cut once, reused
        self._open: list[_Slab] = []  # slabs in use with a free small slot, oldest first
        self._freed = anyio.Event()  # set, then renewed, when a slot or a full slab's is freed
        self._small_in_use = 0
        self._small_acquired = 0
        self._acquired = 0
        self._waits = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @classmethod
    async def allocate(
        cls, allocate: Callable[[int], HostMemory], slot_size: int, slots: int
    ) -> PinnedRing:
        """Allocate the ring's memory once (off the event loop) and build the ring."""
        memory = await anyio.to_thread.run_sync(allocate, slot_size * slots)
        return cls(memory, slot_size, slots)

    async def acquire(self, nbytes: int | None = None) -> Slot:
        """A free slot with one reference (a small one when ``nbytes`` fits one); waits
        while the ring is full."""
        if nbytes is not None and nbytes <= self.small_size:
            slot = await self._acquire_small()
        else:
            if self._available.value == 0:
                self._waits += 1
            await self._available.acquire()
            slot = self._take_whole()
        self._acquired += 1
        return slot

    def _take_whole(self) -> Slot:
        slot = self._free.popleft()
        slot._refs = 1
        return slot

    async def _acquire_small(self) -> Slot:
        """From the oldest slab with a free small slot, else from a newly cut one; waits
        until a small slot or a whole slot is freed (a waiter for a whole slot is served
        first: the semaphore hands it the slot)."""
        waited = False
        while not self._open:
            try:
                self._available.acquire_nowait()
            except anyio.WouldBlock:
                self._waits += not waited
                waited = True
                await self._freed.wait()
                continue
            whole = self._take_whole()
            slab = self._slabs.get(whole.index)
            if slab is None:
                first = len(self._slots) + whole.index * (self.slot_size // self.small_size)
                slab = self._slabs[whole.index] = _Slab(self, whole, self.small_size, first)
            self._open.append(slab)
        slab = self._open[0]  # the oldest: the newer ones drain and go back to the ring
        small = slab.free.popleft()
        if not slab.free:
            self._open.remove(slab)
        small._refs = 1
        self._small_in_use += 1
        self._small_acquired += 1
        return small

    def take_back(self, slot: Slot) -> None:
        self._free.append(slot)
        self._available.release()
        self._notify_freed()

    def _small_freed(self, slab: _Slab) -> None:
        self._small_in_use -= 1
        if len(slab.free) == 1:  # it was full
            self._open.append(slab)
            self._notify_freed()
        if len(slab.free) == len(slab.smalls):
            self._open.remove(slab)
            slab.whole.release()

    def _notify_freed(self) -> None:
        self._freed.set()
        self._freed = anyio.Event()

    def stats(self) -> RingStats:
        return RingStats(
            slots=len(self._slots),
            slot_size=self.slot_size,
            in_use=len(self._slots) - len(self._free),
            small_in_use=self._small_in_use,
            acquired=self._acquired,
            small_acquired=self._small_acquired,
            waits=self._waits,
            pinned=self._memory.pinned,
        )

    async def aclose(self) -> None:
        """Free the memory. Slots still in use make this an error: it would free live data."""
        for slab in self._slabs.values():
            for small in slab.smalls:
                small.view.release()
        for slot in self._slots:
            slot.view.release()
        self._memory.close()

    async def __aenter__(self) -> PinnedRing:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
