"""S3 data requests on plain keep-alive connections, run in worker threads.

Ranged GETs read into caller memory (``get_into``); PUTs send from it
(``put_from``). Why the bytes do not go through aiobotocore: every body byte
read or written through aiohttp passes the one event-loop thread (about
1 GB/s per core, measured; docs/benchmarks.md) and is copied into or out of
``bytes``. Here a worker thread receives the body straight into the ring slot,
or hands the output arrays' own memory to ``sendall``: the kernel does the
only copy, the GIL is released meanwhile, and there is one thread per request
in flight, so transfers use every core.

A GET writes its request and parses its answer's head on the socket itself
(``http.client``'s objects cost ~150 us of GIL-held Python per request), then
waits for the whole body in one ``recv(MSG_WAITALL)`` on plain connections.
PUTs, fewer and larger, use ``http.client``. ``http.client.HTTPConnection``
also makes the connections (TLS included) that the pool keeps.

Requests are presigned (SigV4 query authentication, by botocore in
``fetch.py`` and ``sink.py``), so a thread needs nothing from the event loop.
Extra headers (``Range``, ``If-Match``) are sent unsigned, which S3 allows.

Everything here is blocking and thread-safe: ``ConnectionPool`` hands each
thread its own keep-alive connection, and ``Transfer.abort`` (from any
thread) shuts the socket of a request in progress so a cancelled read ends at
once instead of at its timeout. Failures leave as ``HttpStatusError`` (the
server answered an error status, or a data answer S3 would not send),
``BodyCut`` (the body ended or broke before its length) or the socket's own
``OSError``/``TimeoutError``; ``fetch.py`` maps them onto ``ingest.errors``.
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
# Where recv(MSG_WAITALL) and SO_RCVTIMEO behave as _recv_exactly needs; elsewhere plain recv.
_STATUS_LINE = re.compile(rb"^HTTP/1\.([01]) (\d{3})(?: |$)")
HEAD_LIMIT = 16 * 1024  # an answer's status line and headers (S3 sends under 2 KiB)
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

    The request is written and its answer read on the connection's socket
    directly, not through ``http.client``'s request and response objects: their
    header building and ``email``-based parsing cost ~150 us of Python (GIL
    held) per request, measured, which sixteen readers at 10 GB/s take from the
    device thread. What is read here is small: one status line, a few headers,
    then a body of a known length.

    Raises:
        HttpStatusError: any status but 200/206.
        BodyCut: the body ended or broke before its length.
        OSError, TimeoutError: connecting or sending failed, or a read timed out.
    """
    with _Lease(pool, url, transfer) as lease:
        sock = lease.conn.sock
        sock.sendall(_request_head("GET", lease.path, lease.host, headers))
        answer, lease.reusable = _read_answer(sock, target, waitall=lease.plain and _RECV_WAITALL)
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
        default_port = {"http": 80, "https": 443}.get(parts.scheme)
        self.host = parts.hostname or "" if parts.port in (None, default_port) else parts.netloc
        if ":" in self.host and not self.host.startswith("["):  # an IPv6 address
            self.host = f"[{self.host}]"
        self.conn = pool.take(*self._where)
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


