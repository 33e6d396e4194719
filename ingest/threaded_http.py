"""S3 data requests on plain ``http.client`` connections, run in worker threads.

Ranged GETs read into caller memory (``get_into``); PUTs send from it
(``put_from``). Why the bytes do not go through aiobotocore: every body byte
read or written through aiohttp passes the one event-loop thread (about
1 GB/s per core, measured; docs/benchmarks.md) and is copied into or out of
``bytes``. Here a worker thread reads the socket with ``readinto`` straight
into the ring slot, or hands the output arrays' own memory to ``sendall``:
the kernel does the only copy, the GIL is released meanwhile, and there is
one thread per request in flight, so transfers use every core.

Requests are presigned (SigV4 query authentication, by botocore in
``fetch.py`` and ``sink.py``), so a thread needs nothing from the event loop.
Extra headers (``Range``, ``If-Match``) are sent unsigned, which S3 allows.

Everything here is blocking and thread-safe: ``ConnectionPool`` hands each
thread its own keep-alive connection, and ``Transfer.abort`` (from any
thread) shuts the socket of a request in progress so a cancelled read ends at
once instead of at its timeout. Failures leave as ``HttpStatusError`` (the
server answered an error status), ``BodyCut`` (the body ended or broke
before its length) or the socket's own ``OSError``/``TimeoutError``;
``fetch.py`` maps them onto ``ingest.errors``.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import ssl
import struct
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from urllib.parse import urlsplit

ERROR_BODY_LIMIT = 64 * 1024
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
# Where recv(MSG_WAITALL) and SO_RCVTIMEO behave as _read_socket needs; elsewhere readinto.
_RECV_WAITALL = sys.platform == "linux" and hasattr(socket, "MSG_WAITALL")


class HttpStatusError(Exception):
    """The server answered ``status`` (not 200/206); ``code`` is S3's error code, if any."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class BodyCut(Exception):
    """The body ended or broke after ``filled`` of ``expected`` bytes."""

    def __init__(self, filled: int, expected: int, cause: str) -> None:
        super().__init__(f"body ended after {filled} of {expected} bytes ({cause})")
        self.filled = filled
        self.expected = expected


