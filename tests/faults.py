"""A fault-injecting HTTP proxy for S3, for reliability tests.

``FaultProxy`` is a real HTTP server (aiohttp.web) on a free loopback port that
forwards every request (method, raw path and query, headers, body) to an
upstream S3 server with an aiohttp client and streams the answer back. The
``Host`` header is forwarded unchanged: clients sign their requests (SigV4)
for the host they talk to, i.e. the proxy, and the upstream checks the
signature against the ``Host`` it receives, so credentials stay enforced.

A ``FaultPlan`` holds ``Rule`` s; each request is matched against them in
order and the first rule that fires decides the fault:

* ``Status``     answer an S3 error (XML body) instead of forwarding;
* ``Reset``      forward, send the headers and part of the body, then reset (RST);
* ``Stall``      hold the request (before the headers, or mid-body) past the
                 client's read timeout, then close;
* ``ShortBody``  send fewer body bytes than the answer declares and close
                 cleanly, or (``honest_length``) declare the short length too,
                 so the HTTP layer sees a well-formed, complete, short answer;
* ``Replace``    PUT new content under the key upstream first, then forward
                 (a GET with ``If-Match`` on the old ETag then gets a real 412).

Rules match on method, bucket, key glob and a regex on the ``Range`` header;
they can let the first ``skip`` matches through, fire ``times`` times (or
always), fire with a ``probability`` drawn from the plan's seeded RNG, and be
capped ``per_request`` (the same method, key and range). Injected faults are
counted by kind in ``FaultPlan.injected``; every request is logged in
``FaultPlan.requests``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import random
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

import aiohttp
from aiohttp import web
from yarl import URL

__all__ = [
    "Fault",
    "FaultPlan",
    "FaultProxy",
    "PutObject",
    "Replace",
    "RequestInfo",
    "Reset",
    "Rule",
    "ShortBody",
    "Stall",
    "Status",
]

# Headers that describe one hop, not the message; never forwarded as they are.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Expect",
    )
)
_CHUNK = 64 * 1024

PutObject = Callable[[str, str, bytes], Awaitable[None]]
"""``put(bucket, key, body)`` straight to the upstream: how ``Replace`` writes."""


# -- faults ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Status:
    """Answer an S3 error with this status and code instead of forwarding."""

    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."

    @property
    def kind(self) -> str:
        return f"{self.status} {self.code}"

    @classmethod
    def internal_error(cls) -> Status:
        return cls(500, "InternalError", "We encountered an internal error. Please try again.")

    @classmethod
    def slow_down(cls) -> Status:
        return cls(503, "SlowDown", "Please reduce your request rate.")

    @classmethod
    def access_denied(cls) -> Status:
        return cls(403, "AccessDenied", "Access Denied")


@dataclass(frozen=True, slots=True)
class Reset:
    """Send the headers and ``fraction`` of the body, then reset the connection (RST)."""

    fraction: float = 0.5

    @property
    def kind(self) -> str:
        return "reset"


@dataclass(frozen=True, slots=True)
class Stall:
    """Hold the answer ``seconds`` (then close): before the headers, or after ``fraction``."""

    seconds: float
    fraction: float | None = None

    @property
    def kind(self) -> str:
        return "stall" if self.fraction is None else "stall_mid_body"


@dataclass(frozen=True, slots=True)
class ShortBody:
    """Send ``fraction`` of the body and close; declare the full length unless ``honest_length``."""

    fraction: float = 0.5
    honest_length: bool = False

    @property
    def kind(self) -> str:
        return "short_body_declared" if self.honest_length else "short_body"


@dataclass(frozen=True, slots=True)
class Replace:
    """PUT ``bodies[n % len(bodies)]`` (n: this rule's firing count) upstream, then forward."""

    bodies: tuple[bytes, ...]

    @property
    def kind(self) -> str:
        return "replace"


Fault = Status | Reset | Stall | ShortBody | Replace


# -- matching -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request as the proxy saw it (path-style addressing: ``/bucket/key``)."""

    method: str
    bucket: str
    key: str
    range: str | None
    query: str
    at: float  # time.monotonic() when it arrived

    @property
    def identity(self) -> tuple[str, str, str, str | None]:
        return (self.method, self.bucket, self.key, self.range)


@dataclass(slots=True)
class Rule:
    """When and how to inject ``fault``. ``key`` is an fnmatch glob on the object key.

    ``range``: a regex searched in the ``Range`` header; ``""`` matches only
    requests without one. ``times=None`` fires on every eligible match.
    """

    fault: Fault
    method: str | None = "GET"
    key: str = "*"
    bucket: str | None = None
    range: str | None = None
    skip: int = 0
    times: int | None = 1
    probability: float = 1.0
    per_request: int | None = None
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)
    _per_request: Counter[tuple[str, str, str, str | None]] = field(
        default_factory=Counter, init=False, repr=False
    )

    def matches(self, request: RequestInfo) -> bool:
        if self.method is not None and request.method != self.method.upper():
            return False
        if self.bucket is not None and request.bucket != self.bucket:
            return False
        if not request.key or not fnmatch.fnmatchcase(request.key, self.key):
            return False
        if self.range is None:
            return True
        if self.range == "":
            return request.range is None
        return request.range is not None and re.search(self.range, request.range) is not None

    def fires(self, request: RequestInfo, rng: random.Random) -> bool:
        """Whether this rule injects its fault into ``request`` (updates the counts)."""
        if not self.matches(request):
            return False
        self.matched += 1
        if self.matched <= self.skip:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        identity = request.identity
        if self.per_request is not None and self._per_request[identity] >= self.per_request:
            return False
        if self.probability < 1.0 and rng.random() >= self.probability:
            return False
        self.fired += 1
        self._per_request[identity] += 1
        return True


