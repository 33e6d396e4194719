"""``UrlSigner`` makes the URLs botocore's client makes, signature included.

No request is sent: presigning needs no server. With both clocks stopped at
the same instant, each URL is compared whole with the client's for the same
request (its query parameters as a set: botocore's signer from awscrt, which
it uses when awscrt is installed, as here, orders them differently), on the
configurations a worker meets (a loopback endpoint with path-style addressing,
AWS regions with virtual hosts, dotted bucket names, a session token, a default
and an explicit port, IPv6); shapes it does not know, and probes that
disagree, stay with the client. SeaweedFS verifying one of these URLs,
and refusing it with one signature character changed, is
``tests/ingest/fetch/test_s3.py::test_source_presigns_with_sigv4_that_the_server_verifies``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

import pytest
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from ingest.fetch.presign import UrlSigner

pytestmark = pytest.mark.anyio

EXPIRES_S = 3600
KEYS = [
    "series/slice-0001.dcm",
    "dir with space/é+x.dcm",
    "a b/c+d~e%f/ü//x/../y?z#w&v=1",
    "/leading-slash",
    "trailing/",
    "日本語/キー.dcm",
]
NOW = datetime(2026, 11, 21, 23, 59, 59, 999999, tzinfo=UTC)
CONFIGS = {
    "loopback-path": ("http://127.0.0.1:8333", "us-east-1", {"addressing_style": "path"}),
    "loopback-ipv6": ("http://[::1]:8333", "us-east-1", {"addressing_style": "path"}),
    "default-port": ("https://s3.example.org:443", "eu-central-1", {"addressing_style": "path"}),
    "aws-default": (None, "eu-west-1", {}),
    "aws-virtual": (None, "us-west-2", {"addressing_style": "virtual"}),
    "aws-us-east-1": (None, "us-east-1", {}),
}


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def stop_clocks(patch: pytest.MonkeyPatch, now: datetime) -> None:
    """botocore signs at ``now`` too: its own signer (naive UTC) and awscrt's (aware)."""
    patch.setattr("botocore.auth.get_current_datetime", lambda: now.replace(tzinfo=None))
    patch.setattr(
        "botocore.crt.auth.get_current_datetime",
        lambda remove_tzinfo=True: now.replace(tzinfo=None) if remove_tzinfo else now,
    )


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    stop_clocks(monkeypatch, NOW)


def same(ours: str, theirs: str) -> bool:
    """The same address and the same parameters, signature included, in any order."""
    (base, _, query), (their_base, _, their_query) = ours.partition("?"), theirs.partition("?")
    return base == their_base and sorted(parse_qsl(query)) == sorted(parse_qsl(their_query))


@asynccontextmanager
async def signer_for(
    config: str, clock: Callable[[], datetime] = lambda: NOW, **extra: Any
) -> AsyncIterator[tuple[UrlSigner, Any]]:
    endpoint, region, s3 = CONFIGS[config]
    session = get_session()
    aio = AioConfig(signature_version="s3v4", region_name=region, s3=s3, **extra)
    async with session.create_client("s3", endpoint_url=endpoint, config=aio) as client:
        credentials = await session.get_credentials()
        yield UrlSigner(client, credentials, EXPIRES_S, clock=clock), client


def untimed(url: str) -> tuple[str, list[tuple[str, str]]]:
    base, _, query = url.partition("?")
    timed = ("X-Amz-Date", "X-Amz-Signature")
    return base, sorted((k, v) for k, v in parse_qsl(query) if k not in timed)


async def both(
    signer: UrlSigner, client: Any, operation: str, params: dict[str, Any]
) -> tuple[str, str]:
    ours = await signer.presign(operation, params)
    theirs: str = await client.generate_presigned_url(operation, Params=params, ExpiresIn=EXPIRES_S)
    return ours, theirs


