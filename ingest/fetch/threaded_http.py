"""S3 data requests on plain keep-alive connections, run in worker threads.

Ranged GETs read into caller memory (``get_into``); PUTs send from it
(``put_from``); the sink's small requests (listings, member records, deletes)
read their answer whole (``request_whole``).

Why the bytes do not go through aiobotocore: every body byte read or written
through aiohttp passes the one event-loop thread, so one core bounds the rate,
and is copied into or out of ``bytes``. Here a worker thread receives the body
straight into the ring slot, or hands the output arrays' own memory to
``sendall``: the kernel does the only copy, the GIL is released meanwhile, and
there is one thread per request in flight, so transfers use every core.

A GET writes its request and reads its answer on the socket itself
(``http_answer.py`` says why), the whole body in one ``recv(MSG_WAITALL)`` on
plain connections.
PUTs, fewer and larger, use ``http.client``. ``http.client.HTTPConnection``
also makes the connections (TLS included) that the pool keeps.

Requests are presigned (SigV4 query authentication, in ``ingest/fetch/s3.py`` and
``ingest/sink/output.py``), so a thread needs nothing from the event loop.
Extra headers (``Range``, ``If-Match``) are sent unsigned, which S3 allows.

Everything here is blocking and thread-safe: ``ConnectionPool`` hands each
thread its own keep-alive connection, and ``Transfer.abort`` (from any
thread) shuts the socket of a request in progress so a cancelled read ends at
once instead of at its timeout. Failures leave as ``HttpStatusError`` (the
server answered an error status, or a data answer S3 would not send),
``BodyCut`` (the body ended or broke before its length; both defined in
``http_answer.py``) or the socket's own ``OSError``/``TimeoutError``;
``ingest/fetch/s3.py`` maps them onto ``ingest.errors``.

Where ``HTTPS_PROXY``/``HTTP_PROXY`` name a proxy for the endpoint (and
``NO_PROXY`` does not exempt it), connections go through it (``proxy.py``):
a ``CONNECT`` tunnel for ``https``, the absolute URL for ``http``.

Servers close keep-alive connections that sit idle (SeaweedFS after 120 s), so
after a quiet spell the pool holds as many dead connections as there were
requests in flight before it, more than the retry policy's attempts. A dead
connection is not a failure of the request: the pool drops the idle ones the
server has hung up on (the socket reads as ready: end of stream) before
handing one out, and a request whose reused connection ends before any
answer (the server hung up as it went out) is sent once more on a new
connection, outside the retry policy's count.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import select
import socket
import ssl
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import SplitResult, urlsplit

from ingest import metrics
from ingest.fetch.http_answer import (
    ERROR_BODY_LIMIT,
    RECV_WAITALL,
    Answer,
    BodyCut,
    HttpStatusError,
    NoAnswer,
    error_code,
    read_answer,
    request_head,
)
from ingest.fetch.proxy import Proxy, proxy_for

T = TypeVar("T")


def ca_bundle(configured: Path | None) -> str | None:
    """The CA file every S3 connection verifies against: ``configured`` (``s3_ca_bundle``),
    else ``AWS_CA_BUNDLE``, else (None) the system's. Verification is never turned off."""
    if configured is not None:
        return str(configured)
    return os.environ.get("AWS_CA_BUNDLE") or None


