"""The references a streamed object's frames hold on ring slots (``ingest.pipeline.streamed``):
frames split out as views of a slot keep it out of the ring until their group is done
with them, and nothing is left held when the object ends, however it ends."""

from __future__ import annotations

from collections import Counter
from functools import partial

import anyio
import anyio.lowlevel
import pytest

from gpu.memory import alloc_host
from gpu.thread import ChunkResult
from ingest.fetch.ring import PinnedRing
from ingest.pipeline.streamed import _device_hold, _SlotRefs

pytestmark = pytest.mark.anyio


async def make_ring(slots: int = 2) -> PinnedRing:
    return await PinnedRing.allocate(partial(alloc_host, pinned=False), 64 * 1024, slots)


async def test_frames_keep_their_slot_until_their_steps_end() -> None:
    async with await make_ring() as ring:
        slot = await ring.acquire()
        refs = _SlotRefs()
        refs.take(slot, 3)  # three frames are views of it
        slot.release()  # the reader is done with it
        assert ring.stats().in_use == 1

        async def fails() -> ChunkResult:
            raise RuntimeError("the step failed")

        with pytest.raises(RuntimeError):
            await refs.holding(Counter({slot: 2}), fails)()
        assert ring.stats().in_use == 1  # one frame still pending
        refs.give_back_all()
        assert ring.stats().in_use == 0
        refs.give_back_all()  # nothing twice
        refs.give_back(Counter({slot: 1}))
        assert ring.stats().in_use == 0


async def test_a_step_never_started_gives_back_at_the_end() -> None:
    async with await make_ring() as ring:
        slot = await ring.acquire()
        refs = _SlotRefs()
        refs.take(slot, 1)
        refs.take(slot, 0)
        slot.release()
        step = refs.holding(Counter({slot: 1}), fails_if_run)
        del step  # cancelled before it ran
        assert ring.stats().in_use == 1
        refs.give_back_all()
        assert ring.stats().in_use == 0


async def fails_if_run() -> ChunkResult:
    raise AssertionError("not to be run")


async def test_the_device_job_holds_its_slots_until_the_device_thread_lets_go() -> None:
    async with await make_ring() as ring:
        first, second = await ring.acquire(), await ring.acquire()
        release = _device_hold([first, second])()
        first.release()
        second.release()
        assert ring.stats().in_use == 2
        await anyio.to_thread.run_sync(release)  # as the device thread's on_consumed does
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        assert ring.stats().in_use == 0
