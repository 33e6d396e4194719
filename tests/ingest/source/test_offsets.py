"""Commit bookkeeping: commits advance only over the finished front, per partition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.source.offsets import OffsetTracker

P = ("t", 0)


def test_commit_waits_for_the_earliest_unfinished() -> None:
    t = OffsetTracker()
    for o in (10, 11, 12):
        t.consumed(P, o)
    t.finished(P, 12)
    t.finished(P, 11)
    assert t.to_commit() == {}
    t.finished(P, 10)
    assert t.to_commit() == {P: 13}
    t.committed({P: 13})
    assert t.to_commit() == {}
    assert t.in_flight() == 0


def test_gaps_in_offsets_are_fine() -> None:
    t = OffsetTracker()
    for o in (3, 7, 20):
        t.consumed(P, o)
    t.finished(P, 3)
    t.finished(P, 7)
    assert t.to_commit() == {P: 8}


def test_revoked_partitions_are_forgotten() -> None:
    t = OffsetTracker()
    t.consumed(P, 1)
    t.revoke([P])
    t.finished(P, 1)  # late finish of revoked work: ignored
    assert t.to_commit() == {}


@given(st.permutations(list(range(30))), st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_commit_point_is_the_finished_prefix(order: list[int], how_many: int) -> None:
    t = OffsetTracker()
    for o in range(30):
        t.consumed(P, o)
    done = set(order[:how_many])
    for o in order[:how_many]:
        t.finished(P, o)
    prefix = 0
    while prefix in done:
        prefix += 1
    assert t.to_commit().get(P) == (prefix if prefix else None)
    assert t.in_flight() == 30 - how_many
