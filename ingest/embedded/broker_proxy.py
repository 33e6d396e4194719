"""The embedded broker's front door: Tansu behind a proxy that lets one produce in at a time.

Tansu 0.6 assigns a produce request its offsets (it moves the partition's high
watermark) before it stores the batch, and its fetch answers with whatever
batches are stored below the high watermark. With two producers on one
partition, a fetch that lands between the second producer's store and the
first's gets the later batch, and the consumer's position moves past the
earlier one: a live consumer never sees those records, although a read from the
start does. Kafka itself never lets a fetch see past an offset not yet written.

This proxy speaks just enough of the Kafka protocol to find where each request
and response ends and which requests are produce requests. It forwards every
request unchanged, in order, but holds a produce request until the produce
before it (from any connection) has been answered, so Tansu never has two
produces in flight and stores each batch before it assigns the next offsets.
A produce with ``acks=0`` gets no answer, so it holds the turn only until it is
sent. Nothing else is serialised: fetches, commits and group traffic from every
connection go on concurrently.

It runs as the process that ``ingest.embedded.stack.Tansu`` starts, with Tansu
as its child in the same process group: it listens on the advertised address,
starts Tansu on a private loopback port advertising the proxy's address (so
metadata and coordinator answers bring clients back here), and exits when Tansu
does. A SIGKILL of the group takes both down, as a broker crash would.

Usage (the stack builds this command)::

    python -m ingest.embedded.broker_proxy HOST:PORT TANSU [TANSU ARGS ...]

where ``TANSU ARGS`` omit ``--listener-url`` and ``--advertised-listener-url``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

PRODUCE = 0
LIST_OFFSETS = 2
LATEST = -1  # the ListOffsets timestamp that asks for the end of a partition
FLEXIBLE_FROM = {PRODUCE: 9, LIST_OFFSETS: 6}  # compact strings and tagged fields from here on
TURN_TIMEOUT_S = 60.0  # a produce unanswered this long gives up its turn (its client timed out)
UPSTREAM_CONNECT_S = 5.0
_SIZE = struct.Struct(">i")
_LAST_OFFSET_DELTA_AT = 23  # in a v2 record batch: base offset, length, epoch, magic, crc, attrs
_MAGIC_AT = 16

Partition = tuple[str, int]


class ProtocolError(ValueError):
    """A frame too short or malformed to read what the proxy needs from it."""


class _Reader:
    """Reads the Kafka protocol's primitive types from ``data``, starting at ``at``."""

    def __init__(self, data: bytes | bytearray, at: int, flexible: bool) -> None:
        self.data, self.at, self.flexible = data, at, flexible

    def _take(self, size: int) -> int:
        start = self.at
        if size < 0 or start + size > len(self.data):
            raise ProtocolError("frame shorter than its fields")
        self.at += size
        return start

    def fixed(self, fmt: str) -> int:
        return int(struct.unpack_from(fmt, self.data, self._take(struct.calcsize(fmt)))[0])

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self._take(1)]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def _size(self, classic: str) -> int:
        """A string's, bytes' or array's length; -1 for null."""
        return self.varint() - 1 if self.flexible else self.fixed(classic)

    def string(self) -> str | None:
        size = self._size(">h")
        if size < 0:
            return None
        start = self._take(size)
        return bytes(self.data[start : start + size]).decode("utf-8", "replace")

    def classic_string(self) -> None:
        """Skip a non-compact nullable string (request headers' client id, in every version)."""
        self._take(max(self.fixed(">h"), 0))

    def blob(self) -> tuple[int, int]:
        """Where a nullable bytes field lies: (start, size); size -1 for null."""
        size = self._size(">i")
        return (self._take(size) if size >= 0 else self.at), size

    def array(self) -> int:
        return max(self._size(">i"), 0)

    def tags(self) -> None:
        if self.flexible:
            for _ in range(self.varint()):
                self.varint()
                self._take(self.varint())


def request_body(request: bytes) -> tuple[int, int, int, _Reader]:
    """A request's api key, version, correlation id and a reader at its body.

    Raises:
        ProtocolError: a frame too short to hold its header.
    """
    if len(request) < 8:
        raise ProtocolError("request shorter than its header")
    api_key, version, correlation = struct.unpack_from(">hhi", request, 0)
    flexible = version >= FLEXIBLE_FROM.get(api_key, 1 << 15)
    reader = _Reader(request, 8, flexible)
    reader.classic_string()  # client_id
    reader.tags()
    return api_key, version, correlation, reader


def records_count(data: bytes | bytearray, start: int, size: int) -> int | None:
    """Records in the v2 record batches of ``data[start:start + size]``; None for older formats."""
    count, at, end = 0, start, start + size
    while at + _LAST_OFFSET_DELTA_AT + 4 <= end:
        (length,) = _SIZE.unpack_from(data, at + 8)
        if data[at + _MAGIC_AT] != 2:
            return None
        (last_delta,) = _SIZE.unpack_from(data, at + _LAST_OFFSET_DELTA_AT)
        count += last_delta + 1
        at += 12 + length
    return count


