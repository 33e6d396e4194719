"""Small GETs on the event loop: those that fit a small slot (a slice, a header probe).

A GET on a thread (``threaded_http``) hands the GIL back and forth with the
event loop at every step (the queue, the send, the head, the body, the
result), and each hand-off costs both threads a wake-up. For a CT slice the
hand-offs, not the bytes, were most of the GET's CPU. Here the request is
written and its answer read by the event loop's own transport (uvloop's, in
C) into a protocol that gives the transport the caller's memory to fill
(``asyncio.BufferedProtocol``): the head into a buffer of its own, the body
straight into the ring slot. Python runs once per socket read, not once per
hand-off, and nothing runs on another thread.

Only GETs of at most ``LOOP_GET_BYTES`` come here (a body that large is read
in a few dozen socket reads), and only to endpoints reached directly (``http``
or ``https``); a GET through a proxy (``HTTPS_PROXY``, ``HTTP_PROXY``) and
every larger one stay on the GET threads. The answer is read by the same
rules (``http_answer``) and fails with the same errors: ``HttpStatusError``,
``BodyCut``, ``NoAnswer``, ``ConnectionError``, ``TimeoutError`` (no byte for
the read timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import cast
from urllib.parse import SplitResult, urlsplit

from ingest import metrics
from ingest.fetch.http_answer import (
    HEAD_LIMIT,
    Answer,
    Body,
    BodyCut,
    Head,
    HttpStatusError,
    NoAnswer,
    data_body,
    error_body_done,
    error_body_wanted,
    error_code,
    head_in,
    request_head,
)
from ingest.fetch.ring import SMALL_SLOT_SIZE
from ingest.fetch.threaded_http import ConnectionPool, host_header

LOOP_GET_BYTES = SMALL_SLOT_SIZE  # a 512x512 16-bit slice and its header
_SCRATCH = 64  # what an idle connection is given to read into (anything read there is wrong)
_FETCH_SECONDS = metrics.STAGE_SECONDS.labels("fetch")  # as the GET threads' calls are timed


class LoopGets:
    """GETs on the event loop over keep-alive connections of their own, per endpoint.

    ``pool`` (the GET threads' pool) says which endpoints go through a proxy,
    and gives the TLS context and the timeouts. At most ``limit`` GETs are under
    way at once (the others wait their turn), so the connections to an endpoint
    stay as many as the GET threads'. Use it on one event loop only.
    """

    def __init__(self, pool: ConnectionPool, limit: int) -> None:
        self._pool = pool
        self._turns = asyncio.Semaphore(limit)
        self._idle: defaultdict[tuple[str, str], list[_Connection]] = defaultdict(list)
        self._open: set[_Connection] = set()
        self._closed = False
        self.opened = 0  # connections made, over its life

    def serves(self, scheme: str, netloc: str, length: int) -> bool:
        """Whether a GET of ``length`` bytes from ``scheme://netloc`` is made here."""
        return (
            length <= LOOP_GET_BYTES
            and scheme in ("http", "https")
            and self._pool.proxy(scheme, netloc) is None
        )

    async def get_into(self, url: str, headers: dict[str, str], target: memoryview) -> Answer:
        """GET ``url`` and write up to ``len(target)`` body bytes into ``target``.

        A reused connection that ends before any answer (the server closed it as
        the request went out) is replaced by a new one and the request sent once
        more, as ``threaded_http`` does. Cancelled, the connection is closed at once
        and nothing is written into ``target`` after this returns.

        Raises:
            HttpStatusError, BodyCut, NoAnswer, ConnectionError, TimeoutError, OSError
        """
        parts = urlsplit(url)
        where = (parts.scheme, parts.netloc)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        request = request_head("GET", path, host_header(parts), headers)
        async with self._turns:
            return await self._get(where, parts, request, target)

    async def _get(
        self, where: tuple[str, str], parts: SplitResult, request: bytes, target: memoryview
    ) -> Answer:
        metrics.RANGES_IN_FLIGHT.inc()
        started = time.perf_counter()
        try:
            conn = self._take(where)
            if conn is not None:
                try:
                    return await self._exchange(where, conn, request, target)
                except NoAnswer:
                    pass
            port = parts.port or (443 if parts.scheme == "https" else 80)
            conn = await self._connect(where, parts.hostname or "", port)
            return await self._exchange(where, conn, request, target)
        finally:
            _FETCH_SECONDS.observe(time.perf_counter() - started)
            metrics.RANGES_IN_FLIGHT.dec()

    async def _exchange(
        self, where: tuple[str, str], conn: _Connection, request: bytes, target: memoryview
    ) -> Answer:
        try:
            answer, reusable = await conn.exchange(request, target, self._pool.read_timeout_s)
        except BaseException:
            self._drop(conn)
            raise
        if reusable and not self._closed:
            self._idle[where].append(conn)
        else:
            self._drop(conn)
        return answer

    def _take(self, where: tuple[str, str]) -> _Connection | None:
        if self._closed:
            raise RuntimeError("the event loop's GETs are closed")
        idle = self._idle[where]
        while idle:
            conn = idle.pop()
            if conn.usable:  # the server may have closed it while it sat here
                return conn
            self._open.discard(conn)
        return None

    async def _connect(self, where: tuple[str, str], hostname: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._pool.ssl_context if where[0] == "https" else None
        self.opened += 1
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                _Connection, hostname, port, ssl=tls, server_hostname=hostname if tls else None
            ),
            self._pool.connect_timeout_s,
        )
        if self._closed:
            conn.close()
            raise RuntimeError("the event loop's GETs are closed")
        self._open.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def close(self) -> None:
        """Close every connection; a GET under way ends with ``NoAnswer`` or ``BodyCut``."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._open):
            conn.close()
        self._open.clear()


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection: one request at a time, its answer read into the caller's
    memory. The states: idle (no request), reading the head, the body, an error's body."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._head_buffer = bytearray(HEAD_LIMIT)
        self._head_view = memoryview(self._head_buffer)
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._waiter: asyncio.Future[tuple[Answer, bool]] | None = None
        self._target = self._scratch
        self._filled = 0  # head bytes, then body bytes, received
        self._head: Head | None = None
        self._body: Body | None = None
        self._error = bytearray()
        self._moved = 0.0  # loop time of the last bytes received
        self._timer: asyncio.TimerHandle | None = None  # the read timeout's next check
        self.usable = False

    # -- the caller's side

    async def exchange(
        self, request: bytes, target: memoryview, read_timeout_s: float
    ) -> tuple[Answer, bool]:
        """Send ``request``; the answer, and whether the connection may serve another."""
        if not self.usable or self._transport is None or self._waiter is not None:
            raise NoAnswer("the connection closed while it was idle")
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._target, self._filled, self._head, self._body = target, 0, None, None
        self._moved = loop.time()
        self._transport.write(request)
        self._timer = loop.call_later(read_timeout_s, self._check_moved, read_timeout_s)
        try:
            return await self._waiter
        finally:
            self._timer.cancel()
            self._waiter = None
            self._target = self._scratch  # never written after this returns

    def close(self) -> None:
        self.usable = False
        if self._transport is not None:
            self._transport.abort()

    def _check_moved(self, read_timeout_s: float) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        still = loop.time() - self._moved
        if still < read_timeout_s:
            self._timer = loop.call_later(read_timeout_s - still, self._check_moved, read_timeout_s)
            return
        self._fail(TimeoutError(f"no answer bytes for {read_timeout_s:g} s"))

    def _fail(self, error: BaseException) -> None:
        self.usable = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self._transport is not None:
            self._transport.abort()

    def _finish(self, answer: Answer, reusable: bool) -> None:
        waiter = self._waiter
        self._target = self._scratch
        self.usable = reusable
        if waiter is not None and not waiter.done():
            waiter.set_result((answer, reusable))

    # -- the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.usable = True

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._waiter is None or self._waiter.done():
            return self._scratch
        if self._head is None:
            return self._head_view[self._filled :]
        if self._body is None:  # an error answer's body: the head's buffer is free
            return self._head_view
        return self._target[self._filled : self._body.receive]

    def buffer_updated(self, nbytes: int) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # bytes nobody asked for: not a connection to reuse
            self.close()
            return
        self._moved = asyncio.get_running_loop().time()
        try:
            if self._head is None:
                self._on_head_bytes(nbytes)
            elif self._body is None:
                self._on_error_bytes(self._head_view[:nbytes])
            else:
                self._on_body_bytes(nbytes)
        except Exception as exc:  # the answer's failure, for the caller
            self._fail(exc)

    def _on_head_bytes(self, nbytes: int) -> None:
        head, self._filled = head_in(self._head_buffer, self._filled + nbytes)
        if head is None:
            return
        self._head = head
        if head.status not in (200, 206):
            self._on_error_bytes(head.early)
            return
        body = self._body = data_body(head, len(self._target))
        early = head.early[: body.receive]
        self._target[: len(early)] = early
        self._filled = len(early)
        self._on_body_bytes(0)

    def _on_body_bytes(self, nbytes: int) -> None:
        body, head = self._body, self._head
        assert body is not None
        assert head is not None
        self._filled += nbytes
        if self._filled < body.receive:
            return
        # the body's bytes beyond ``receive`` (a 200 longer than the target) are dropped
        reusable = head.keep_alive and len(head.early) <= body.receive == body.length
        self._finish(body.answer(self._filled), reusable)

    def _on_error_bytes(self, data: memoryview) -> None:
        head = self._head
        assert head is not None
        self._error += data[: error_body_wanted(head) - len(self._error)]
        if error_body_done(head, self._error):
            self._fail_status()

    def _fail_status(self) -> None:
        head = self._head
        assert head is not None
        code = error_code(bytes(self._error))
        self._error = bytearray()
        self._fail(HttpStatusError(head.status, code, f"S3 answered {head.status} {code}".rstrip()))

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost says what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        cause = type(exc).__name__ if exc is not None else "end of stream"
        if self._head is None:
            if self._filled:
                reset = "the server closed the connection inside the answer"
                self._fail(ConnectionResetError(reset))
            else:
                self._fail(NoAnswer(f"the connection ended before an answer ({cause})"))
        elif self._body is None:
            self._fail_status()  # the error's status is news; its code a nicety
        else:
            self._fail(BodyCut(self._filled, self._body.expected, cause))
