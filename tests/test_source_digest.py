"""SourceDigest: the plain SHA-256 fed in order, the tree hash in any order, or nothing."""

from __future__ import annotations

import hashlib
import io
import random

from botocore.utils import calculate_tree_hash

from ingest.fetch.digest import Digests, SourceDigest
from ingest.settings import Settings


def settings(source_hash: str) -> Settings:
    return Settings("127.0.0.1:9092", "s3://out/", bytes(32), source_hash=source_hash)  # type: ignore[arg-type]


def test_sha256_is_that_of_the_pieces_in_order() -> None:
    digest = SourceDigest(settings("sha256"), 10, b"head")
    for start, piece in ((4, b"one"), (7, b"two")):
        digest.update(start, memoryview(piece))
    assert digest.enabled
    assert digest.in_order
    assert not digest.any_order
    assert digest.digests() == Digests(sha256=hashlib.sha256(b"headonetwo").hexdigest())


def test_the_tree_hash_takes_ranges_in_any_order() -> None:
    data = random.Random(1).randbytes(5 * 1024 * 1024 + 77)
    head = 300_000
    digest = SourceDigest(settings("sha256-tree"), len(data), data[:head])
    step = 1_500_001
    starts = list(range(head, len(data), step))[::-1]
    for start in starts:
        digest.update(start, memoryview(data)[start : start + step])
    assert digest.enabled
    assert digest.any_order
    assert not digest.in_order
    assert digest.digests() == Digests(sha256_tree=calculate_tree_hash(io.BytesIO(data)))


def test_none_hashes_nothing_and_says_so() -> None:
    digest = SourceDigest(settings("none"), 8, b"head")
    digest.update(4, memoryview(b"more"))
    assert not digest.enabled
    assert not digest.in_order
    assert not digest.any_order
    assert digest.digests() == Digests()