@dataclass(frozen=True, slots=True)
class Produce:
    """What a produce request says: its acks and how many records it sends to each partition."""

    version: int
    acks: int
    counts: dict[Partition, int]


def read_produce(version: int, body: _Reader) -> Produce:
    """The body of a produce request (any version Tansu serves, 0-11).

    Raises:
        ProtocolError: a body shorter than its fields.
    """
    if version >= 3:
        body.string()  # transactional_id
    acks = body.fixed(">h")
    body.fixed(">i")  # timeout_ms
    counts: dict[Partition, int] = {}
    for _ in range(body.array()):
        topic = body.string() or ""
        for _ in range(body.array()):
            index = body.fixed(">i")
            start, size = body.blob()
            found = records_count(body.data, start, size) if size > 0 else None
            if found:
                counts[topic, index] = found
            body.tags()
        body.tags()
    return Produce(version, acks, counts)


def produce_bases(version: int, response: bytes) -> dict[Partition, int]:
    """The base offset the broker gave each partition of a produce (error-free ones only).

    Raises:
        ProtocolError: a response shorter than its fields.
    """
    body = _Reader(response, 4, version >= FLEXIBLE_FROM[PRODUCE])
    body.tags()  # response header v1
    bases: dict[Partition, int] = {}
    for _ in range(body.array()):
        topic = body.string() or ""
        for _ in range(body.array()):
            index, error, base = body.fixed(">i"), body.fixed(">h"), body.fixed(">q")
            if not error:
                bases[topic, index] = base
            if version >= 2:
                body.fixed(">q")  # log_append_time_ms
            if version >= 5:
                body.fixed(">q")  # log_start_offset
            if version >= 8:
                for _ in range(body.array()):  # record_errors
                    body.fixed(">i")
                    body.string()
                    body.tags()
                body.string()  # error_message
            body.tags()
        body.tags()
    return bases


def latest_asked(version: int, body: _Reader) -> set[Partition]:
    """The partitions whose end a ListOffsets request (v1 on) asks for.

    Raises:
        ProtocolError: a body shorter than its fields.
    """
    asked: set[Partition] = set()
    if version < 1:
        return asked
    body.fixed(">i")  # replica_id
    if version >= 2:
        body.fixed(">b")  # isolation_level
    for _ in range(body.array()):
        topic = body.string() or ""
        for _ in range(body.array()):
            index = body.fixed(">i")
            if version >= 4:
                body.fixed(">i")  # current_leader_epoch
            if body.fixed(">q") == LATEST:
                asked.add((topic, index))
            body.tags()
        body.tags()
    return asked


def correct_latest(
    version: int, response: bytes, asked: set[Partition], ends: dict[Partition, int]
) -> bytes:
    """``response`` with each asked partition's offset raised to the end this proxy saw written.

    Tansu answers "latest" with the base offset of the most recently stored batch
    plus one: short of the end when that batch holds several records.

    Raises:
        ProtocolError: a response shorter than its fields.
    """
    patched = bytearray(response)
    body = _Reader(patched, 4, version >= FLEXIBLE_FROM[LIST_OFFSETS])
    body.tags()  # response header v1
    if version >= 2:
        body.fixed(">i")  # throttle_time_ms
    for _ in range(body.array()):
        topic = body.string() or ""
        for _ in range(body.array()):
            index, error = body.fixed(">i"), body.fixed(">h")
            body.fixed(">q")  # timestamp
            at = body.at
            offset = body.fixed(">q")
            if version >= 4:
                body.fixed(">i")  # leader_epoch
            body.tags()
            end = ends.get((topic, index))
            if not error and (topic, index) in asked and end is not None and end > offset:
                struct.pack_into(">q", patched, at, end)
        body.tags()
    return bytes(patched)


class ProduceTurn:
    """One produce in flight to the broker at a time, across all connections.

    ``take`` waits for the turn; ``give_back`` ends it (its answer came, its
    connection closed, or it needed no answer). A turn held past
    ``TURN_TIMEOUT_S`` is given back: the broker is hung, and a client that
    waited that long has given up on the request.
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._holder: object | None = None
        self._expiry: asyncio.TimerHandle | None = None

    async def take(self, holder: object) -> None:
        await self._lock.acquire()
        self._holder = holder
        self._expiry = asyncio.get_running_loop().call_later(TURN_TIMEOUT_S, self.give_back, holder)

    def give_back(self, holder: object) -> None:
        if self._holder is holder and self._lock.locked():
            self._holder = None
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None
            self._lock.release()


@dataclass(slots=True)
class Shared:
    """What every connection shares: the produce turn and each partition's end as written."""

    turn: ProduceTurn = field(default_factory=ProduceTurn)
    ends: dict[Partition, int] = field(default_factory=dict)

    def produced(self, request: Produce, bases: dict[Partition, int]) -> None:
        for partition, base in bases.items():
            end = base + request.counts.get(partition, 0)
            if end > self.ends.get(partition, -1):
                self.ends[partition] = end


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next size-prefixed frame's body, None at a clean end of stream."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    (size,) = _SIZE.unpack(head)
    if size < 0:
        raise ProtocolError(f"negative frame size {size}")
    return await reader.readexactly(size)