@pytest.mark.parametrize("config", sorted(CONFIGS))
async def test_urls_match_the_clients_whole(
    credentials: None, frozen_clock: None, config: str
) -> None:
    async with signer_for(config) as (signer, client):
        requests: list[tuple[str, dict[str, Any]]] = []
        part = {"UploadId": "u/+", "PartNumber": 7}
        for bucket in ("bucket-a", "dotted.bucket.name"):
            requests += [("get_object", {"Bucket": bucket, "Key": key}) for key in KEYS]
            requests += [
                ("get_object", {"Bucket": bucket, "Key": KEYS[1], "VersionId": "v 1/+="}),
                ("put_object", {"Bucket": bucket, "Key": KEYS[2], "ContentType": "text/json"}),
                ("upload_part", {"Bucket": bucket, "Key": KEYS[0], **part}),
                ("delete_object", {"Bucket": bucket, "Key": KEYS[3]}),
            ]
        for operation, params in requests:
            ours, theirs = await both(signer, client, operation, params)
            assert same(ours, theirs), (operation, params)
            assert "X-Amz-Signature=" in ours
        # one probe per bucket, operation and parameter names: 2 buckets x 5 shapes
        assert signer.by_client == 10


async def test_a_session_token_is_signed_in(
    credentials: None, frozen_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a/session+token==")
    async with signer_for("aws-default") as (signer, client):
        ours, theirs = await both(signer, client, "get_object", {"Bucket": "b", "Key": "k"})
        assert ("X-Amz-Security-Token", "a/session+token==") in untimed(ours)[1]
        assert same(ours, theirs)
        assert signer.by_client == 1


async def test_a_new_day_signs_with_that_days_key(credentials: None) -> None:
    """The signing key is kept per day: the next day's URL is the client's for that day."""
    today = [NOW]
    async with signer_for("loopback-path", clock=lambda: today[0]) as (signer, client):
        params = {"Bucket": "b", "Key": KEYS[1]}
        await signer.presign("get_object", params)  # learns the shape today
        for day in (NOW, NOW.replace(day=22, hour=0, minute=0, second=1)):
            today[0] = day
            with pytest.MonkeyPatch.context() as patch:
                stop_clocks(patch, day)
                ours, theirs = await both(signer, client, "get_object", params)
            assert same(ours, theirs)
            assert f"X-Amz-Date={day:%Y%m%dT%H%M%SZ}" in ours


async def test_unknown_shapes_and_empty_keys_stay_with_the_client(credentials: None) -> None:
    async with signer_for("loopback-path") as (signer, _):
        await signer.presign("head_object", {"Bucket": "b", "Key": "k"})
        await signer.presign("get_object", {"Bucket": "b", "Key": "k", "Range": "bytes=0-1"})
        assert signer.by_client == 2
        with pytest.raises(Exception, match="Key"):  # botocore's validation, not a bucket URL
            await signer.presign("get_object", {"Bucket": "b", "Key": ""})


class _Disagreeing:
    """A client whose URLs carry a parameter the signer would not add (an extension)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def generate_presigned_url(
        self, operation: str, Params: dict[str, Any], ExpiresIn: int
    ) -> str:
        url: str = await self.client.generate_presigned_url(
            operation, Params=Params, ExpiresIn=ExpiresIn
        )
        return url + "&x-extension=1"


async def test_a_probe_that_disagrees_keeps_the_client(credentials: None) -> None:
    async with signer_for("loopback-path") as (_, client):
        credentials = await get_session().get_credentials()
        signer = UrlSigner(_Disagreeing(client), credentials, EXPIRES_S)
        for n in range(3):
            url = await signer.presign("get_object", {"Bucket": "b", "Key": f"k{n}"})
            assert url.endswith("&x-extension=1")
        # twice for the probe (a date may turn between two signings), then once per URL
        assert signer.by_client == 2 + 3


async def test_without_credentials_the_client_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    async with signer_for("loopback-path") as (signer, _):
        with pytest.raises(Exception, match=r"[Cc]redentials"):
            await signer.presign("get_object", {"Bucket": "b", "Key": "k"})
