"""The two GET clients as the fetch tests call them: blocking, bytes into a target.

``Threads`` calls ``threaded_http.get_into`` as a GET thread does; ``OnLoop`` runs
``loop_http.LoopGets`` on one event loop (uvloop, as the worker runs, or asyncio's own).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable
from typing import Protocol, TypeVar

import uvloop

from ingest.fetch.http_answer import Answer
from ingest.fetch.loop_http import LoopGets
from ingest.fetch.threaded_http import ConnectionPool, get_into

T = TypeVar("T")


class Client(Protocol):
    """One GET client, called as the tests call it: blocking, bytes into ``target``."""

    @property
    def opened(self) -> int: ...

    def get(self, url: str, headers: dict[str, str], target: bytearray) -> Answer: ...

    def close(self) -> None: ...


class Threads:
    """``get_into`` on the calling thread, as a GET thread calls it."""

    def __init__(self, read_timeout_s: float = 2.0) -> None:
        self.pool = ConnectionPool(2.0, read_timeout_s, ssl.create_default_context())

    @property
    def opened(self) -> int:
        return self.pool.opened

    def get(self, url: str, headers: dict[str, str], target: bytearray) -> Answer:
        return get_into(self.pool, url, headers, memoryview(target))

    def close(self) -> None:
        self.pool.close()


class OnLoop:
    """One event loop (uvloop, or asyncio's own) and one ``LoopGets`` on it, for a test."""

    def __init__(self, read_timeout_s: float = 2.0, *, plain_asyncio: bool = False) -> None:
        self.pool = ConnectionPool(2.0, read_timeout_s, ssl.create_default_context())
        self.gets = LoopGets(self.pool, 16)
        factory = asyncio.new_event_loop if plain_asyncio else uvloop.new_event_loop
        self._runner = asyncio.Runner(loop_factory=factory)

    @property
    def opened(self) -> int:
        return self.gets.opened

    def run(self, work: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await work

        return self._runner.run(wrapped())

    def get(self, url: str, headers: dict[str, str], target: bytearray) -> Answer:
        return self.run(self.gets.get_into(url, headers, memoryview(target)))

    def close(self) -> None:
        self.gets.close()
        self._runner.close()
        self.pool.close()