def _request_head(method: str, path: str, host: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(slots=True)
class _Head:
    """A parsed answer head and the body bytes that arrived with it."""

    status: int
    headers: dict[str, str]  # names in lower case
    early: memoryview  # body bytes read with the head
    keep_alive: bool


def _read_head(sock: socket.socket) -> _Head:
    buffer = bytearray(HEAD_LIMIT)
    view = memoryview(buffer)
    filled = 0
    while True:
        end = buffer.find(b"\r\n\r\n", 0, filled)
        if end < 0:
            if filled == HEAD_LIMIT:
                raise ConnectionError(f"the answer's head is over {HEAD_LIMIT} bytes")
            n = sock.recv_into(view[filled:])
            if not n:
                raise ConnectionResetError("the server closed the connection without answering")
            filled += n
            continue
        lines = bytes(buffer[:end]).split(b"\r\n")
        match = _STATUS_LINE.match(lines[0])
        if match is None:
            raise ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}")
        status = int(match.group(2))
        if 100 <= status < 200:  # an interim answer: the real one follows
            rest = bytes(buffer[end + 4 : filled])
            buffer[: len(rest)] = rest
            filled = len(rest)
            continue
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                raise ConnectionError(f"a malformed header line: {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        keep_alive = match.group(1) == b"1" and headers.get("connection", "").lower() != "close"
        return _Head(status, headers, view[end + 4 : filled], keep_alive)


def _read_answer(sock: socket.socket, target: memoryview, *, waitall: bool) -> tuple[Answer, bool]:
    head = _read_head(sock)
    status, headers = head.status, head.headers
    framed = "transfer-encoding" not in headers and headers.get("content-length", "").isdigit()
    length = int(headers["content-length"]) if framed else None
    if status not in (200, 206):
        body = _read_error_body(sock, head, length)
        match = _CODE.search(body)
        code = match.group(1).decode("ascii", "replace") if match else ""
        raise HttpStatusError(status, code, f"S3 answered {status} {code}".rstrip())
    if length is None:
        raise HttpStatusError(status, "", "a data answer without Content-Length")
    etag = headers.get("etag", "").strip().strip('"')
    version_id = headers.get("x-amz-version-id")
    start, total = 0, None
    if status == 206:
        start, end, total = _content_range(headers.get("content-range"))
        expected = end + 1 - start
        if expected > len(target) or length > expected:
            raise HttpStatusError(206, "", f"answered {length} bytes for {expected} of range")
    else:
        total = length
        expected = min(len(target), total)
    view = target[: min(expected, length)]  # a shorter Content-Length is a cut body
    early = head.early[: len(view)]
    view[: len(early)] = early
    filled = len(early) + _recv_exactly(sock, view[len(early) :], waitall, len(early))
    if filled < expected:
        raise BodyCut(filled, expected, "end of stream")
    reusable = head.keep_alive and len(head.early) + (len(view) - len(early)) == length
    return Answer(status, filled, start, total, etag, version_id), reusable


def _recv_exactly(sock: socket.socket, view: memoryview, waitall: bool, offset: int = 0) -> int:
    """Receive up to ``len(view)`` bytes; fewer only if the connection ends first.

    A broken connection raises ``BodyCut`` counting ``offset`` bytes received before.

    With ``waitall`` (a plain socket on Linux), one ``recv_into(MSG_WAITALL)``
    waits in the kernel, without the GIL, until the range is complete:
    ``recv`` in a loop returned to Python every 64-256 KiB on loopback. The
    socket's timeout becomes ``SO_RCVTIMEO`` for it (a timed-out call returns
    what it has; the next raises), and ``Transfer.abort``'s shutdown still
    ends it at once.
    """
    filled = 0
    timeout = sock.gettimeout()
    if waitall and view:
        sock.settimeout(None)
        if timeout is not None:
            seconds, fraction = divmod(timeout, 1.0)
            packed = struct.pack("ll", int(seconds), int(fraction * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, packed)
    try:
        while filled < len(view):
            try:
                n = sock.recv_into(view[filled:], 0, socket.MSG_WAITALL if waitall else 0)
            except BlockingIOError as exc:  # SO_RCVTIMEO elapsed with nothing received
                raise TimeoutError("timed out reading the response body") from exc
            except ConnectionError as exc:
                raise BodyCut(offset + filled, offset + len(view), type(exc).__name__) from exc
            if not n:
                break
            filled += n
    finally:
        if waitall:
            sock.settimeout(timeout)
    return filled


def _read_error_body(sock: socket.socket, head: _Head, length: int | None) -> bytes:
    """Up to ``ERROR_BODY_LIMIT`` bytes of an error answer's body (for S3's error code).

    A chunked body is read to its last chunk (``0\\r\\n\\r\\n``), not to
    the connection's end, which a keep-alive server never sends; chunk-size
    lines stay in, the error code is found by a search.
    """
    chunked = "chunked" in head.headers.get("transfer-encoding", "").lower()
    want = ERROR_BODY_LIMIT if length is None else min(length, ERROR_BODY_LIMIT)
    body = bytearray(head.early[:want])
    piece = bytearray(min(want, 16 * 1024))
    with contextlib.suppress(OSError, BodyCut):  # the code is a nicety; the status is news
        while len(body) < want and not (chunked and body.endswith(b"0\r\n\r\n")):
            n = sock.recv_into(piece, min(len(piece), want - len(body)))
            if not n:
                break
            body += piece[:n]
    return bytes(body)


def _content_range(value: str | None) -> tuple[int, int, int | None]:
    """``bytes START-END/TOTAL`` (END inclusive; TOTAL may be ``*``)."""
    match = _CONTENT_RANGE.match(value or "")
    if match is None:
        raise HttpStatusError(206, "", f"a 206 without a usable Content-Range: {value!r}")
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), int(match.group(2)), total
