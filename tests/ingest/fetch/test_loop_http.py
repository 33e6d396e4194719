"""``loop_http.py``: what only the event loop's GETs have, against the tiny local HTTP
server (``http_server.py``): the read timeout as a silence, cancellation, the server's
hang-ups seen while idle, the bound on GETs under way, asyncio's own loop, and which GETs
come here. The HTTP edges every GET must meet are tested on both GET clients in
``test_get_clients.py``. The S3 faults through the fault proxy (``test_s3.py``) reach
these GETs too, a small object's GET being one of them; TLS is
``tests/system/test_security_tls.py``'s.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator

import pytest
import uvloop

from ingest.fetch.http_answer import BodyCut, head_in
from ingest.fetch.loop_http import LOOP_GET_BYTES, LoopGets
from ingest.fetch.threaded_http import ConnectionPool
from tests.ingest.fetch.get_clients import OnLoop
from tests.ingest.fetch.http_server import BIG, DATA, IDLE_S, STALL_S


@pytest.fixture
def loop() -> Iterator[OnLoop]:
    made = OnLoop()
    yield made
    made.close()


def test_a_body_that_keeps_coming_slowly_is_not_timed_out(server: str) -> None:
    """The read timeout is a silence that long, not a deadline: 16 KiB a KiB every 50 ms
    take 0.8 s, past a 0.3 s read timeout, and arrive whole."""
    quick = OnLoop(read_timeout_s=0.3)
    try:
        target = bytearray(len(DATA))
        started = time.monotonic()
        answer = quick.get(f"{server}/trickle", {"Range": "bytes=0-"}, target)
        assert time.monotonic() - started > 0.3
        assert (answer.filled, bytes(target)) == (len(DATA), DATA)
    finally:
        quick.close()


def test_a_cancelled_get_returns_at_once_and_never_writes_its_target_again(
    server: str, loop: OnLoop
) -> None:
    target = bytearray(len(DATA))

    async def cancelled() -> None:
        get = asyncio.ensure_future(
            loop.gets.get_into(f"{server}/trickle", {"Range": "bytes=0-"}, memoryview(target))
        )
        await asyncio.sleep(0.3)  # a few pieces in
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        seen = bytes(target)
        await asyncio.sleep(0.5)  # the server goes on sending
        assert bytes(target) == seen
        assert 0 < len(seen.rstrip(b"\0")) < len(DATA)

    started = time.monotonic()
    loop.run(cancelled())
    assert time.monotonic() - started < STALL_S / 2
    answer = loop.run(
        loop.gets.get_into(f"{server}/obj", {"Range": "bytes=0-9"}, memoryview(target))
    )
    assert answer.filled == 10
    assert loop.gets.opened == 2  # the cancelled GET's connection was closed, not reused


def test_asyncios_own_loop_reads_the_same_answers(server: str) -> None:
    """Where uvloop is not installed (Windows) the worker runs on asyncio's own loop."""
    loop = OnLoop(plain_asyncio=True)
    try:
        for start in (0, 4096):
            target = bytearray(4096)
            loop.get(f"{server}/obj", {"Range": f"bytes={start}-{start + 4095}"}, target)
            assert bytes(target) == DATA[start : start + 4096]
        big = bytearray(len(BIG))
        assert loop.get(f"{server}/big", {"Range": "bytes=0-"}, big).filled == len(BIG)
        assert big == BIG
        assert loop.gets.opened == 1
        with pytest.raises(BodyCut):
            loop.get(f"{server}/short", {"Range": "bytes=0-"}, bytearray(len(DATA)))
    finally:
        loop.close()


def test_idle_connections_the_server_closed_are_dropped_not_used(
    idle_closing_server: str, loop: OnLoop
) -> None:
    url = f"{idle_closing_server}/obj"

    async def four_then_quiet() -> None:
        targets = [bytearray(10) for _ in range(4)]
        await asyncio.gather(
            *(loop.gets.get_into(url, {"Range": "bytes=0-9"}, memoryview(t)) for t in targets)
        )
        await asyncio.sleep(IDLE_S * 3)  # the server closes all four

    loop.run(four_then_quiet())
    assert loop.gets.opened == 4
    target = bytearray(4096)
    answer = loop.get(url, {"Range": "bytes=0-4095"}, target)
    assert (answer.status, bytes(target)) == (206, DATA[:4096])
    assert loop.gets.opened == 5  # each dead one seen as closed, one made


def test_gets_past_the_limit_wait_their_turn_on_the_connections_there_are(server: str) -> None:
    pool = ConnectionPool(2.0, 2.0, ssl.create_default_context())
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    targets = [bytearray(4096) for _ in range(6)]

    async def six(gets: LoopGets) -> None:
        await asyncio.gather(
            *(
                gets.get_into(f"{server}/obj", {"Range": "bytes=0-4095"}, memoryview(t))
                for t in targets
            )
        )

    try:
        for limit, connections in ((2, 2), (6, 6)):
            gets = LoopGets(pool, limit)
            runner.run(six(gets))
            assert all(bytes(t) == DATA[:4096] for t in targets)
            assert gets.opened == connections
            gets.close()
    finally:
        runner.close()
        pool.close()


def test_only_small_gets_to_endpoints_reached_directly_run_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    monkeypatch.setenv("NO_PROXY", "direct.example")
    gets = LoopGets(ConnectionPool(2.0, 2.0, ssl.create_default_context()), 16)
    assert gets.serves("http", "s3.example:9000", LOOP_GET_BYTES)
    assert not gets.serves("http", "s3.example:9000", LOOP_GET_BYTES + 1)  # the GET threads'
    assert not gets.serves("https", "s3.example", 1000)  # through the proxy: the threads'
    assert gets.serves("https", "direct.example", 1000)  # NO_PROXY: direct, TLS on the loop


@pytest.mark.parametrize("cut", [1, 20, 47, 60])
def test_an_interim_answer_is_skipped_however_the_head_arrives(cut: int) -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b'HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\nETag: "e"\r\n\r\nabc'
    )
    buffer = bytearray(16 * 1024)
    buffer[:cut] = answer[:cut]
    head, filled = head_in(buffer, cut)
    if head is None:  # incomplete: the rest arrives behind what is kept
        buffer[filled : filled + len(answer) - cut] = answer[cut:]
        head, filled = head_in(buffer, filled + len(answer) - cut)
    assert head is not None
    assert (head.status, head.headers["etag"], bytes(head.early)) == (206, '"e"', b"abc")
