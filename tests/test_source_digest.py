"""SourceDigest: the SHA-256 of the pieces fed in order, or nothing when turned off."""

from __future__ import annotations

import hashlib

from ingest.settings import Settings
from ingest.source_digest import SourceDigest


def settings(source_hash: str) -> Settings:
    return Settings("127.0.0.1:9092", "s3://out/", bytes(32), source_hash=source_hash)  # type: ignore[arg-type]


def test_the_digest_is_that_of_the_pieces_in_order() -> None:
    digest = SourceDigest(settings("sha256"), b"head")
    for piece in (b"one", b"two"):
        digest.update(memoryview(piece))
    assert digest.enabled
    assert digest.hexdigest() == hashlib.sha256(b"headonetwo").hexdigest()


def test_none_hashes_nothing_and_says_so() -> None:
    digest = SourceDigest(settings("none"), b"head")
    digest.update(memoryview(b"more"))
    assert not digest.enabled
    assert digest.hexdigest() is None
