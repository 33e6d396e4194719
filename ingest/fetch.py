"""Reading S3 objects: HEAD, then ranged GETs straight into ring slots, with retries.

Every GET carries ``IfMatch`` with the ETag the HEAD returned, so a range can
never mix bytes of two versions: a replaced object answers 412, which becomes
``ObjectChanged``. Transient failures (5xx, throttling, timeouts, resets, a
body cut short) are retried by the policy of ``retry.py``; botocore's own
retries are off so that policy is the only one.

botocore exceptions are translated into ``ingest.errors`` in one place,
``translate_s3_error``. The aiohttp connection pool is sized to the fetch
concurrency (botocore's default of 10 silently caps parallel ranges).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

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
from ingest.planning import ByteRange
from ingest.retry import with_retries
from ingest.settings import Settings

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
class ObjectHead:
    size: int
    etag: str
    version_id: str | None


def translate_s3_error(exc: BaseException, what: str) -> IngestError:
    """Map a botocore/aiohttp/timeout exception to our tree (the one place that knows them)."""
    if isinstance(exc, IngestError):
        return exc
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _TRANSIENT_CODES:  # before the status: S3 sends RequestTimeTooSkewed as 403
            return SourceUnavailable(f"{what}: S3 answered {status} {code}")
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion"):
            return ObjectNotFound(f"{what}: not found ({code or status})")
        if status == 403 or code in ("AccessDenied", "Forbidden", "InvalidAccessKeyId"):
            return AccessDenied(f"{what}: access denied ({code or status})")
        if status == 412 or code == "PreconditionFailed":
            return ObjectChanged(f"{what}: the object changed while it was read (412)")
        if status == 416 or code == "InvalidRange":
            return ObjectChanged(f"{what}: range past the end; the object shrank (416)")
        if (status >= 500 and status != 501) or status == 429:  # 501: not implemented, for good
            return SourceUnavailable(f"{what}: S3 answered {status} {code}")
        return SourceError(f"{what}: S3 answered {status} {code}")
    if isinstance(exc, aiohttp.ClientPayloadError):  # the body ended before its length
        return TruncatedBody(f"{what}: body cut short: {exc}")
    # anyio.fail_after raises TimeoutError (== asyncio.TimeoutError): retried like a reset.
    if isinstance(exc, BotoCoreError | aiohttp.ClientError | asyncio.TimeoutError | OSError):
        return SourceUnavailable(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


class S3Source:
    """HEAD and ranged GETs on one aiobotocore client. An async context manager."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> S3Source:
        s = self._settings
        config = AioConfig(
            max_pool_connections=s.fetch_concurrency * 2 + s.max_objects_in_flight,
            connect_timeout=min(10.0, s.read_timeout_s),
            read_timeout=s.read_timeout_s,
            retries={"total_max_attempts": 1},
            # Outputs are not hashed twice more on the way out: no SHA-256 payload
            # signature, no CRC32 checksum unless an operation requires one.
            s3={"addressing_style": "path", "payload_signing_enabled": False}
            if s.s3_endpoint_url
            else {"payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            tcp_keepalive=True,
        )
        session = get_session()
        self._client = await self._stack.enter_async_context(
            session.create_client("s3", endpoint_url=s.s3_endpoint_url, config=config)
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stack.aclose()

    @property
    def client(self) -> Any:
        """The aiobotocore client (the sink writes outputs through the same pool)."""
        return self._client

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

    async def read_into(
        self, bucket: str, key: str, head: ObjectHead, byte_range: ByteRange, into: memoryview
    ) -> None:
        """GET ``byte_range`` with ``IfMatch`` and write it into ``into[:length]``, retried.

        Raises:
            ObjectChanged: the ETag no longer matches (never retried here).
            TruncatedBody: after retries, the body kept ending early.
            ObjectNotFound, AccessDenied, SourceUnavailable, SourceError
        """
        args: dict[str, Any] = {
            "Bucket": bucket,
            "Key": key,
            "Range": byte_range.http_range,
            "IfMatch": f'"{head.etag}"',
        }
        if head.version_id:
            args["VersionId"] = head.version_id
        target = into[: byte_range.length]

        async def call() -> None:
            try:
                await self._get_once(args, byte_range, target)
            except IngestError:
                raise
            except Exception as exc:
                raise translate_s3_error(exc, f"GET {byte_range.http_range}") from exc

        await with_retries(self._settings, call)

    async def _get_once(
        self, args: dict[str, Any], byte_range: ByteRange, target: memoryview
    ) -> None:
        with anyio.fail_after(self._settings.read_timeout_s):
            resp = await self._client.get_object(**args)
        body = resp["Body"]
        expected_range = f"bytes {byte_range.start}-{byte_range.end - 1}/"
        if not str(resp.get("ContentRange", expected_range)).startswith(expected_range):
            body.close()
            raise SourceError(f"GET {byte_range.http_range}: answered {resp.get('ContentRange')}")
        try:
            content = body.raw_stream.content
            filled = 0
            expected = byte_range.length
            while filled < expected:
                with anyio.fail_after(self._settings.read_timeout_s):
                    chunk = await content.readany()
                if not chunk:
                    break
                end = filled + len(chunk)
                if end > expected:
                    raise SourceError(f"GET {byte_range.http_range}: body longer than the range")
                target[filled:end] = chunk
                filled = end
        finally:
            body.close()
        if filled != expected:
            raise TruncatedBody(
                f"GET {byte_range.http_range}: body ended after {filled} of {expected} bytes"
            )
