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
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

ALIGNMENT = 64 * 1024


class HostMemory(Protocol):
    """What the ring needs from an allocation (``gpu.memory.HostBuffer`` fits)."""

    @property
    def view(self) -> memoryview: ...

    @property
    def pinned(self) -> bool: ...

    def close(self) -> None: ...


class Slot:
    """One fixed-size region of the ring. ``view`` is writable and ``size`` bytes long."""

    __slots__ = ("_refs", "_ring", "index", "view")

    def __init__(self, ring: PinnedRing, index: int, view: memoryview) -> None:
        self._ring = ring
        self._refs = 0
        self.index = index
        self.view = view

    def retain(self) -> None:
        """Take one more reference (call on the event loop)."""
        if self._refs <= 0:
            raise RuntimeError(f"slot {self.index} retained after it was returned")
        self._refs += 1

    def release(self) -> None:
        """Drop one reference (call on the event loop); the last one frees the slot."""
        self._refs -= 1
        if self._refs == 0:
            self._ring._give_back(self)
        elif self._refs < 0:
            raise RuntimeError(f"slot {self.index} released more often than retained")

    def release_threadsafe(self) -> None:
        """Drop one reference from any thread (the device thread uses this)."""
        self._ring._loop.call_soon_threadsafe(self.release)


@dataclass(frozen=True, slots=True)
class RingStats:
    slots: int
    slot_size: int
    in_use: int
    acquired: int
    waits: int
    pinned: bool


class PinnedRing:
    """The bounded ring of host slots. Create it on the event loop; ``aclose`` frees it."""

    def __init__(self, memory: HostMemory, slot_size: int, slots: int) -> None:
        if slot_size % ALIGNMENT:
            raise ValueError(f"slot size {slot_size} is not a multiple of {ALIGNMENT}")
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
        self._acquired = 0
        self._waits = 0

    @classmethod
    async def allocate(
        cls, allocate: Callable[[int], HostMemory], slot_size: int, slots: int
    ) -> PinnedRing:
        """Allocate the ring's memory once (off the event loop) and build the ring."""
        memory = await anyio.to_thread.run_sync(allocate, slot_size * slots)
        return cls(memory, slot_size, slots)

    async def acquire(self) -> Slot:
        """A free slot with one reference; waits while the ring is full."""
        if self._available.value == 0:
            self._waits += 1
        await self._available.acquire()
        slot = self._free.popleft()
        slot._refs = 1
        self._acquired += 1
        return slot

    def _give_back(self, slot: Slot) -> None:
        self._free.append(slot)
        self._available.release()

    def stats(self) -> RingStats:
        return RingStats(
            slots=len(self._slots),
            slot_size=self.slot_size,
            in_use=len(self._slots) - len(self._free),
            acquired=self._acquired,
            waits=self._waits,
            pinned=self._memory.pinned,
        )

    async def aclose(self) -> None:
        """Free the memory. Slots still in use make this an error: it would free live data."""
        for slot in self._slots:
            slot.view.release()
        self._memory.close()

    async def __aenter__(self) -> PinnedRing:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
