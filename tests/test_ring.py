"""PinnedRing: fixed slots, 64 KiB aligned, backpressure, reference counts, thread-safe release."""

from __future__ import annotations

import threading
from functools import partial

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from gpu.memory import alloc_host
from ingest.ring import ALIGNMENT, PinnedRing

pytestmark = pytest.mark.anyio
SLOT = 64 * 1024


async def make_ring(slots: int = 3) -> PinnedRing:
    return await PinnedRing.allocate(partial(alloc_host, pinned=False), SLOT, slots)


async def test_slots_are_aligned_distinct_and_writable() -> None:
    async with await make_ring(3) as ring:
        slots = [await ring.acquire() for _ in range(3)]
        addresses = [np.frombuffer(s.view, np.uint8).ctypes.data for s in slots]
        assert all(a % ALIGNMENT == 0 for a in addresses)
        assert len(set(addresses)) == 3
        for i, s in enumerate(slots):
            s.view[:4] = bytes([i] * 4)
        assert bytes(slots[2].view[:4]) == b"\x02" * 4
        for s in slots:
            s.release()
        assert ring.stats().in_use == 0


async def test_acquire_waits_when_full_and_resumes_on_release() -> None:
    async with await make_ring(2) as ring:
        a = await ring.acquire()
        b = await ring.acquire()
        got = []

        async def third() -> None:
            got.append(await ring.acquire())

        async with anyio.create_task_group() as group:
            group.start_soon(third)
            await anyio.sleep(0.05)
            assert got == []  # backpressure: the ring is full
            a.release()
        assert len(got) == 1
        assert ring.stats().waits == 1
        b.release()
        got[0].release()


async def test_slot_returns_only_after_the_last_reference() -> None:
    async with await make_ring(2) as ring:
        slot = await ring.acquire()
        slot.retain()  # e.g. the device stage
        slot.release()
        assert ring.stats().in_use == 1
        # the device thread lets go from its own thread
        thread = threading.Thread(target=slot.release_threadsafe)
        thread.start()
        thread.join()
        await anyio.lowlevel.checkpoint()  # the loop runs the release the thread scheduled
        assert ring.stats().in_use == 0


async def test_over_release_is_an_error() -> None:
    async with await make_ring(2) as ring:
        slot = await ring.acquire()
        slot.release()
        with pytest.raises(RuntimeError):
            slot.release()