class FaultPlan:
    """Rules, a seeded RNG for probabilistic ones, and what was injected."""

    def __init__(self, rules: Sequence[Rule] = (), *, seed: int = 0) -> None:
        self.rules: list[Rule] = list(rules)
        self.injected: Counter[str] = Counter()
        self.requests: list[RequestInfo] = []
        self.replaced: dict[tuple[str, str], bytes] = {}  # latest body PUT by Replace
        self._rng = random.Random(seed)

    def add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def choose(self, request: RequestInfo) -> tuple[Rule, Fault] | None:
        """Log ``request``; return the first rule that fires on it, with its fault."""
        self.requests.append(request)
        for rule in self.rules:
            if rule.fires(request, self._rng):
                self.injected[rule.fault.kind] += 1
                return rule, rule.fault
        return None

    def seen(self, method: str, key: str, bucket: str | None = None) -> list[RequestInfo]:
        """The requests with this method on this key (and bucket), in arrival order."""
        return [
            r
            for r in self.requests
            if r.method == method and r.key == key and (bucket is None or r.bucket == bucket)
        ]


# -- the proxy ------------------------------------------------------------------------------


def _error_body(fault: Status, resource: str, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(fault.code)}</Code><Message>{escape(fault.message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()


class FaultProxy:
    """The proxy. ``async with FaultProxy(upstream, plan) as proxy:`` then use ``proxy.url``.

    ``put_object`` is needed only by ``Replace`` rules. ``idle_timeout_s`` closes a
    client's keep-alive connection after that long without a request, as S3 servers
    do (SeaweedFS: 120 s; aiohttp's default: an hour). ``aclose`` stops the server
    (held handlers, e.g. stalls, are cancelled) and closes the client.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan,
        *,
        put_object: PutObject | None = None,
        idle_timeout_s: float = 3630.0,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.plan = plan
        self._put_object = put_object
        self._idle_timeout_s = idle_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._port = 0
        self._serial = 0

    @property
    def url(self) -> str:
        if not self._port:
            raise RuntimeError("the proxy is not running")
        return f"http://127.0.0.1:{self._port}"

    async def __aenter__(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        )
        try:
            # handler_cancellation: a client that gives up on a stall ends the handler.
            server = web.Server(
                self._handle, handler_cancellation=True, keepalive_timeout=self._idle_timeout_s
            )
            self._runner = web.ServerRunner(server, shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self._port = int(self._runner.addresses[0][1])
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        self._port = 0

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        bucket, _, key = request.path.lstrip("/").partition("/")
        info = RequestInfo(
            method=request.method,
            bucket=bucket,
            key=key,
            range=request.headers.get("Range"),
            query=request.query_string,
            at=time.monotonic(),
        )
        chosen = self.plan.choose(info)
        fault = chosen[1] if chosen else None
        if isinstance(fault, Status):
            return self._error(request, fault)
        if isinstance(fault, Stall) and fault.fraction is None:
            await asyncio.sleep(fault.seconds)
            _close(request, reset=False)
            return web.Response(status=500)  # never sent: the connection is gone
        if isinstance(fault, Replace) and chosen is not None:
            await self._replace(bucket, key, fault, chosen[0].fired - 1)
        return await self._forward(request, fault)

    def _error(self, request: web.BaseRequest, fault: Status) -> web.Response:
        self._serial += 1
        body = _error_body(fault, request.path, f"fault-{self._serial}")
        return web.Response(
            status=fault.status,
            body=body,
            headers={
                "Content-Type": "application/xml",
                "x-amz-request-id": f"fault-{self._serial}",
            },
        )

    async def _replace(self, bucket: str, key: str, fault: Replace, firing: int) -> None:
        if self._put_object is None:
            raise RuntimeError("a Replace rule needs FaultProxy(put_object=...)")
        body = fault.bodies[firing % len(fault.bodies)]
        await self._put_object(bucket, key, body)
        self.plan.replaced[(bucket, key)] = body

    async def _forward(self, request: web.BaseRequest, fault: Fault | None) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if request.headers.get("Expect", "").lower() == "100-continue":
            # the low-level server has no router to answer it; the client waits for it
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        async with self._session.request(
            request.method,
            URL(self.upstream + request.raw_path, encoded=True),
            headers=headers,  # with the client's Content-Length, the body streams through as is
            data=request.content if request.body_exists else None,
            allow_redirects=False,
        ) as upstream:
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
            }
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            if isinstance(fault, Reset | Stall | ShortBody):
                return await self._faulty_body(request, response, out_headers, upstream, fault)
            response.headers.update(out_headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(_CHUNK):
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _faulty_body(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        headers: dict[str, str],
        upstream: aiohttp.ClientResponse,
        fault: Reset | Stall | ShortBody,
    ) -> web.StreamResponse:
        data = await upstream.read()
        cut = int(len(data) * (fault.fraction if fault.fraction is not None else 0.0))
        if isinstance(fault, ShortBody) and fault.honest_length:
            headers["Content-Length"] = str(cut)
        elif "Content-Length" not in headers:
            headers["Content-Length"] = str(len(data))
        response.headers.update(headers)
        await response.prepare(request)
        if cut:
            await response.write(data[:cut])
        if isinstance(fault, Stall):
            await asyncio.sleep(fault.seconds)
        if isinstance(fault, ShortBody) and fault.honest_length:
            await response.write_eof()  # a complete, well-formed answer: only shorter
            return response
        _close(request, reset=isinstance(fault, Reset))
        return response  # aiohttp's write_eof on the closed transport is a no-op


def _close(request: web.BaseRequest, *, reset: bool) -> None:
    """End the connection: an RST (``reset``) or an orderly FIN after flushing."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    if reset:
        sock: Any = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    else:
        transport.close()
