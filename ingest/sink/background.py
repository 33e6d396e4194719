"""The PUTs one output writer runs in the background while it takes more values.

A writer (``ingest.sink.output.ArrayWriter``'s parts, ``ingest.sink.zarr_writer``'s
chunks) starts each PUT as soon as its bytes are there and goes on taking values.
``BackgroundPuts`` keeps at most ``limit`` of them under way, so what they hold is
the writer's memory bound whatever the object's size, and keeps the first that
fails, which the writer raises in its own task (``raise_failed``), unwrapped, at
its next write or at its end: the caller sees a ``SinkError``, never a group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio
from anyio.abc import TaskGroup


class BackgroundPuts:
    """At most ``limit`` calls under way in the background of one writer; an async context
    manager whose exit waits for them (``start`` only inside it). It may be entered again
    after it is left."""

    def __init__(self, limit: int) -> None:
        self._limiter = anyio.Semaphore(limit)
        self._group: TaskGroup | None = None
        self._error: Exception | None = None  # the first call that failed

    async def __aenter__(self) -> BackgroundPuts:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Wait for the calls under way; when the block failed, cancel them first, and its
        own error goes on as it is, not grouped. A failed call is not raised here."""
        assert self._group is not None
        group, self._group = self._group, None
        if exc is not None:
            group.cancel_scope.cancel()
        try:
            await group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup:
            if exc is not None:
                return None
            raise
        return None

    async def start(self, call: Callable[[], Awaitable[object]]) -> None:
        """Start ``call`` once fewer than ``limit`` are under way (waiting for one to end)."""
        await self._limiter.acquire()
        assert self._group is not None, "start a call inside the async with block"
        self._group.start_soon(self._run, call)

    def raise_failed(self) -> None:
        """Raise the first call's error, if one failed."""
        if self._error is not None:
            raise self._error

    async def _run(self, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
        except Exception as exc:  # raised by ``raise_failed`` in the writer's task
            self._error = self._error or exc
        finally:
            self._limiter.release()
