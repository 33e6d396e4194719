"""SigV4 query signing of a presigned S3 URL, as botocore's ``S3SigV4QueryAuth`` signs it.

``S3SigV4QueryAuth.add_auth`` is generic: it splits and re-joins the URL four
times, parses the query it was given back into a dict and derives the signing
key with four HMACs, once per URL, on the event loop of a worker that asks for
a URL per CT slice. ``UrlSigner`` signs only URLs it built itself (an address, a quoted key,
at most two query parameters, at most a Content-Type header), so this module
writes the same canonical request directly and keeps the day's signing key.
The tests compare its URLs with ``S3SigV4QueryAuth``'s, signature included,
at fixed times, for odd keys, every operation shape, session tokens, default
and explicit ports; SeaweedFS checks the signatures in the integration tests.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Final
from urllib.parse import quote, urlsplit

ALGORITHM: Final = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"
_SAFE: Final = "-_.~"  # botocore's SAFE_CHARS: what percent_encode leaves as it is
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Keys:
    access_key: str
    secret_key: str
    token: str | None = None


@dataclass(frozen=True, slots=True)
class Address:
    """The unsigned URL's parts: ``base`` (scheme://netloc) + ``path``, and the Host header."""

    base: str
    path: str
    host: str

    @classmethod
    def of(cls, url: str) -> Address:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal, as botocore's _host_from_url writes it
            host = f"[{host}]"
        if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
            host = f"{host}:{parts.port}"
        return cls(f"{parts.scheme}://{parts.netloc}", parts.path, host)


def presigned_url(
    method: str,
    address: Address,
    query: list[tuple[str, str]],
    headers: dict[str, str],
    keys: Keys,
    region: str,
    service: str,
    expires_s: int,
    now: datetime,
) -> str:
    """``address`` with ``query`` (decoded values, in order), signed for ``expires_s``.

    ``headers`` are signed too (and must be sent with the request); ``now`` is UTC.
    """
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    signed = {name.lower(): " ".join(value.split()) for name, value in headers.items()}
    signed["host"] = address.host
    names = sorted(signed)
    signed_headers = ";".join(names)
    params = [(_encode(k), _encode(v)) for k, v in query]
    auth = [
        ("X-Amz-Algorithm", ALGORITHM),
        ("X-Amz-Credential", f"{keys.access_key}/{scope}"),
        ("X-Amz-Date", stamp),
        ("X-Amz-Expires", str(expires_s)),
        ("X-Amz-SignedHeaders", signed_headers),
    ]
    if keys.token is not None:
        auth.append(("X-Amz-Security-Token", keys.token))
    params += [(_encode(k), _encode(v)) for k, v in auth]
    canonical = "\n".join(
        (
            method,
            address.path,
            "&".join(f"{k}={v}" for k, v in sorted(params)),
            "".join(f"{name}:{signed[name]}\n" for name in names),
            signed_headers,
            UNSIGNED_PAYLOAD,
        )
    )
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{digest}"
    key = _signing_key(keys.secret_key, stamp[:8], region, service)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    query_string = "&".join(f"{k}={v}" for k, v in params)
    return f"{address.base}{address.path}?{query_string}&X-Amz-Signature={signature}"


def _encode(text: str) -> str:
    """``text`` percent-encoded as botocore's ``percent_encode`` does; most of a URL's
    values (the algorithm, the date, the credential) need no escape at all, and
    ``quote`` walks every byte in Python."""
    return text if _UNRESERVED(text) else _quoted(text)


_UNRESERVED: Final = re.compile(r"[A-Za-z0-9_.~-]*").fullmatch


@lru_cache(maxsize=256)
def _quoted(text: str) -> str:
    return quote(text.encode(), safe=_SAFE)


@lru_cache(maxsize=64)
def _signing_key(secret_key: str, date: str, region: str, service: str) -> bytes:
    key = f"AWS4{secret_key}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key