@dataclass(frozen=True, slots=True)
class Answer:
    """What a GET learned: bytes written, and the object's size, ETag and version."""

    status: int
    filled: int
    start: int  # first byte of the object in the answer (0 for a 200)
    total: int | None  # the object's size, from Content-Range (206) or Content-Length (200)
    etag: str  # without quotes
    version_id: str | None


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
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._idle: defaultdict[tuple[str, str], list[http.client.HTTPConnection]] = defaultdict(
            list
        )
        self._closed = False
        self.opened = 0  # connections made, over the pool's life (reuse shows as few)

    def take(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        with self._lock:
            if self._closed:
                raise RuntimeError("the connection pool is closed")
            idle = self._idle[(scheme, netloc)]
            if idle:
                return idle.pop()
            self.opened += 1
        if scheme == "https":
            return http.client.HTTPSConnection(
                netloc, timeout=self._connect_timeout, context=self._ssl
            )
        if scheme != "http":
            raise ValueError(f"unsupported URL scheme {scheme!r}")
        return http.client.HTTPConnection(netloc, timeout=self._connect_timeout)

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

    Raises:
        HttpStatusError: any status but 200/206.
        BodyCut: the body ended or broke before its length.
        OSError, TimeoutError: connecting or sending failed, or a read timed out.
    """
    with _Lease(pool, url, transfer) as lease:
        lease.conn.request("GET", lease.path, headers=headers)
        sock = lease.conn.sock if _RECV_WAITALL and lease.plain else None
        answer, lease.reusable = _read_body(lease.conn.getresponse(), target, sock)
        return answer


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
        OSError, TimeoutError: connecting, sending or reading the answer failed.
    """
    with _Lease(pool, url, transfer) as lease:
        conn = lease.conn
        conn.putrequest("PUT", lease.path, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Length": str(sum(map(len, body)))}.items():
            conn.putheader(name, value)
        conn.endheaders()
        for piece in body:
            conn.send(piece)
        response = conn.getresponse()
        answer = response.read(ERROR_BODY_LIMIT)
        if response.status != 200:
            match = _CODE.search(answer)
            code = match.group(1).decode("ascii", "replace") if match else ""
            raise HttpStatusError(response.status, code, f"S3 answered {response.status} {code}")
        lease.reusable = response.isclosed()
        return (response.getheader("ETag") or "").strip()


class _Lease:
    """One request's connection from the pool: connected, timed out, abortable.

    It goes back to the pool on exit only if the request set ``reusable`` (its
    answer was read to the end); otherwise it is closed.
    """

    def __init__(self, pool: ConnectionPool, url: str, transfer: Transfer | None) -> None:
        parts = urlsplit(url)
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._pool = pool
        self._where = (parts.scheme, parts.netloc)
        self._transfer = transfer or Transfer()
        self.conn = pool.take(*self._where)
        self.plain = parts.scheme == "http"  # not TLS: the socket may be read directly
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


def _read_body(
    response: http.client.HTTPResponse, target: memoryview, sock: socket.socket | None
) -> tuple[Answer, bool]:
    status = response.status
    if status not in (200, 206):
        body = response.read(ERROR_BODY_LIMIT)
        match = _CODE.search(body)
        code = match.group(1).decode("ascii", "replace") if match else ""
        raise HttpStatusError(status, code, f"S3 answered {status} {code}".rstrip())
    etag = (response.getheader("ETag") or "").strip().strip('"')
    version_id = response.getheader("x-amz-version-id")
    start, total = 0, None
    if status == 206:
        start, end, total = _content_range(response.getheader("Content-Range"))
        expected = end + 1 - start
        if expected > len(target):
            raise HttpStatusError(206, "", f"answered more than asked: {expected} bytes")
    else:
        length = response.getheader("Content-Length")
        total = int(length) if length is not None and length.isdigit() else None
        expected = min(len(target), total) if total is not None else len(target)
    view = target[:expected]
    progress = [0]
    try:
        if sock is not None and response.length == expected and not response.chunked:
            _read_socket(response, sock, view, progress)
        else:  # TLS, chunked or a 200 longer than the target: the general path
            _read_response(response, view, progress)
    except (ConnectionError, http.client.IncompleteRead) as exc:
        raise BodyCut(progress[0], expected, type(exc).__name__) from exc
    filled = progress[0]
    if filled < expected and (status == 206 or total is not None):
        raise BodyCut(filled, expected, "end of stream")
    reusable = response.isclosed() or response.length == 0
    return Answer(status, filled, start, total, etag, version_id), reusable


def _read_response(
    response: http.client.HTTPResponse, view: memoryview, progress: list[int]
) -> None:
    while progress[0] < len(view):
        n = response.readinto(view[progress[0] :])
        if not n:
            return
        progress[0] += n


def _read_socket(
    response: http.client.HTTPResponse, sock: socket.socket, view: memoryview, progress: list[int]
) -> None:
    """Read the whole body into ``view`` with as few calls, and GIL hand-overs, as possible.

    ``HTTPResponse.readinto`` returns to Python after every ``recv`` (often
    64-256 KiB on loopback), so 16 readers take the GIL thousands of times a
    second from the device thread and the event loop. Here the bytes the
    response has buffered are taken first, then one blocking
    ``recv_into(..., MSG_WAITALL)`` waits in the kernel, without the GIL, until
    the range is complete. The socket's timeout becomes ``SO_RCVTIMEO`` for
    the call (a timed-out call returns what it has; the next raises), and
    ``Transfer.abort``'s shutdown still ends it at once.
    """
    fp = response.fp
    assert fp is not None
    buffered = len(fp.peek(1)) if len(view) else 0  # what was read with the headers
    if buffered:
        progress[0] = fp.readinto(view[: min(buffered, len(view))])
    timeout = sock.gettimeout()
    sock.settimeout(None)
    if timeout is not None:
        seconds, fraction = divmod(timeout, 1.0)
        sock.setsockopt(
            socket.SOL_SOCKET,
            socket.SO_RCVTIMEO,
            struct.pack("ll", int(seconds), int(fraction * 1e6)),
        )
    try:
        while progress[0] < len(view):
            try:
                n = sock.recv_into(view[progress[0] :], 0, socket.MSG_WAITALL)
            except BlockingIOError as exc:  # SO_RCVTIMEO elapsed with nothing received
                raise TimeoutError("timed out reading the response body") from exc
            if not n:
                break
            progress[0] += n
    finally:
        sock.settimeout(timeout)
    response.length = len(view) - progress[0]
    if response.length == 0:
        response.close()  # the body is consumed: the connection can serve the next request


def _content_range(value: str | None) -> tuple[int, int, int | None]:
    """``bytes START-END/TOTAL`` (END inclusive; TOTAL may be ``*``)."""
    match = _CONTENT_RANGE.match(value or "")
    if match is None:
        raise HttpStatusError(206, "", f"a 206 without a usable Content-Range: {value!r}")
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), int(match.group(2)), total
