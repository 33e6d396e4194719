"""``threaded_http.py`` against a tiny local HTTP server (``http_server.py``): what only
the GET threads' client has: an abort from another thread, PUTs, the pool's check of
the connections the server closed while they sat idle, a header value that would start a
header of its own.

The HTTP edges every GET must meet (a server that ignores ``Range``, a 206 without a
usable ``Content-Range``, a body shorter than declared, keep-alive reuse) are tested on
both GET clients in ``test_get_clients.py``; the S3 behaviour itself (signing, If-Match,
faults) against SeaweedFS through the fault proxy in ``test_s3.py``.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from ingest.fetch.http_answer import BodyCut, NoAnswer, request_head
from ingest.fetch.threaded_http import ConnectionPool, Transfer, get_into, put_from
from tests.ingest.fetch.http_server import DATA, IDLE_S, STALL_S, Handler


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    made = ConnectionPool(2.0, 2.0, ssl.create_default_context())
    yield made
    made.close()


def test_an_abort_ends_a_body_read_in_progress(server: str, pool: ConnectionPool) -> None:
    transfer = Transfer()
    assert transfer.begin()
    timer = threading.Timer(0.2, transfer.abort)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(BodyCut) as caught:
            get_into(
                pool,
                f"{server}/stall",
                {"Range": "bytes=0-"},
                memoryview(bytearray(len(DATA))),
                transfer,
            )
    finally:
        timer.join()
    assert caught.value.filled == 1024
    assert time.monotonic() - started < STALL_S / 2


def test_put_sends_the_pieces_in_order_without_joining(server: str, pool: ConnectionPool) -> None:
    Handler.received.clear()
    pieces = [memoryview(b"header:"), memoryview(DATA), memoryview(b":end")]
    assert put_from(pool, f"{server}/out.npy", {}, pieces) == '"put-etag"'
    assert Handler.received == [b"header:" + DATA + b":end"]


def test_an_aborted_transfer_never_begins_and_a_begun_one_is_shut() -> None:
    early = Transfer()
    assert early.abort() is False  # not begun: nothing to wait for
    assert early.begin() is False  # and it must not start now
    late = Transfer()
    assert late.begin() is True
    left, right = socket.socketpair()
    try:
        late.attach(left)
        assert late.abort() is True  # begun: the caller waits for its thread
        assert left.recv(1) == b""  # shut down: a blocked recv returns at once
    finally:
        left.close()
        right.close()


def test_a_header_value_with_a_line_break_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="line break"):
        request_head("GET", "/k", "h", {"If-Match": '"abc"\nX-Evil: 1'})
    assert request_head("GET", "/k", "h:1", {"Range": "bytes=0-9"}) == (
        b"GET /k HTTP/1.1\r\nHost: h:1\r\nAccept-Encoding: identity\r\nRange: bytes=0-9\r\n\r\n"
    )


def _wait_until_closed_by_the_server(pool: ConnectionPool, url: str, count: int) -> None:
    """Put ``count`` connections in the pool, each used once, and let the server close them."""
    leases = [pool.take("http", url.removeprefix("http://")) for _ in range(count)]
    for conn in leases:
        conn.request("GET", "/obj", headers={"Range": "bytes=0-0"})
        conn.getresponse().read()
    for conn in leases:
        pool.give("http", url.removeprefix("http://"), conn)
    time.sleep(IDLE_S * 3)


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_idle_connections_the_server_closed_are_dropped_not_used(
    idle_closing_server: str, pool: ConnectionPool, method: str
) -> None:
    """More dead connections in the pool than a request has attempts: the request still
    goes out on a live connection, first time (reported: a worker idle for 400 s
    dead-lettered its next object after 5 attempts on 5 dead connections)."""
    _wait_until_closed_by_the_server(pool, idle_closing_server, 6)
    assert pool.opened == 6
    if method == "PUT":
        pieces = [memoryview(b"after a quiet spell")]
        assert put_from(pool, f"{idle_closing_server}/out.npy", {}, pieces) == '"put-etag"'
    else:
        target = bytearray(4096)
        url = f"{idle_closing_server}/obj"
        answer = get_into(pool, url, {"Range": "bytes=0-4095"}, memoryview(target))
        assert (answer.status, bytes(target)) == (206, DATA[:4096])
    assert (pool.dropped, pool.opened) == (6, 7)  # each dead one seen and closed, one made


def test_a_reused_connection_closed_as_the_request_arrives_is_replaced_once_for_a_put(
    server: str, pool: ConnectionPool
) -> None:
    """As a GET is (``test_get_clients.py``): sent again on a new connection, answered."""
    for _ in range(2):  # a new connection; then the kept one hung up on, sent again
        assert put_from(pool, f"{server}/hangup-reused", {}, [memoryview(b"x")]) == '"put-etag"'
    assert pool.opened == 2


def test_a_new_connection_that_ends_without_an_answer_fails_a_put_at_once(
    server: str, pool: ConnectionPool
) -> None:
    with pytest.raises(NoAnswer):
        put_from(pool, f"{server}/hangup", {}, [memoryview(b"x")])
    assert pool.opened == 1  # not sent again: only a reused connection's hang-up is
