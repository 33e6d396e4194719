"""PinnedRing: fixed slots, 64 KiB aligned, backpressure, reference counts, thread-safe release,
and small slots cut from whole ones."""

from __future__ import annotations

import threading
from functools import partial

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from ingest.fetch.ring import ALIGNMENT, PinnedRing
from ingest_gpu.memory import alloc_host

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


async def make_slab_ring(slots: int = 2) -> PinnedRing:
    """Slots of 4 x 64 KiB, so a slab holds 4 small slots."""
    allocate = partial(alloc_host, pinned=False)
    memory = await anyio.to_thread.run_sync(allocate, 4 * SLOT * slots)
    return PinnedRing(memory, 4 * SLOT, slots, small_size=SLOT)


async def test_small_slots_share_one_slot_until_it_is_full() -> None:
    async with await make_slab_ring(2) as ring:
        smalls = [await ring.acquire(SLOT) for _ in range(4)]
        assert ring.stats().in_use == 1
        assert ring.stats().small_in_use == 4
        assert all(len(s.view) == SLOT for s in smalls)
        addresses = {np.frombuffer(s.view, np.uint8).ctypes.data for s in smalls}
        assert len(addresses) == 4
        assert all(a % ALIGNMENT == 0 for a in addresses)
        for i, s in enumerate(smalls):
            s.view[:2] = bytes([i, i])
        assert [bytes(s.view[:2]) for s in smalls] == [bytes([i, i]) for i in range(4)]
        fifth = await ring.acquire(1)  # the first slab is full: a second slot is cut
        assert ring.stats().in_use == 2
        for s in smalls:
            s.release()
        assert ring.stats().in_use == 1  # the first slab went back with its last small slot
        fifth.release()
        assert ring.stats().in_use == 0
        assert ring.stats().small_in_use == 0
        again = await ring.acquire(SLOT)
        assert again is smalls[0]  # a slab's small slots are cut once, then reused
        again.release()


async def test_a_larger_request_gets_a_whole_slot() -> None:
    async with await make_slab_ring(2) as ring:
        whole = await ring.acquire(SLOT + 1)
        assert len(whole.view) == 4 * SLOT
        assert ring.stats().small_in_use == 0
        whole.release()


async def test_small_slots_wait_for_a_whole_slot_when_the_ring_is_full() -> None:
    async with await make_slab_ring(1) as ring:
        smalls = [await ring.acquire(SLOT) for _ in range(4)]
        got = []

        async def another() -> None:
            got.append(await ring.acquire(SLOT))

        async with anyio.create_task_group() as group:
            group.start_soon(another)
            await anyio.sleep(0.05)
            assert got == []  # backpressure: the only slot is a full slab
            thread = threading.Thread(target=smalls[2].release_threadsafe)
            thread.start()
            thread.join()
        assert got[0] is smalls[2]  # the freed small slot, handed out again
        for s in [smalls[0], smalls[1], smalls[3], got[0]]:
            s.release()
        assert ring.stats().in_use == 0


async def test_no_small_slots_when_a_slot_cannot_hold_two() -> None:
    async with await make_ring(2) as ring:  # 64 KiB slots, small slots of 1 MiB
        slot = await ring.acquire(10)
        assert len(slot.view) == SLOT
        assert ring.stats().small_in_use == 0
        slot.release()
