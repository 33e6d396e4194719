"""Presigned S3 URLs by the thousand: botocore's SigV4 signer, its request pipeline once per bucket.

A botocore client's ``generate_presigned_url`` runs the whole request pipeline
for every URL: endpoint rules, parameter validation, serialization and event
hooks, then the signature. A worker ingesting CT slices asks for a URL per
slice, on its event loop, and most of that work comes before the signature.

``UrlSigner`` asks the client once per bucket, operation and set of parameter
names for the URL of a probe, and learns from it what the pipeline decided: the
bucket's address (endpoint, path or virtual-host style) and the region and
service of the credential scope. It then builds its own URL for the same probe
and keeps the shortcut only if the two agree in every part but the time and the
signature. Each URL after that is the address plus the key, quoted as botocore
quotes it, signed as ``S3SigV4QueryAuth`` (the class the client itself presigns
S3 URLs with) signs it, by ``sigv4.presigned_url``: a URL costs less CPU than
with the class, and far less than through the client
(``.venv/bin/python -m ingest.bench.diagnostics.request_cost`` measures the
three). Where the probe does not agree (an extension adding parameters, another
signer) the client makes every URL of that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from botocore.utils import percent_encode

from ingest.fetch.sigv4 import Address, Keys, presigned_url

PROBE_KEY = "dicom-ingest/probe"
MAX_SHAPES = 4096  # cached shapes; past it the cache starts again (buckets are few)

# Operations we sign ourselves: HTTP method, and where each parameter goes.
_QUERY, _HEADER = "query", "header"
_OPERATIONS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "get_object": ("GET", {"VersionId": (_QUERY, "versionId")}),
    "put_object": ("PUT", {"ContentType": (_HEADER, "Content-Type")}),
    "upload_part": (
        "PUT",
        {"UploadId": (_QUERY, "uploadId"), "PartNumber": (_QUERY, "partNumber")},
    ),
    "delete_object": ("DELETE", {}),
}
_PROBE_VALUES: dict[str, object] = {
    "VersionId": "probe-version",
    "ContentType": "application/octet-stream",
    "UploadId": "probe-upload",
    "PartNumber": 1,
}
# Parts of a presigned URL that change with the time of signing.
_TIMED = ("X-Amz-Date", "X-Amz-Signature")


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the client's pipeline decided for one bucket, operation and parameter names."""

    prefix: Address  # scheme://host/path, up to where the quoted key goes
    region: str
    service: str


class UrlSigner:
    """Presigns S3 URLs for ``client`` (an aiobotocore client) with its ``credentials``.

    ``credentials`` are the session's (refreshable ones are read fresh for each
    URL); None makes every URL come from the client, which then raises as it would.
    """

    def __init__(
        self,
        client: Any,
        credentials: Any,
        expires_s: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._client = client
        self._credentials = credentials
        self._expires_s = expires_s
        self._clock = clock
        self._shapes: dict[tuple[str, str, tuple[str, ...]], _Shape | None] = {}
        self.by_client = 0  # URLs the client made (probes, shapes we do not sign)

    async def presign(self, operation: str, params: dict[str, Any]) -> str:
        """The presigned URL ``client.generate_presigned_url(operation, Params=params)`` gives.

        Raises what the client raises (no credentials, bad parameters).
        """
        bucket, key = params.get("Bucket"), params.get("Key")
        spec = _OPERATIONS.get(operation)
        extra = tuple(sorted(k for k in params if k not in ("Bucket", "Key")))
        if (
            spec is None
            or self._credentials is None
            or not isinstance(bucket, str)
            or not isinstance(key, str)
            # The client refuses an empty key; signed here, it would name the bucket.
            or not key
            or any(name not in spec[1] for name in extra)
        ):
            return await self._by_client(operation, params)
        index = (bucket, operation, extra)
        if index not in self._shapes:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            self._shapes[index] = await self._learn(operation, bucket, extra)
        shape = self._shapes[index]
        if shape is None:
            return await self._by_client(operation, params)
        return await self._sign(shape, operation, key, params)

    async def _by_client(self, operation: str, params: dict[str, Any]) -> str:
        self.by_client += 1
        url: str = await self._client.generate_presigned_url(
            operation, Params=params, ExpiresIn=self._expires_s
        )
        return url

    async def _learn(self, operation: str, bucket: str, extra: tuple[str, ...]) -> _Shape | None:
        """The shape of the client's URL for a probe of this bucket, if we make the same."""
        params: dict[str, Any] = {"Bucket": bucket, "Key": PROBE_KEY}
        params.update((name, _PROBE_VALUES[name]) for name in extra)
        for _ in range(2):  # twice: the credential scope's date may turn between the two
            theirs = await self._by_client(operation, params)
            base, _, query = theirs.partition("?")
            scope = dict(parse_qsl(query)).get("X-Amz-Credential", "").split("/")
            quoted = percent_encode(PROBE_KEY, safe="/~")
            if len(scope) != 5 or not base.endswith(quoted):
                return None
            prefix = Address.of(base[: -len(quoted)])
            shape = _Shape(prefix=prefix, region=scope[2], service=scope[3])
            ours = await self._sign(shape, operation, PROBE_KEY, params)
            if _untimed(ours) == _untimed(theirs):
                return shape
        return None

    async def _sign(self, shape: _Shape, operation: str, key: str, params: dict[str, Any]) -> str:
        method, places = _OPERATIONS[operation]
        query: list[tuple[str, str]] = []
        headers: dict[str, str] = {}
        for name, (place, wire) in places.items():
            if name in params:
                if place == _QUERY:
                    query.append((wire, str(params[name])))
                else:
                    headers[wire] = str(params[name])
        address = Address(
            shape.prefix.base, shape.prefix.path + percent_encode(key, safe="/~"), shape.prefix.host
        )
        frozen = await self._credentials.get_frozen_credentials()
        keys = Keys(frozen.access_key, frozen.secret_key, frozen.token)
        return presigned_url(
            method,
            address,
            query,
            headers,
            keys,
            shape.region,
            shape.service,
            self._expires_s,
            self._clock(),
        )


def _untimed(url: str) -> tuple[str, list[tuple[str, str]]]:
    """``url`` without what changes with the second it was signed in."""
    base, _, query = url.partition("?")
    return base, sorted((k, v) for k, v in parse_qsl(query) if k not in _TIMED)
