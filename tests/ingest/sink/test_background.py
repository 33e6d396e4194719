"""ingest/sink/background.py: the writers' background PUTs, bounded, failures raised by the
writer, the block's own error unchanged."""

from __future__ import annotations

import functools

import anyio
import anyio.lowlevel
import pytest

from ingest.errors import SinkError
from ingest.sink.background import BackgroundPuts

pytestmark = pytest.mark.anyio


async def test_calls_are_bounded_and_the_first_failure_is_raised_unwrapped() -> None:
    running, most, done = 0, 0, []

    async def call(n: int) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await anyio.sleep(0.005 + 0.001 * (n % 3))
        running -= 1
        if n in (4, 6):
            raise SinkError(f"part {n} refused")
        done.append(n)

    puts = BackgroundPuts(3)
    async with puts:
        for n in range(10):
            await puts.start(functools.partial(call, n))
    assert most == 3
    assert sorted(done) == [0, 1, 2, 3, 5, 7, 8, 9]
    with pytest.raises(SinkError, match="part 4 refused"):
        puts.raise_failed()
    async with puts:  # again, after it was left: the same bound
        await puts.start(functools.partial(call, 11))
    assert 11 in done


async def test_the_blocks_error_goes_on_as_it_is_and_cancels_the_calls() -> None:
    cancelled = anyio.Event()

    async def slow() -> None:
        try:
            await anyio.sleep(10)
        finally:
            cancelled.set()

    async def block() -> None:
        async with BackgroundPuts(2) as puts:
            await puts.start(slow)
            await anyio.lowlevel.checkpoint()
            raise KeyError("the writer's own")

    with pytest.raises(KeyError, match="the writer's own"):
        await block()
    assert cancelled.is_set()