class Connection:
    """One client connection and its own connection to the broker.

    Requests go up in order, responses come down in order (the protocol's
    rule on one connection); ``_pending`` remembers, by correlation id, the
    requests whose answers the proxy reads: produces (their base offsets) and
    ListOffsets asking for ends (corrected on the way down).
    """

    def __init__(
        self,
        shared: Shared,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self._shared = shared
        self._client_reader, self._client_writer = client
        self._upstream_reader, self._upstream_writer = upstream
        self._pending: dict[int, Produce | tuple[int, set[Partition]]] = {}

    async def requests(self) -> None:
        """Client to broker; a produce waits for the turn and keeps it until answered."""
        turn = self._shared.turn
        while (frame := await _read_frame(self._client_reader)) is not None:
            api_key, version, correlation, body = request_body(frame)
            produce = read_produce(version, body) if api_key == PRODUCE else None
            if produce is not None:
                await turn.take(self)
                if produce.acks != 0:
                    self._pending[correlation] = produce
            elif api_key == LIST_OFFSETS:
                asked = latest_asked(version, body)
                if asked:
                    self._pending[correlation] = (version, asked)
            self._upstream_writer.write(_SIZE.pack(len(frame)) + frame)
            await self._upstream_writer.drain()
            if produce is not None and produce.acks == 0:
                turn.give_back(self)

    async def responses(self) -> None:
        """Broker to client; a produce's answer gives the turn back, "latest" is corrected."""
        while (frame := await _read_frame(self._upstream_reader)) is not None:
            waiting = self._pending.pop(correlation_id(frame), None)
            if isinstance(waiting, Produce):
                self._shared.produced(waiting, produce_bases(waiting.version, frame))
                self._shared.turn.give_back(self)
            elif waiting is not None:
                version, asked = waiting
                frame = correct_latest(version, frame, asked, self._shared.ends)
            self._client_writer.write(_SIZE.pack(len(frame)) + frame)
            await self._client_writer.drain()

    def close(self) -> None:
        self._shared.turn.give_back(self)
        for writer in (self._client_writer, self._upstream_writer):
            writer.close()


def correlation_id(response: bytes) -> int:
    if len(response) < 4:
        raise ProtocolError("response shorter than its correlation id")
    return int(_SIZE.unpack_from(response, 0)[0])


async def _pump(connection: Connection) -> None:
    """Run both directions until either ends; then close both sockets."""
    tasks = [
        asyncio.ensure_future(connection.requests()),
        asyncio.ensure_future(connection.responses()),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, OSError, ValueError):
                await task
        connection.close()


async def serve(
    listen: tuple[str, int], upstream: tuple[str, int], broker_exited: asyncio.Event
) -> None:
    """Accept clients on ``listen`` and relay each to ``upstream`` until ``broker_exited``."""
    shared = Shared()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(UPSTREAM_CONNECT_S):
                up = await asyncio.open_connection(*upstream)
        except (OSError, TimeoutError):
            writer.close()  # the broker is down or restarting: as a refused connection would
            return
        for sock in (writer.get_extra_info("socket"), up[1].get_extra_info("socket")):
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await _pump(Connection(shared, (reader, writer), up))

    server = await asyncio.start_server(accept, *listen, reuse_address=True)
    async with server:
        await broker_exited.wait()


def _private_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run(listen: str, tansu: Sequence[str]) -> int:
    """Start Tansu behind ``listen`` and relay until it exits; its exit status."""
    host, port = listen.rsplit(":", 1)
    inner = f"127.0.0.1:{_private_port()}"
    argv = [
        *tansu,
        "--listener-url",
        f"tcp://{inner}",
        "--advertised-listener-url",
        f"tcp://{listen}",
    ]
    try:
        exited = asyncio.Event()
        broker = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
    except OSError as exc:
        print(f"broker_proxy: cannot start {argv[0]}: {exc}", file=sys.stderr, flush=True)
        return 1

    async def watch() -> int:
        code = await broker.wait()
        exited.set()
        return code

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, broker.send_signal, signum)
    watcher = asyncio.ensure_future(watch())
    inner_host, inner_port = inner.rsplit(":", 1)
    try:
        await serve((host, int(port)), (inner_host, int(inner_port)), exited)
    except OSError as exc:  # "Address in use", as Tansu says it: the stack retries on new ports
        taken = "Address in use: " if exc.errno == errno.EADDRINUSE else ""
        print(f"broker_proxy: {listen}: {taken}{exc}", file=sys.stderr, flush=True)
        broker.kill()
        await watcher
        return 1
    return await watcher


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        code = asyncio.run(run(args[0], args[1:]))
    else:
        code = uvloop.run(run(args[0], args[1:]))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
