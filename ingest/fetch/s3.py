"""Reading S3 objects: ranged GETs straight into ring slots, with retries.

An object is read without a HEAD. ``locate`` presigns one GET URL for it
(SigV4 query auth, by botocore's signer: ``presign.py``); ``read_first`` GETs
its first range and learns the object's size, ETag and version from the
answer (``Content-Range``, ``ETag``, ``x-amz-version-id``); every later
``read_into`` carries ``If-Match`` with that ETag, so a range can never mix
bytes of two versions: a replaced object answers 412, which becomes
``ObjectChanged``. The GETs run on keep-alive connections and receive the
body straight into the slot. One that fits a small slot (a CT slice, a large
object's header probe) runs on the event loop (``loop_http.py``); the others
run on ``fetch_concurrency`` threads (``threaded_http.py`` says how and why),
where a thread that finishes a range takes the next queued one without a
trip through the event loop. A cancelled read closes its connection (on a
thread: aborts its socket and waits for the thread), so a slot is never
written after it was given back.

Transient failures (5xx, throttling, timeouts, resets, a body cut short) are
retried by the policy of ``retry.py``. All foreign exceptions (botocore,
aiohttp, ``http.client``, sockets) are translated into ``ingest.errors`` in
one place, ``translate_s3_error``. The aiobotocore client stays for HEAD,
for the presigner's one probe per bucket and for the output sink's multipart
bookkeeping; botocore's own retries are off so our policy is the only one, and its
connection pool is sized to the concurrency (botocore's default of 10
silently caps parallel requests).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import aiohttp
import anyio
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from ingest.errors import (
    AccessDenied,
    IngestError,
    ObjectChanged,
    ObjectNotFound,
    SourceError,
    SourceUnavailable,
    TruncatedBody,
)
from ingest.fetch.http_answer import Answer, BodyCut, HttpStatusError
from ingest.fetch.loop_http import LoopGets
from ingest.fetch.planning import ByteRange
from ingest.fetch.presign import UrlSigner
from ingest.fetch.threaded_http import (
    ConnectionPool,
    Transfer,
    ca_bundle,
    get_into,
    put_from,
    request_whole,
)
from ingest.retry import with_retries
from ingest.settings import Settings

T = TypeVar("T")
# A presigned URL is a bearer credential: valid for minutes, which the slowest object read
# with it still fits (a URL that leaks into a log or a proxy's cache is soon worthless)
PRESIGN_EXPIRES_S = 15 * 60
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
}


@dataclass(frozen=True, slots=True)
class Presigned:
    """A presigned GET URL, with the object it was made for (for the HEAD after a 416)."""

    url: str
    bucket: str
    key: str
    version_id: str | None


@dataclass(frozen=True, slots=True)
class After(Generic[T]):
    """What a callable run after a GET returned or raised (raised again by ``value``)."""

    result: T | None
    error: Exception | None

    @classmethod
    def of(cls, then: Callable[[memoryview], T], data: memoryview) -> After[T]:
        try:
            return cls(then(data), None)
        except Exception as exc:  # not the GET's failure: raised after it, untranslated
            return cls(None, exc)

    def value(self) -> T | None:
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(frozen=True, slots=True)
class ObjectHead:
    size: int
    etag: str
    version_id: str | None


def translate_s3_error(exc: BaseException, what: str) -> IngestError:
    """Map a botocore/aiohttp/http.client/socket exception to our tree (the one place)."""
    if isinstance(exc, IngestError):
        return exc
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return _from_status(status, code, what)
    if isinstance(exc, HttpStatusError):
        return _from_status(exc.status, exc.code, what)
    if isinstance(exc, BodyCut | aiohttp.ClientPayloadError):
        return TruncatedBody(f"{what}: body cut short: {exc}")
    # anyio.fail_after and socket timeouts raise TimeoutError: retried like a reset.
    if isinstance(exc, BotoCoreError | aiohttp.ClientError | asyncio.TimeoutError | OSError):
        return SourceUnavailable(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


# What an operator should check for the codes that look alike from outside
_HINTS = {
    "InvalidAccessKeyId": ": the access key is unknown to this endpoint",
    "SignatureDoesNotMatch": ": the secret key does not match the access key",
    "NoSuchBucket": ": the bucket does not exist",
}


def _from_status(status: int, code: str, what: str) -> IngestError:
    if code in _TRANSIENT_CODES:  # before the status: S3 sends RequestTimeTooSkewed as 403
        return SourceUnavailable(f"{what}: S3 answered {status} {code}")
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion"):
        return ObjectNotFound(f"{what}: not found ({code or status}{_HINTS.get(code, '')})")
    if status == 403 or code in ("AccessDenied", "Forbidden", "InvalidAccessKeyId"):
        return AccessDenied(f"{what}: access denied ({code or status}{_HINTS.get(code, '')})")
    if status == 412 or code == "PreconditionFailed":
        return ObjectChanged(f"{what}: the object changed while it was read (412)")
    if status == 416 or code == "InvalidRange":
        return ObjectChanged(f"{what}: range past the end; the object shrank (416)")
    if (status >= 500 and status != 501) or status == 429:  # 501: not implemented, for good
        return SourceUnavailable(f"{what}: S3 answered {status} {code}")
    return SourceError(f"{what}: S3 answered {status} {code}".rstrip())


class S3Source:
    """Presigned ranged GETs (small ones on the event loop, the rest in threads), HEAD and
    presigning on one aiobotocore client; an async context manager (``aclose`` closes the
    client and the connections)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._stack = AsyncExitStack()
        self._client: Any = None
        self._signer: UrlSigner | None = None
        # ``fetch_concurrency`` GET threads for all objects bound the GETs in flight; a thread
        # that finishes a range takes the next queued one, as KvikIO's pool does (no permit
        # handed on through the loop). PUTs have twice as many threads of their own. Plain
        # executors: anyio's to_thread costs each CT slice more time on the loop.
        self._gets = ThreadPoolExecutor(settings.fetch_concurrency, "s3-get")
        self._puts = ThreadPoolExecutor(2 * settings.fetch_concurrency, "s3-put")
        self._pool = ConnectionPool(
            connect_timeout_s=min(10.0, settings.read_timeout_s),
            read_timeout_s=settings.read_timeout_s,
            ssl_context=ssl.create_default_context(cafile=ca_bundle(settings.s3_ca_bundle)),
        )
        # GETs that fit a small slot (a CT slice, a header probe) run on the event loop
        self._loop_gets = LoopGets(self._pool, settings.fetch_concurrency)

    async def __aenter__(self) -> S3Source:
        s = self._settings
        config = AioConfig(
            max_pool_connections=s.fetch_concurrency * 2 + s.max_objects_in_flight,
            connect_timeout=min(10.0, s.read_timeout_s),
            read_timeout=s.read_timeout_s,
            retries={"total_max_attempts": 1},
            # Presigned URLs use SigV4: botocore presigns with SigV2 unless told, which
            # AWS refuses for buckets created since June 2020 and in newer regions.
            signature_version="s3v4",
            # Outputs are not hashed twice more on the way out: no SHA-256 payload
            # signature, no CRC32 checksum unless an operation requires one.
            s3={"addressing_style": "path", "payload_signing_enabled": False}
            if s.s3_endpoint_url
            else {"payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            tcp_keepalive=True,
        )
        session = get_session()
        self._stack.callback(self._gets.shutdown)  # requests end before: see _in_thread
        self._stack.callback(self._puts.shutdown)
        self._stack.callback(self._pool.close)
        self._stack.callback(self._loop_gets.close)
        verify = ca_bundle(s.s3_ca_bundle)
        self._client = await self._stack.enter_async_context(
            session.create_client(
                "s3", endpoint_url=s.s3_endpoint_url, config=config, verify=verify
            )
        )
        # the credentials the client signs with: the session resolves them once
        credentials = await session.get_credentials()
        self._signer = UrlSigner(self._client, credentials, PRESIGN_EXPIRES_S)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stack.aclose()

    @property
    def client(self) -> Any:
        """The aiobotocore client (the sink writes outputs through the same pool)."""
        return self._client

    @property
    def connections_opened(self) -> int:
        """HTTP connections the GETs opened so far (keep-alive reuse keeps this low)."""
        return self._pool.opened + self._loop_gets.opened

    async def head(self, bucket: str, key: str, version_id: str | None) -> ObjectHead:
        """Size, ETag and version of the object, retried on transient failures.

        Raises:
            ObjectNotFound, AccessDenied, SourceUnavailable, SourceError
        """
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id:
            args["VersionId"] = version_id

        async def call() -> ObjectHead:
            try:
                with anyio.fail_after(self._settings.read_timeout_s):
                    resp = await self._client.head_object(**args)
            except Exception as exc:
                raise translate_s3_error(exc, "HEAD") from exc
            etag = str(resp.get("ETag", "")).strip('"')
            if not etag:
                raise SourceError("HEAD: the object has no ETag")
            return ObjectHead(int(resp["ContentLength"]), etag, resp.get("VersionId"))

        return await with_retries(self._settings, call)

    async def locate(self, bucket: str, key: str, version_id: str | None) -> Presigned:
        """A presigned GET URL for the object (the version given, or the current one).

        Raises:
            SourceError: no credentials, or the request could not be signed.
        """
        params: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id:
            params["VersionId"] = version_id
        url = await self.presign("get_object", **params)
        return Presigned(url, bucket, key, version_id)

    async def presign(self, operation: str, **params: Any) -> str:
        """A presigned URL for one request (the sink's PUTs).

        Raises:
            SourceError: no credentials, or the request could not be signed.
        """
        assert self._signer is not None, "use S3Source as an async context manager"
        try:
            url = await self._signer.presign(operation, params)
        except Exception as exc:
            raise translate_s3_error(exc, f"presign {operation}") from exc
        return url

    async def read_first(self, where: Presigned, into: memoryview) -> tuple[ObjectHead, int]:
        """GET the object's first ``len(into)`` bytes (or all of a smaller one) into ``into``.

        Returns the object's size, ETag and version as the answer told them,
        and how many bytes were written (``min(len(into), size)``). An empty
        object answers 416 to any range; a HEAD then confirms its size of 0.

        Raises:
            ObjectNotFound, AccessDenied, SourceUnavailable, TruncatedBody, SourceError
        """
        head, filled, _ = await self.read_first_then(where, into, None)
        return head, filled

    async def read_first_then(
        self, where: Presigned, into: memoryview, then: Callable[[memoryview], T] | None
    ) -> tuple[ObjectHead, int, T | None]:
        """``read_first``, and if the whole object came, ``then(its bytes)`` where the GET ran.

        A CT slice is read and parsed on the event loop (a GET of a small slot runs
        there); a larger whole object in the GET's thread, in one hand-off instead of
        two, as each hand-off costs the event loop time. The third
        value is what ``then`` returned, or None if the object is larger than
        ``into`` (or ``then`` is None). What ``then`` raises is raised here as it
        is, after the GET: it is neither retried nor taken for a failed GET.

        Raises:
            what ``read_first`` raises, and what ``then`` raises.
        """
        wanted = ByteRange(0, len(into))
        try:
            answer, after = await self._get(
                where.url, {"Range": wanted.http_range}, into, wanted.http_range, then
            )
        except ObjectChanged:  # 416: nothing at byte 0
            return await self._empty(where), 0, None
        if answer.start != 0 or answer.total is None or not answer.etag:
            raise SourceError(
                f"GET {wanted.http_range}: answered from byte {answer.start} of "
                f"{answer.total} with ETag {answer.etag!r}"
            )
        if answer.filled != min(len(into), answer.total):
            raise TruncatedBody(f"GET {wanted.http_range}: {answer.filled} bytes")
        head = ObjectHead(answer.total, answer.etag, answer.version_id)
        return head, answer.filled, after.value() if after is not None else None

    async def _empty(self, where: Presigned) -> ObjectHead:
        head = await self.head(where.bucket, where.key, where.version_id)
        if head.size != 0:
            raise ObjectChanged("GET bytes=0-: range past the end, yet the object is not empty")
        return head

    async def read_into(
        self,
        where: Presigned,
        head: ObjectHead,
        byte_range: ByteRange,
        into: memoryview,
        then: Callable[[memoryview], None] | None = None,
    ) -> None:
        """GET ``byte_range`` with ``If-Match`` and write it into ``into[:length]``, retried;
        ``then(the bytes)`` right after, on the GET's thread while they are still in cache.

        Raises:
            ObjectChanged: the ETag no longer matches (never retried here).
            TruncatedBody: after retries, the body kept ending early.
            ObjectNotFound, AccessDenied, SourceUnavailable, SourceError
        """
        headers = {"Range": byte_range.http_range, "If-Match": f'"{head.etag}"'}
        target = into[: byte_range.length]
        answer, after = await self._get(where.url, headers, target, headers["Range"], then, False)
        if after is not None:
            after.value()  # what ``then`` raised
        if answer.start != byte_range.start or answer.filled != byte_range.length:
            raise SourceError(
                f"GET {byte_range.http_range}: answered {answer.filled} bytes from {answer.start}"
            )

    async def _get(
        self,
        url: str,
        headers: dict[str, str],
        target: memoryview,
        what: str,
        then: Callable[[memoryview], T] | None,
        whole_only: bool = True,  # ``then`` only when the answer is the whole object
    ) -> tuple[Answer, After[T] | None]:
        async def call() -> tuple[Answer, After[T] | None]:
            try:
                return await self._get_once(url, headers, target, then, whole_only)
            except Exception as exc:
                raise translate_s3_error(exc, f"GET {what}") from exc

        return await with_retries(self._settings, call)

    async def _get_once(
        self,
        url: str,
        headers: dict[str, str],
        target: memoryview,
        then: Callable[[memoryview], T] | None,
        whole_only: bool,
    ) -> tuple[Answer, After[T] | None]:
        def after(answer: Answer) -> tuple[Answer, After[T] | None]:
            whole = answer.start == 0 and answer.total == answer.filled
            if then is None or (whole_only and not whole):
                return answer, None
            return answer, After.of(then, target[: answer.filled])

        parts = urlsplit(url)
        if self._loop_gets.serves(parts.scheme, parts.netloc, len(target)):
            return after(await self._loop_gets.get_into(url, headers, target))
        return await self._in_thread(
            self._gets, lambda transfer: after(get_into(self._pool, url, headers, target, transfer))
        )

    async def put_from(self, url: str, headers: dict[str, str], body: list[memoryview]) -> str:
        """One PUT of ``body`` (not joined) to a presigned URL, in a thread; the ETag.

        Not retried and not translated: the sink does both, as for its other calls.
        """
        return await self._in_thread(
            self._puts, lambda transfer: put_from(self._pool, url, headers, body, transfer)
        )

    async def request_whole(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        ok: tuple[int, ...],
        then: Callable[[bytes], T],
    ) -> T:
        """One request without a body to a presigned URL (the sink's listings, reads of its
        records, deletes), on the sink's threads; ``then(the answer's body)`` there too.

        Not retried and not translated: the sink does both, as for its PUTs.
        """
        return await self._in_thread(
            self._puts,
            lambda transfer: then(request_whole(self._pool, method, url, headers, ok, transfer)),
        )

    @staticmethod
    async def _in_thread(threads: ThreadPoolExecutor, work: Callable[[Transfer], T]) -> T:
        """Run one request on ``threads`` (queued while all are busy). On cancellation a
        queued request never starts, and one under way has its socket shut and its thread
        awaited, so the request never touches its memory after this returns."""
        transfer = Transfer()

        def run() -> T:
            if not transfer.begin():
                raise OSError("the request was cancelled before it began")
            return work(transfer)

        started = threads.submit(run)
        try:
            return await asyncio.wrap_future(started)
        except anyio.get_cancelled_exc_class():
            # A request not yet begun never will (its future is cancelled, or begin()
            # refuses); one under way ends soon with its socket shut: wait for it.
            if transfer.abort():
                with anyio.CancelScope(shield=True):
                    ending = asyncio.wrap_future(started)
                    await asyncio.wait([ending])
                if not ending.cancelled():
                    ending.exception()  # taken: the cancellation is what this raises
            raise
