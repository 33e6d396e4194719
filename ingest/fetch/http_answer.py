"""One GET's answer, read on the socket: status line, headers, then the body into caller memory.

``threaded_http.get_into`` writes a request with ``request_head`` and reads the
answer with ``read_answer``; the event loop's GETs (``loop_http``) read theirs
as bytes arrive with the same pieces (``head_in``, ``data_body``,
``error_body_done``), so both take and refuse an answer alike. ``http.client``'s
request and response objects (header building, ``email``-based parsing) cost more
CPU per request, GIL held (``python -m ingest.bench.diagnostics.request_cost``
measures the whole request, client and a loopback server together), which the
reader threads take from the device thread. What S3 answers a GET is small and
regular: one status line, a few headers, then a body of a known length. The body
is received straight into the caller's memory, in one ``recv(MSG_WAITALL)`` on
plain connections.

Failures: ``HttpStatusError`` (an error status, or a data answer S3 would not
send), ``BodyCut`` (the body ended or broke before its length), ``NoAnswer``
(the connection ended before the answer began), the socket's own
``OSError``/``TimeoutError``.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import sys
from dataclasses import dataclass

ERROR_BODY_LIMIT = 64 * 1024
HEAD_LIMIT = 16 * 1024  # an answer's status line and headers (S3 sends under 2 KiB)
# Where recv(MSG_WAITALL) and SO_RCVTIMEO behave as recv_exactly needs; elsewhere plain recv.
RECV_WAITALL = sys.platform == "linux" and hasattr(socket, "MSG_WAITALL")
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_STATUS_LINE = re.compile(rb"^HTTP/1\.([01]) (\d{3})(?: |$)")


class HttpStatusError(Exception):
    """The server answered ``status`` (not 200/206); ``code`` is S3's error code, if any."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class NoAnswer(ConnectionResetError):
    """The connection ended (closed or reset) before the first byte of an answer.

    On a reused keep-alive connection it means the server closed the connection
    while it sat idle in the pool (SeaweedFS does after ``-s3.idleTimeout``, 120 s
    by default) just as the request went out, so the request did not reach it:
    ``threaded_http`` sends it again on a new connection. Otherwise it is a reset
    like any other (retriable).
    """


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


def request_head(method: str, path: str, host: str, headers: dict[str, str]) -> bytes:
    """The request line and headers of a body-less request.

    Raises:
        ValueError: a header value holds a line break (an ETag from a server, say),
            which would start a header of its own.
    """
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"a line break in the value of header {name!r}")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(slots=True)
class Head:
    """A parsed answer head and the body bytes that arrived with it."""

    status: int
    headers: dict[str, str]  # names in lower case
    early: memoryview  # body bytes read with the head
    keep_alive: bool


def head_in(buffer: bytearray, filled: int) -> tuple[Head | None, int]:
    """The final answer's head once ``buffer[:filled]`` holds it, and ``filled``.

    While the head is incomplete: ``(None, filled)``. Interim answers (1xx) are
    dropped from the front of ``buffer``; ``filled`` then counts what is left.

    Raises:
        ConnectionError: not an HTTP answer, a malformed header line, or a head over
            ``HEAD_LIMIT`` bytes.
    """
    while True:
        end = buffer.find(b"\r\n\r\n", 0, filled)
        if end < 0:
            if filled >= HEAD_LIMIT:
                raise ConnectionError(f"the answer's head is over {HEAD_LIMIT} bytes")
            return None, filled
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
        return Head(status, headers, memoryview(buffer)[end + 4 : filled], keep_alive), filled


def _read_head(sock: socket.socket) -> Head:
    buffer = bytearray(HEAD_LIMIT)
    view = memoryview(buffer)
    filled = 0
    while True:
        head, filled = head_in(buffer, filled)
        if head is not None:
            return head
        try:
            n = sock.recv_into(view[filled:])
        except ConnectionError as exc:
            if filled:
                raise
            raise NoAnswer(f"the connection broke before an answer: {exc}") from exc
        if not n and filled:
            raise ConnectionResetError("the server closed the connection inside the answer")
        if not n:
            raise NoAnswer("the server closed the connection without answering")
        filled += n


