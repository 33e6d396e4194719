"""One page of a ListObjectsV2 answer, read: its keys and where the next page starts.

The sink lists a series' member records (hundreds to thousands of keys) on the
worker's hot path. botocore's parser builds a dict for every key, with its
ETag, size and a parsed LastModified, on the event loop; the sink needs only the
keys, so it reads them from the XML with ElementTree's C parser, on the
request's thread.

The sink asks for ``encoding-type=url`` (as botocore does), so a key that XML
1.0 cannot carry still arrives; an answer that says it is so encoded has its
keys decoded as botocore decodes them (``unquote_plus``), one that does not
(a server that ignores the parameter) is taken as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote_plus
from xml.etree import ElementTree


@dataclass(frozen=True, slots=True)
class Page:
    keys: list[str]
    next_token: str | None  # the continuation token; None on the last page


def parse_listing(body: bytes) -> Page:
    """The keys of one ListObjectsV2 answer, in its order, and its continuation token.

    Raises:
        ValueError: the body is not a ListBucketResult, or it is truncated without a
            continuation token (its keys could not all be listed).
    """
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        raise ValueError(f"the listing is not XML: {exc}") from exc
    space = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if root.tag != f"{space}ListBucketResult":
        raise ValueError(f"the listing's root is {root.tag!r}, not ListBucketResult")
    keys = [node.text or "" for node in root.iterfind(f"{space}Contents/{space}Key")]
    if root.findtext(f"{space}EncodingType") == "url":
        keys = [unquote_plus(key) for key in keys]
    if root.findtext(f"{space}IsTruncated", "").strip().lower() != "true":
        return Page(keys, None)
    token = root.findtext(f"{space}NextContinuationToken")
    if not token:
        raise ValueError("the listing is truncated without a continuation token")
    return Page(keys, token)
