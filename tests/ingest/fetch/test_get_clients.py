"""Both GET clients, a thread's (``threaded_http.get_into``) and the event loop's
(``loop_http.LoopGets``, on uvloop as the worker runs it), against the tiny local HTTP
server (``http_server.py``): the same request must land the same bytes, or fail the same
way, on either. What only one of them has is tested in ``test_threaded_http.py`` (aborts
from another thread, PUTs, the pool's check of idle connections) and ``test_loop_http.py``
(cancellation, the read timeout as a silence, which GETs it takes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from ingest.fetch.http_answer import BodyCut, HttpStatusError, NoAnswer
from tests.ingest.fetch.get_clients import Client, OnLoop, Threads
from tests.ingest.fetch.http_server import BIG, DATA, STALL_S

CLIENTS: dict[str, Callable[[float], Client]] = {"threads": Threads, "loop": OnLoop}


@pytest.fixture(params=sorted(CLIENTS))
def make_client(request: pytest.FixtureRequest) -> Iterator[Callable[[float], Client]]:
    made: list[Client] = []

    def make(read_timeout_s: float = 2.0) -> Client:
        made.append(CLIENTS[request.param](read_timeout_s))
        return made[-1]

    yield make
    for client in made:
        client.close()


@pytest.fixture
def client(make_client: Callable[[float], Client]) -> Client:
    return make_client(2.0)


def test_ranges_land_in_the_target_and_connections_are_reused(server: str, client: Client) -> None:
    for start in (0, 4096, 12288):
        target = bytearray(4096)
        answer = client.get(
            f"{server}/obj?X-Amz-Signature=s", {"Range": f"bytes={start}-{start + 4095}"}, target
        )
        assert bytes(target) == DATA[start : start + 4096]
        assert (answer.status, answer.start, answer.total) == (206, start, len(DATA))
        assert (answer.etag, answer.version_id, answer.filled) == ("abc", "v1", 4096)
    assert client.opened == 1  # one keep-alive connection served all three


def test_a_range_past_a_small_objects_end_gives_the_whole_object(
    server: str, client: Client
) -> None:
    target = bytearray(1 << 20)
    answer = client.get(f"{server}/obj", {"Range": "bytes=0-1048575"}, target)
    assert (answer.filled, answer.total) == (len(DATA), len(DATA))
    assert bytes(target[: len(DATA)]) == DATA


def test_a_server_that_ignores_range_is_read_up_to_the_target(server: str, client: Client) -> None:
    target = bytearray(100)
    answer = client.get(f"{server}/norange", {"Range": "bytes=0-99"}, target)
    assert (answer.status, answer.filled, answer.total) == (200, 100, len(BIG))
    assert bytes(target) == BIG[:100]
    whole = bytearray(len(BIG))
    client.get(f"{server}/norange", {}, whole)
    assert whole == BIG
    assert client.opened == 2  # the unread rest of the first answer closed its connection


def test_error_status_carries_the_s3_code(server: str, client: Client) -> None:
    with pytest.raises(HttpStatusError) as caught:
        client.get(f"{server}/error", {}, bytearray(10))
    assert (caught.value.status, caught.value.code) == (503, "SlowDown")


def test_a_chunked_error_answer_is_not_waited_for(server: str, client: Client) -> None:
    started = time.monotonic()
    with pytest.raises(HttpStatusError) as caught:
        client.get(f"{server}/chunked-error", {}, bytearray(10))
    assert (caught.value.status, caught.value.code) == (500, "InternalError")
    assert time.monotonic() - started < 1.0  # not the 2 s read timeout


def test_a_206_without_a_usable_content_range_is_refused(server: str, client: Client) -> None:
    with pytest.raises(HttpStatusError, match="Content-Range"):
        client.get(f"{server}/badrange", {"Range": "bytes=0-9"}, bytearray(10))


def test_a_body_shorter_than_declared_is_cut_not_data(server: str, client: Client) -> None:
    with pytest.raises(BodyCut) as caught:
        client.get(f"{server}/short", {"Range": "bytes=0-"}, bytearray(len(DATA)))
    assert (caught.value.filled, caught.value.expected) == (1024, len(DATA))


def test_a_body_larger_than_the_socket_buffers_arrives_whole_and_reuses_the_connection(
    server: str, client: Client
) -> None:
    for _ in range(3):
        target = bytearray(len(BIG))
        answer = client.get(f"{server}/big", {"Range": "bytes=0-"}, target)
        assert (answer.status, answer.filled, answer.total) == (206, len(BIG), len(BIG))
        assert target == BIG
    assert client.opened == 1  # the body was consumed to its end each time: kept alive


def test_a_body_that_stalls_times_out_instead_of_hanging(
    server: str, make_client: Callable[[float], Client]
) -> None:
    quick = make_client(0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        quick.get(f"{server}/stall", {"Range": "bytes=0-"}, bytearray(len(DATA)))
    assert time.monotonic() - started < STALL_S / 2


def test_a_reused_connection_closed_as_the_request_arrives_is_replaced_once(
    server: str, client: Client
) -> None:
    """The server hangs up a kept-alive connection just as the next request comes (no check
    of an idle connection can see that coming): sent again on a new connection, answered."""
    for _ in range(2):  # a new connection; then the kept one hung up on, sent again
        answer = client.get(f"{server}/hangup-reused", {"Range": "bytes=0-99"}, bytearray(100))
        assert answer.status == 206
    assert client.opened == 2


def test_a_new_connection_that_ends_without_an_answer_fails_at_once(
    server: str, client: Client
) -> None:
    with pytest.raises(NoAnswer):
        client.get(f"{server}/hangup", {"Range": "bytes=0-9"}, bytearray(10))
    assert client.opened == 1  # not sent again: only a reused connection's hang-up is
