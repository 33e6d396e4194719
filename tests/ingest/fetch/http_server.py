"""A tiny local HTTP server for the GET clients' tests (``test_threaded_http.py``,
``test_loop_http.py``): each path is an edge a real S3 server rarely shows.

``/obj``: the range asked for, of ``DATA``; ``/error``: 503 SlowDown; ``/norange``: all of
``BIG`` as a 200 (``Range`` ignored); ``/badrange``: a 206 without a usable
``Content-Range``; ``/chunked-error``: a chunked 500 on a connection kept open; ``/big``:
``BIG`` as a 206; ``/stall``: 1 KiB of 16 then silence for ``STALL_S``; ``/trickle``: 16 KiB,
1 KiB every 50 ms; ``/short``: 1 KiB of 16, then the connection closes; ``/hangup``: closes
without answering; ``/hangup-reused``: the same, on a connection that served a request
before. PUTs are kept in ``Handler.received``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

DATA = bytes(range(256)) * 64  # 16 KiB
BIG = bytes(range(251)) * (4 * 1024 * 1024 // 251)  # ~4 MiB: read past the response's buffer
STALL_S = 3.0
IDLE_S = 0.2


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    received: ClassVar[list[bytes]] = []

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return

    def do_GET(self) -> None:
        if self._hang_up():
            return
        if self.path.startswith("/error"):
            body = b"<Error><Code>SlowDown</Code><Message>later</Message></Error>"
            self._answer(503, body, {})
        elif self.path.startswith("/norange"):  # ignores Range: the whole body, 200
            self._answer(200, BIG, {"ETag": '"abc"'})
        elif self.path.startswith("/badrange"):
            self._answer(206, DATA[:10], {"Content-Range": "bytes nonsense"})
        elif self.path.startswith("/chunked-error"):  # chunked, and the connection stays open
            body = b"<Error><Code>InternalError</Code></Error>"
            self.send_response(500)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        elif self.path.startswith("/big"):
            self._answer(206, BIG, {"Content-Range": f"bytes 0-{len(BIG) - 1}/{len(BIG)}"})
        elif self.path.startswith("/stall"):  # declares 16 KiB, sends 1 KiB, goes quiet
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(DATA) - 1}/{len(DATA)}")
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA[:1024])
            self.wfile.flush()
            time.sleep(STALL_S)
            self.close_connection = True
        elif self.path.startswith("/trickle"):  # 16 KiB, 1 KiB every 50 ms
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(DATA) - 1}/{len(DATA)}")
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            for start in range(0, len(DATA), 1024):
                self.wfile.write(DATA[start : start + 1024])
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path.startswith("/short"):  # declares 16 KiB, sends 1 KiB, closes
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(DATA) - 1}/{len(DATA)}")
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA[:1024])
            self.close_connection = True
        else:
            first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last), len(DATA) - 1)
            headers = {
                "Content-Range": f"bytes {start}-{end}/{len(DATA)}",
                "ETag": '"abc"',
                "x-amz-version-id": "v1",
            }
            self._answer(206, DATA[start : end + 1], headers)

    def do_PUT(self) -> None:
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        if self._hang_up():
            return
        Handler.received.append(body)
        self._answer(200, b"", {"ETag": '"put-etag"'})

    def _hang_up(self) -> bool:
        """``/hangup``: close without answering; ``/hangup-reused``: the same, but only on a
        connection that served a request before (a keep-alive server closing an idle
        connection as the next request arrives)."""
        self.served = getattr(self, "served", 0) + 1
        if self.path.startswith("/hangup-reused") and self.served == 1:
            return False
        if self.path.startswith("/hangup"):
            self.close_connection = True
            return True
        return False

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class IdleClosingHandler(Handler):
    """Closes a keep-alive connection idle for ``IDLE_S``, as SeaweedFS does after 120 s."""

    timeout = IDLE_S


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        return  # clients here hang up on purpose (cut bodies, aborts): not news


@contextlib.contextmanager
def serve(handler: type[Handler]) -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), handler)
    # polled every 10 ms, not 0.5 s, so that shutdown() at each test's end is not a wait
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
