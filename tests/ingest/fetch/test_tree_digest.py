"""TreeDigest: the Glacier tree hash of bytes added in any order, against botocore's."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import itertools
import random

import pytest
from botocore.utils import calculate_tree_hash
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.fetch.tree_digest import LEAF_BYTES, TreeDigest

MiB = 1024 * 1024


def _data(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _cuts(size: int, draw_cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, size, *(c % (size + 1) for c in draw_cuts)})
    return list(itertools.pairwise(points))


@given(
    size=st.one_of(st.integers(0, 3 * MiB), st.sampled_from([MiB - 1, MiB, MiB + 1, 5 * MiB])),
    cuts=st.lists(st.integers(0, 10**9), max_size=12),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_any_cuts_in_any_order_give_botocores_tree_hash(
    size: int, cuts: list[int], seed: int
) -> None:
    data = _data(size, seed)
    ranges = _cuts(size, cuts)
    random.Random(seed).shuffle(ranges)
    digest = TreeDigest(size)
    for start, end in ranges:
        digest.add(start, memoryview(data)[start:end])
    assert digest.hexdigest() == calculate_tree_hash(io.BytesIO(data))


def test_from_many_threads_at_once() -> None:
    size = 37 * MiB + 12_345
    data = _data(size, 7)
    step = 3 * MiB + 999  # ranges that do not line up with the leaves
    ranges = [(s, min(s + step, size)) for s in range(0, size, step)]
    digest = TreeDigest(size)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: digest.add(r[0], memoryview(data)[r[0] : r[1]]), ranges[::-1]))
    assert digest.hexdigest() == calculate_tree_hash(io.BytesIO(data))


@pytest.mark.parametrize("size", [0, 1, 500_000, LEAF_BYTES])
def test_an_object_of_one_leaf_has_its_plain_sha256(size: int) -> None:
    data = _data(size, 3)
    digest = TreeDigest(size)
    if size:
        digest.add(0, data)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_no_bytes_add_nothing() -> None:
    data = _data(2 * MiB, 5)
    digest = TreeDigest(len(data))
    digest.add(MiB + 10, b"")  # inside a leaf: no piece that a later range would overlap
    digest.add(0, data)
    assert digest.hexdigest() == calculate_tree_hash(io.BytesIO(data))


def test_missing_bytes_are_refused() -> None:
    digest = TreeDigest(3 * MiB)
    digest.add(0, bytes(MiB + 10))
    digest.add(2 * MiB, bytes(MiB))
    with pytest.raises(ValueError, match="missing"):
        digest.hexdigest()


@pytest.mark.parametrize(
    ("first", "second"),
    [((0, MiB), (0, MiB)), ((0, MiB + 10), (MiB, 2 * MiB)), ((10, 20), (15, MiB))],
)
def test_bytes_added_twice_are_refused(first: tuple[int, int], second: tuple[int, int]) -> None:
    digest = TreeDigest(2 * MiB)
    digest.add(first[0], bytes(first[1] - first[0]))
    with pytest.raises(ValueError, match="twice"):
        digest.add(second[0], bytes(second[1] - second[0]))


def test_bytes_outside_the_object_are_refused() -> None:
    digest = TreeDigest(100)
    with pytest.raises(ValueError, match="outside"):
        digest.add(90, bytes(20))
    with pytest.raises(ValueError, match="negative"):
        TreeDigest(-1)