@dataclass(frozen=True, slots=True)
class Body:
    """What a data answer (200 or 206) will put into a target: ``receive`` bytes of its
    ``length`` are taken, of which ``expected`` must come for the answer to be whole."""

    status: int
    length: int  # Content-Length
    receive: int  # the bytes received into the target (the rest, if any, is dropped)
    expected: int
    start: int
    total: int | None
    etag: str
    version_id: str | None

    def answer(self, filled: int) -> Answer:
        """The answer, once ``filled`` bytes came.

        Raises:
            BodyCut: fewer than ``expected``.
        """
        if filled < self.expected:
            raise BodyCut(filled, self.expected, "end of stream")
        return Answer(self.status, filled, self.start, self.total, self.etag, self.version_id)


def content_length(head: Head) -> int | None:
    """The body's length, or None where it is not framed by Content-Length (chunked)."""
    headers = head.headers
    framed = "transfer-encoding" not in headers and headers.get("content-length", "").isdigit()
    return int(headers["content-length"]) if framed else None


def data_body(head: Head, capacity: int) -> Body:
    """The body of a 200 or 206 answer to a GET of at most ``capacity`` bytes.

    A 206 must carry the whole requested range; a 200 (a server that ignored
    ``Range``) fills ``capacity`` and the rest of it is dropped.

    Raises:
        HttpStatusError: no Content-Length, or a 206 whose range and length disagree
            with each other or with ``capacity``.
    """
    status, headers = head.status, head.headers
    length = content_length(head)
    if length is None:
        raise HttpStatusError(status, "", "a data answer without Content-Length")
    etag = headers.get("etag", "").strip().strip('"')
    version_id = headers.get("x-amz-version-id")
    start, total = 0, None
    if status == 206:
        start, end, total = _content_range(headers.get("content-range"))
        expected = end + 1 - start
        if expected > capacity or length > expected:
            raise HttpStatusError(206, "", f"answered {length} bytes for {expected} of range")
    else:
        total = length
        expected = min(capacity, total)
    receive = min(expected, length)  # a shorter Content-Length is a cut body
    return Body(status, length, receive, expected, start, total, etag, version_id)


def read_answer(sock: socket.socket, target: memoryview, *, waitall: bool) -> tuple[Answer, bool]:
    head = _read_head(sock)
    if head.status not in (200, 206):
        code = error_code(_read_error_body(sock, head))
        raise HttpStatusError(head.status, code, f"S3 answered {head.status} {code}".rstrip())
    body = data_body(head, len(target))
    view = target[: body.receive]
    early = head.early[: len(view)]
    view[: len(early)] = early
    filled = len(early) + recv_exactly(sock, view[len(early) :], waitall, len(early))
    reusable = head.keep_alive and len(head.early) + (len(view) - len(early)) == body.length
    return body.answer(filled), reusable


def recv_exactly(sock: socket.socket, view: memoryview, waitall: bool, offset: int = 0) -> int:
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


def error_body_wanted(head: Head) -> int:
    """How much of an error answer's body to read for S3's error code."""
    length = content_length(head)
    return ERROR_BODY_LIMIT if length is None else min(length, ERROR_BODY_LIMIT)


def error_body_done(head: Head, body: bytes | bytearray) -> bool:
    """Whether ``body`` is all of an error answer's body there is to read.

    A chunked body is read to its last chunk (``0\\r\\n\\r\\n``), not to the
    connection's end, which a keep-alive server never sends; chunk-size lines
    stay in, the error code is found by a search.
    """
    chunked = "chunked" in head.headers.get("transfer-encoding", "").lower()
    return len(body) >= error_body_wanted(head) or (chunked and body.endswith(b"0\r\n\r\n"))


def _read_error_body(sock: socket.socket, head: Head) -> bytes:
    """Up to ``ERROR_BODY_LIMIT`` bytes of an error answer's body (for S3's error code)."""
    want = error_body_wanted(head)
    body = bytearray(head.early[:want])
    piece = bytearray(min(want, 16 * 1024))
    with contextlib.suppress(OSError, BodyCut):  # the code is a nicety; the status is news
        while not error_body_done(head, body):
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


def error_code(body: bytes) -> str:
    """S3's error code (``<Code>...</Code>``) in an error answer's body, or ""."""
    match = _CODE.search(body)
    return match.group(1).decode("ascii", "replace") if match else ""
