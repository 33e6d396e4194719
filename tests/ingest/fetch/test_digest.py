"""SourceDigest: CRC64NVME or the tree hash in any order, SHA-256 in order, or nothing."""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import random

import pytest
from botocore.utils import calculate_tree_hash
from hypothesis import given
from hypothesis import strategies as st

from ingest.fetch.crc_digest import CrcDigest
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


def crc64nvme_reference(data: bytes) -> int:
    """CRC-64/NVME bit by bit from its definition (reflected polynomial 0x9A6C9329AC4BC9B5,
    all-ones initial value and final xor): independent of awscrt's table code."""
    crc = 0xFFFF_FFFF_FFFF_FFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x9A6C9329AC4BC9B5 if crc & 1 else 0)
    return crc ^ 0xFFFF_FFFF_FFFF_FFFF


def test_crc64nvme_is_the_catalogued_crc() -> None:
    assert crc64nvme_reference(b"123456789") == 0xAE8B14860A799888  # the catalogue's check
    digest = CrcDigest(9)
    digest.add(4, b"56789")
    digest.add(0, b"1234")
    assert digest.value() == 0xAE8B14860A799888
    assert base64.b64decode(digest.b64digest()) == (0xAE8B14860A799888).to_bytes(8, "big")


@given(st.binary(max_size=3000), st.lists(st.integers(0, 3000), max_size=6), st.randoms())
def test_crc64nvme_of_ranges_in_any_order_is_that_of_the_whole(
    data: bytes, cuts: list[int], rnd: random.Random
) -> None:
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    pieces = list(itertools.pairwise(bounds))
    rnd.shuffle(pieces)
    digest = SourceDigest(settings("crc64nvme"), len(data))
    for start, end in pieces:
        digest.update(start, memoryview(data)[start:end])
    assert digest.any_order
    assert digest.on_get_thread
    assert not digest.in_order
    want = base64.b64encode(crc64nvme_reference(data).to_bytes(8, "big")).decode()
    assert digest.digests() == Digests(crc64nvme=want)


def test_crc64nvme_names_missing_overlapping_and_outside_bytes() -> None:
    digest = CrcDigest(10)
    digest.add(0, b"abcd")
    with pytest.raises(ValueError, match=r"from 4 .* missing"):
        digest.value()
    digest.add(2, b"cdefghij")
    with pytest.raises(ValueError, match="twice"):
        digest.value()
    with pytest.raises(ValueError, match="outside"):
        digest.add(8, b"xyz")
