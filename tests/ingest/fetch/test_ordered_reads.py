"""ordered_reads: concurrent reads into ring slots, handed out in range order, slots accounted."""

from __future__ import annotations

import random
from functools import partial

import anyio
import pytest

from ingest.errors import SourceUnavailable
from ingest.fetch.ordered_reads import ReadInto, ordered_reads
from ingest.fetch.planning import ByteRange, split_range
from ingest.fetch.ring import PinnedRing
from ingest_gpu.memory import alloc_host

pytestmark = pytest.mark.anyio
SLOT = 64 * 1024
RANGES = split_range(0, 20 * 1000, 1000)


async def make_ring(slots: int) -> PinnedRing:
    return await PinnedRing.allocate(partial(alloc_host, pinned=False), SLOT, slots)


def fake_source(fail_at: int | None = None, seed: int = 0) -> tuple[list[int], ReadInto]:
    """A read that takes a random time and writes its range's start into the slot."""
    started: list[int] = []
    rng = random.Random(seed)

    async def read(byte_range: ByteRange, into: memoryview) -> None:
        started.append(byte_range.start)
        await anyio.sleep(rng.uniform(0, 0.01))  # finish out of order
        if byte_range.start == fail_at:
            raise SourceUnavailable("GET failed")
        into[:8] = byte_range.start.to_bytes(8, "little")

    return started, read


async def consume(
    ring: PinnedRing, read: ReadInto, ahead: int, seen: list[int], stop_after: int = -1
) -> None:
    """Take every read in order (raising after ``stop_after`` of them when >= 0)."""
    async with ordered_reads(ring, RANGES, read, ahead) as reads:
        async for slot, view in reads:
            assert len(view) == 1000
            seen.append(int.from_bytes(view[:8], "little"))
            assert ring.stats().in_use <= ring.stats().slots
            slot.release()
            if len(seen) == stop_after:
                raise ValueError("the consumer failed")


async def test_reads_come_back_in_order_and_every_slot_returns() -> None:
    async with await make_ring(6) as ring:
        started, read = fake_source()
        seen: list[int] = []
        await consume(ring, read, 4, seen)
        assert seen == [r.start for r in RANGES]
        assert sorted(started) == seen  # each range read once
        assert ring.stats().in_use == 0


async def test_an_error_is_raised_in_order_and_slots_are_released() -> None:
    async with await make_ring(6) as ring:
        _, read = fake_source(fail_at=5000, seed=1)
        seen: list[int] = []
        with pytest.raises(SourceUnavailable):
            await consume(ring, read, 4, seen)
        assert seen == [0, 1000, 2000, 3000, 4000]  # everything before the failed range
        assert ring.stats().in_use == 0  # reads started ahead gave their slots back


async def test_the_consumer_stopping_early_releases_what_it_was_not_given() -> None:
    async with await make_ring(4) as ring:
        _, read = fake_source(seed=2)
        seen: list[int] = []
        with pytest.raises(ValueError, match="consumer"):
            await consume(ring, read, 8, seen, stop_after=2)
        assert seen == [0, 1000]
        assert ring.stats().in_use == 0
