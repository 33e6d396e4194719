"""keep_running: a cancellation no scope asked for runs the service again; a real one ends it."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import structlog
import structlog.testing

from ingest.ops.services import keep_running

pytestmark = pytest.mark.anyio


async def test_a_stray_cancellation_runs_the_service_again() -> None:
    runs: list[int] = []

    async def service() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # natively, as an asyncio timeout inside a library does
            await asyncio.sleep(0)

    with anyio.fail_after(5), structlog.testing.capture_logs() as logs:
        await keep_running("test", service)
    assert runs == [0, 1]
    assert [(e["event"], e["what"]) for e in logs] == [("cancelled by no scope; going on", "test")]
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # taken back: the next timeout counts right


async def test_a_real_cancellation_ends_the_service() -> None:
    runs: list[int] = []

    async def service() -> None:
        runs.append(1)
        await anyio.sleep_forever()

    with anyio.move_on_after(0.2) as scope:
        await keep_running("test", service)
    assert scope.cancelled_caught
    assert runs == [1]