class Transfer:
    """One GET, started on a thread and abortable from any other.

    ``begin`` (on the GET's thread) and ``abort`` (from the event loop) agree
    under a lock: a GET aborted before it began never starts, and one that
    began has its socket shut down, so its ``readinto`` returns at once.
    """

    __slots__ = ("_aborted", "_began", "_lock", "_sock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False
        self._began = False

    def begin(self) -> bool:
        """Mark the GET as running; False if it was aborted first (then it must not run)."""
        with self._lock:
            self._began = not self._aborted
            return self._began

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            aborted = self._aborted
        if aborted and sock is not None:
            _shutdown(sock)

    def abort(self) -> bool:
        """Stop the GET; True if it had begun (its thread may still be finishing)."""
        with self._lock:
            self._aborted = True
            sock = self._sock
            began = self._began
        if sock is not None:
            _shutdown(sock)
        return began

    @property
    def aborted(self) -> bool:
        return self._aborted


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


class ConnectionPool:
    """Idle keep-alive connections per (scheme, host:port); each serves one GET at a time."""

    def __init__(
        self, connect_timeout_s: float, read_timeout_s: float, ssl_context: ssl.SSLContext
    ) -> None:
        self._proxies: dict[tuple[str, str], Proxy | None] = {}  # the environment's, once
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._idle: defaultdict[tuple[str, str], list[http.client.HTTPConnection]] = defaultdict(
            list
        )
        self._closed = False
        self.opened = 0  # connections made, over the pool's life (reuse shows as few)
        self.dropped = 0  # idle connections the server had closed, found when taken

    def take(self, scheme: str, netloc: str, *, fresh: bool = False) -> http.client.HTTPConnection:
        """An idle connection the server has not closed, else a new (unconnected) one;
        with ``fresh`` always a new one. A reused connection is the one with a socket."""
        while not fresh:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the connection pool is closed")
                idle = self._idle[(scheme, netloc)]
                if not idle:
                    break
                conn = idle.pop()
            if not _hung_up(conn):
                return conn
            conn.close()
            with self._lock:
                self.dropped += 1
        with self._lock:
            if self._closed:
                raise RuntimeError("the connection pool is closed")
            self.opened += 1
        proxy = self.proxy(scheme, netloc)
        if scheme == "https":
            if proxy is None:
                return http.client.HTTPSConnection(
                    netloc, timeout=self._connect_timeout, context=self._ssl
                )
            tunnelled = http.client.HTTPSConnection(
                proxy.address, timeout=self._connect_timeout, context=self._ssl
            )
            tunnelled.set_tunnel(netloc, headers=proxy.headers())  # TLS to S3 inside it
            return tunnelled
        if scheme != "http":
            raise ValueError(f"unsupported URL scheme {scheme!r}")
        return http.client.HTTPConnection(
            proxy.address if proxy else netloc, timeout=self._connect_timeout
        )

    def proxy(self, scheme: str, netloc: str) -> Proxy | None:
        """The proxy connections to ``scheme://netloc`` go through (None: direct)."""
        with self._lock:
            if (scheme, netloc) not in self._proxies:
                self._proxies[(scheme, netloc)] = proxy_for(scheme, netloc)
            return self._proxies[(scheme, netloc)]

    def give(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle[(scheme, netloc)].append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()

    @property
    def read_timeout_s(self) -> float:
        return self._read_timeout

    @property
    def connect_timeout_s(self) -> float:
        return self._connect_timeout

    @property
    def ssl_context(self) -> ssl.SSLContext:
        return self._ssl


def _hung_up(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection is unusable: no socket, or a socket that reads as ready.

    An idle keep-alive connection has nothing to read until it sends a request;
    ready means the server closed it (end of stream, or a reset) or sent
    something unasked, either way not a connection to send a request on. One
    ``poll`` with no wait, as urllib3's ``is_connection_dropped`` does.
    """
    sock = conn.sock
    if sock is None:
        return True
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed under us: a descriptor of -1
        return True


@metrics.timed("fetch", metrics.RANGES_IN_FLIGHT)
def get_into(
    pool: ConnectionPool,
    url: str,
    headers: dict[str, str],
    target: memoryview,
    transfer: Transfer | None = None,
) -> Answer:
    """GET ``url`` and write up to ``len(target)`` body bytes into ``target`` (blocking).

    A 206 must carry the whole requested length (``len(target)`` or the
    object's end); a 200 (a server that ignored ``Range``) is read up to
    ``len(target)`` and the rest of it dropped with the connection.

    The request is written and its answer read on the connection's socket
    (``http_answer.py``), not through ``http.client``'s response objects.

    Raises:
        HttpStatusError: any status but 200/206.
        BodyCut: the body ended or broke before its length.
        OSError, TimeoutError: connecting or sending failed, or a read timed out
            (``NoAnswer``: a new connection ended before answering).
    """

    def exchange(lease: _Lease) -> Answer:
        sock = lease.conn.sock
        request = request_head("GET", lease.path, lease.host, {**headers, **lease.extra})
        try:
            sock.sendall(request)
        except ConnectionError as exc:
            raise NoAnswer(f"the connection broke while sending: {exc}") from exc
        answer, lease.reusable = read_answer(sock, target, waitall=lease.plain and RECV_WAITALL)
        return answer

    return _exchange(pool, url, transfer, exchange)


@metrics.timed("sink", metrics.PUTS_IN_FLIGHT)
def put_from(
    pool: ConnectionPool,
    url: str,
    headers: dict[str, str],
    body: list[memoryview],
    transfer: Transfer | None = None,
) -> str:
    """PUT the concatenation of ``body`` to ``url`` without joining it (blocking); the ETag.

    Raises:
        HttpStatusError: any status but 200.
        OSError, TimeoutError: connecting, sending or reading the answer failed
            (``NoAnswer``: a new connection ended before answering).
    """

    def exchange(lease: _Lease) -> str:
        length = str(sum(map(len, body)))
        response = _sent(lease, "PUT", {**headers, "Content-Length": length}, body)
        answer = response.read(ERROR_BODY_LIMIT)
        if response.status != 200:
            code = error_code(answer)
            raise HttpStatusError(response.status, code, f"S3 answered {response.status} {code}")
        lease.reusable = response.isclosed()
        return (response.getheader("ETag") or "").strip()

    return _exchange(pool, url, transfer, exchange)


def request_whole(
    pool: ConnectionPool,
    method: str,
    url: str,
    headers: dict[str, str],
    ok: tuple[int, ...],
    transfer: Transfer | None = None,
) -> bytes:
    """A request without a body (the sink's listings, record reads and deletes) whose whole
    answer body is read into ``bytes`` (blocking).

    Raises:
        HttpStatusError: a status not in ``ok``.
        OSError, TimeoutError: connecting, sending or reading the answer failed
            (``NoAnswer``: a new connection ended before answering).
    """

    def exchange(lease: _Lease) -> bytes:
        response = _sent(lease, method, headers, [])
        if response.status not in ok:
            code = error_code(response.read(ERROR_BODY_LIMIT))
            raise HttpStatusError(response.status, code, f"S3 answered {response.status} {code}")
        try:
            body = response.read()
        except http.client.IncompleteRead as exc:
            expected = len(exc.partial) + (exc.expected or 0)
            raise BodyCut(len(exc.partial), expected, "the connection ended") from exc
        lease.reusable = response.isclosed()
        return body

    return _exchange(pool, url, transfer, exchange)


def _sent(
    lease: _Lease, method: str, headers: dict[str, str], body: list[memoryview]
) -> http.client.HTTPResponse:
    """Send one request (``body`` as it is, never joined) through ``http.client``; its answer.

    Raises:
        NoAnswer: the connection ended before an answer (``_exchange`` may send it again).
        OSError, TimeoutError: connecting, sending or reading the status line failed.
    """
    conn = lease.conn
    try:
        conn.putrequest(method, lease.path, skip_accept_encoding=True)
        for name, value in {**headers, **lease.extra}.items():
            conn.putheader(name, value)
        conn.endheaders()
        for piece in body:
            conn.send(piece)
        return conn.getresponse()  # RemoteDisconnected: closed without a status line
    except ConnectionError as exc:
        raise NoAnswer(f"the connection ended before an answer: {exc}") from exc


def _exchange(
    pool: ConnectionPool, url: str, transfer: Transfer | None, exchange: Callable[[_Lease], T]
) -> T:
    """``exchange`` on a pooled connection; if that connection was reused and ended before
    any answer, once more on a new one.

    The pool's check (``_hung_up``) misses a server that closes the idle connection
    while the request is on its way; the request then never reached it, so sending
    it again is not a retry of a failed request and is not counted as one. Both our
    requests are idempotent (a GET; a PUT of the same bytes to the same key or part).
    A new connection that ends before answering is a failure like any other.
    """
    transfer = transfer or Transfer()
    with _Lease(pool, url, transfer) as lease:
        try:
            return exchange(lease)
        except NoAnswer:
            if not lease.reused or transfer.aborted:
                raise
    with _Lease(pool, url, transfer, fresh=True) as lease:
        return exchange(lease)


def host_header(parts: SplitResult) -> str:
    """The ``Host`` a request to ``parts`` carries: the port only where it is not the
    scheme's own, an IPv6 address in brackets."""
    default_port = {"http": 80, "https": 443}.get(parts.scheme)
    host = parts.hostname or "" if parts.port in (None, default_port) else parts.netloc
    if ":" in host and not host.startswith("["):  # an IPv6 address
        host = f"[{host}]"
    return host


class _Lease:
    """One request's connection from the pool: connected, timed out, abortable.

    It goes back to the pool on exit only if the request set ``reusable`` (its
    answer was read to the end); otherwise it is closed.
    """

    def __init__(
        self, pool: ConnectionPool, url: str, transfer: Transfer, *, fresh: bool = False
    ) -> None:
        parts = urlsplit(url)
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._pool = pool
        self._where = (parts.scheme, parts.netloc)
        self._transfer = transfer
        self.host = host_header(parts)
        self.extra: dict[str, str] = {}  # headers for a forwarding proxy
        proxy = pool.proxy(*self._where)
        if proxy is not None and parts.scheme == "http":  # forwarded: the absolute URL
            self.path = f"http://{parts.netloc}{self.path}"
            self.extra = proxy.headers()
        self.conn = pool.take(*self._where, fresh=fresh)
        self.reused = self.conn.sock is not None  # connected before: it sat in the pool
        self.plain = parts.scheme == "http"  # not TLS: MSG_WAITALL may be used
        self.reusable = False

    def __enter__(self) -> _Lease:
        try:
            self._connect()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _connect(self) -> None:
        if self.conn.sock is None:
            self.conn.connect()
        self.conn.sock.settimeout(self._pool.read_timeout_s)
        self._transfer.attach(self.conn.sock)
        if self._transfer.aborted:
            raise OSError("the request was aborted")

    def __exit__(self, *exc_info: object) -> None:
        self._transfer.attach(None)
        if self.reusable:
            self._pool.give(*self._where, self.conn)
        else:
            self.conn.close()
