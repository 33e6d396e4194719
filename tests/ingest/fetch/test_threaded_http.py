"""``threaded_http.py`` and ``http_answer.py`` against a tiny local HTTP server.

The S3 behaviour itself (signing, If-Match, faults) is tested against SeaweedFS
through the fault proxy in ``tests/ingest/fetch/test_s3.py``; here are the HTTP edges a
real S3 server rarely shows: a server that ignores ``Range``, a 206 without a
usable ``Content-Range``, a body shorter than declared, keep-alive reuse.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from ingest.fetch.http_answer import BodyCut, HttpStatusError, NoAnswer, request_head
from ingest.fetch.threaded_http import ConnectionPool, Transfer, get_into, put_from
from tests.ingest.fetch.http_server import BIG, DATA, IDLE_S, STALL_S, Handler


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    made = ConnectionPool(2.0, 2.0, ssl.create_default_context())
    yield made
    made.close()


def test_ranges_land_in_the_target_and_connections_are_reused(
    server: str, pool: ConnectionPool
) -> None:
    target = bytearray(4096)
    for start in (0, 4096, 12288):
        answer = get_into(
            pool,
            f"{server}/obj?X-Amz-Signature=s",
            {"Range": f"bytes={start}-{start + 4095}"},
            memoryview(target),
        )
        assert bytes(target) == DATA[start : start + 4096]
        assert (answer.status, answer.start, answer.total) == (206, start, len(DATA))
        assert (answer.etag, answer.version_id, answer.filled) == ("abc", "v1", 4096)
    assert pool.opened == 1  # one keep-alive connection served all three


def test_a_range_past_a_small_objects_end_gives_the_whole_object(
    server: str, pool: ConnectionPool
) -> None:
    target = bytearray(1 << 20)
    answer = get_into(pool, f"{server}/obj", {"Range": "bytes=0-1048575"}, memoryview(target))
    assert (answer.filled, answer.total) == (len(DATA), len(DATA))
    assert bytes(target[: len(DATA)]) == DATA


def test_a_server_that_ignores_range_is_read_up_to_the_target(
    server: str, pool: ConnectionPool
) -> None:
    target = bytearray(100)
    answer = get_into(pool, f"{server}/norange", {"Range": "bytes=0-99"}, memoryview(target))
    assert (answer.status, answer.filled, answer.total) == (200, 100, len(BIG))
    assert bytes(target) == BIG[:100]
    whole = bytearray(len(BIG))
    get_into(pool, f"{server}/norange", {}, memoryview(whole))
    assert whole == BIG
    assert pool.opened == 2  # the unread rest of the first answer closed its connection


def test_error_status_carries_the_s3_code(server: str, pool: ConnectionPool) -> None:
    with pytest.raises(HttpStatusError) as caught:
        get_into(pool, f"{server}/error", {}, memoryview(bytearray(10)))
    assert (caught.value.status, caught.value.code) == (503, "SlowDown")


def test_a_chunked_error_answer_is_not_waited_for(server: str, pool: ConnectionPool) -> None:
    started = time.monotonic()
    with pytest.raises(HttpStatusError) as caught:
        get_into(pool, f"{server}/chunked-error", {}, memoryview(bytearray(10)))
    assert (caught.value.status, caught.value.code) == (500, "InternalError")
    assert time.monotonic() - started < 1.0  # not the 2 s read timeout


def test_a_206_without_a_usable_content_range_is_refused(server: str, pool: ConnectionPool) -> None:
    with pytest.raises(HttpStatusError, match="Content-Range"):
        get_into(pool, f"{server}/badrange", {"Range": "bytes=0-9"}, memoryview(bytearray(10)))


def test_a_body_shorter_than_declared_is_cut_not_data(server: str, pool: ConnectionPool) -> None:
    with pytest.raises(BodyCut) as caught:
        get_into(pool, f"{server}/short", {"Range": "bytes=0-"}, memoryview(bytearray(len(DATA))))
    assert (caught.value.filled, caught.value.expected) == (1024, len(DATA))


def test_a_body_larger_than_the_socket_buffers_arrives_whole_and_reuses_the_connection(
    server: str, pool: ConnectionPool
) -> None:
    for _ in range(3):
        target = bytearray(len(BIG))
        answer = get_into(pool, f"{server}/big", {"Range": "bytes=0-"}, memoryview(target))
        assert (answer.status, answer.filled, answer.total) == (206, len(BIG), len(BIG))
        assert target == BIG
    assert pool.opened == 1  # the body was consumed to its end each time: kept alive


def test_a_body_that_stalls_times_out_instead_of_hanging(server: str) -> None:
    quick = ConnectionPool(2.0, 0.3, ssl.create_default_context())
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            get_into(quick, f"{server}/stall", {"Range": "bytes=0-"}, memoryview(bytearray(16384)))
        assert time.monotonic() - started < STALL_S / 2
    finally:
        quick.close()


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


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_a_reused_connection_closed_as_the_request_arrives_is_replaced_once(
    server: str, pool: ConnectionPool, method: str
) -> None:
    """The server hangs up a kept-alive connection just as the next request comes (the
    pool's check cannot see that coming): sent again on a new connection, answered."""

    def request() -> object:
        url = f"{server}/hangup-reused"
        if method == "PUT":
            return put_from(pool, url, {}, [memoryview(b"x")])
        return get_into(pool, url, {"Range": "bytes=0-99"}, memoryview(bytearray(100))).status

    assert request() in (206, '"put-etag"')  # a new connection: answered, kept
    assert request() in (206, '"put-etag"')  # kept one hung up on; sent again on a new one
    assert pool.opened == 2


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_a_new_connection_that_ends_without_an_answer_fails_at_once(
    server: str, pool: ConnectionPool, method: str
) -> None:
    url = f"{server}/hangup"
    if method == "PUT":
        with pytest.raises(NoAnswer):
            put_from(pool, url, {}, [memoryview(b"x")])
    else:
        with pytest.raises(NoAnswer):
            get_into(pool, url, {"Range": "bytes=0-9"}, memoryview(bytearray(10)))
    assert pool.opened == 1  # not sent again: only a reused connection's hang-up is
