"""ingest/sink/listing.py: ListObjectsV2 answers read to their keys and continuation token.

The answers are written as S3 writes them (namespaced, ``encoding-type=url``) and as a
server that ignores the encoding or the namespace would; the sink's listings against
SeaweedFS are in test_sink_requests.py.
"""

from __future__ import annotations

from urllib.parse import quote_plus

import pytest

from ingest.sink.listing import Page, parse_listing

S3 = "http://s3.amazonaws.com/doc/2006-03-01/"
ODD = ["a b/c+d.json", "x&y<z>.json", "日本/キー.json", "100%/é.json"]


def answer(
    keys: list[str],
    *,
    space: str | None = S3,
    encoded: bool = True,
    truncated: bool = False,
    token: str | None = None,
) -> bytes:
    def text(value: str) -> str:
        return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    contents = "".join(
        f"<Contents><Key>{text(quote_plus(k, safe='/') if encoded else k)}</Key>"
        "<LastModified>2026-11-27T14:00:00.000Z</LastModified><Size>3</Size></Contents>"
        for k in keys
    )
    xmlns = f' xmlns="{space}"' if space else ""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult{xmlns}><Name>b</Name>'
        f"<Prefix>p</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
        + ("<EncodingType>url</EncodingType>" if encoded else "")
        + f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
        + (f"<NextContinuationToken>{token}</NextContinuationToken>" if token else "")
        + f"{contents}</ListBucketResult>"
    ).encode()


@pytest.mark.parametrize("space", [S3, None])
@pytest.mark.parametrize("encoded", [True, False])
def test_keys_come_back_as_they_were_written(space: str | None, encoded: bool) -> None:
    assert parse_listing(answer(ODD, space=space, encoded=encoded)) == Page(ODD, None)


def test_a_truncated_page_names_the_next() -> None:
    page = parse_listing(answer(ODD[:2], truncated=True, token="tok/en+=="))
    assert page == Page(ODD[:2], "tok/en+==")
    assert parse_listing(answer([])) == Page([], None)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (answer(["k"], truncated=True), "without a continuation token"),
        (b"<Error><Code>AccessDenied</Code></Error>", "not ListBucketResult"),
        (b"<ListBucketResult><Contents>", "not XML"),
        (b"", "not XML"),
    ],
)
def test_what_is_not_a_whole_listing_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_listing(body)
