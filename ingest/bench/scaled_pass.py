"""Pure bookkeeping of a scaled run (``ingest/bench/scaled.py``): one pass's publish and
arrival times and the latencies made of them, and the watch over offsets the broker let
the bench's consumer skip."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from ingest.bench.measure import percentile


@dataclass(slots=True)
class GapWatch:
    """Seek back over offsets the broker let a live consumer skip.

    The offsets of a topic without transactions or compaction are contiguous, so
    a record past the next expected offset means one was skipped: Tansu alone, with
    several producers on one partition, lets a later batch be read before an
    earlier one is visible (``python -m ingest.bench.diagnostics.broker_skip raw``);
    the embedded stack's broker proxy prevents it, and the watch stays for a broker
    without one. ``check`` answers
    where to seek back to; a gap still there after ``patience`` seeks is
    accepted and counted in ``given_up``.
    """

    patience: int = 200  # seeks back to one gap; each waits for a fetch (~10 ms on Tansu)
    expected: dict[Any, int] = field(default_factory=dict)  # partition -> next offset
    tries: Counter[tuple[Any, int]] = field(default_factory=Counter)
    refetched: int = 0
    given_up: int = 0

    def check(self, partition: Any, offset: int) -> int | None:
        """None: take this record. Else the offset to seek back to (drop this record and
        the rest of its batch: they come again)."""
        want = self.expected.get(partition, offset)
        if offset > want:
            self.tries[partition, want] += 1
            if self.tries[partition, want] <= self.patience:
                self.refetched += 1
                return want
            self.given_up += 1
        self.expected[partition] = offset + 1
        return None


@dataclass(slots=True)
class ScaledPass:
    """One pass of a scaled run: when each object was published and its result arrived."""

    expected: int
    sent: dict[str, float] = field(default_factory=dict)
    sent_epoch: dict[str, float] = field(default_factory=dict)  # time.time() at the same moment
    partition_of: dict[str, int] = field(default_factory=dict)  # where each was published
    done: dict[str, float] = field(default_factory=dict)
    produced: dict[str, float] = field(default_factory=dict)  # the result record's timestamp
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    backends: Counter[str] = field(default_factory=Counter)  # "cuda" / "cpu", from the results
    finished: anyio.Event = field(default_factory=anyio.Event)

    def latencies_ms(self) -> list[float]:
        return [(self.done[k] - self.sent[k]) * 1000.0 for k in self.sent if k in self.done]

    def to_record_ms(self) -> list[float]:
        """Publish to the result record's own timestamp (the worker's producer stamps it,
        in ms): the latency without the bench's consumer fetching the record."""
        return [
            (self.produced[k] - self.sent_epoch[k]) * 1000.0
            for k in self.sent_epoch
            if k in self.produced
        ]

    def over_time(self, window_s: float = 0.5) -> list[list[float]]:
        """Arrival latency by when the object was published: per ``window_s``, rows of
        [window start (s from the first publish), objects, p50, p99, max (ms)]."""
        if not self.sent:
            return []
        first = min(self.sent.values())
        windows: dict[int, list[float]] = {}
        for k, t in self.sent.items():
            if k in self.done:
                windows.setdefault(int((t - first) / window_s), []).append(
                    (self.done[k] - t) * 1000.0
                )
        return [
            [
                round(w * window_s, 2),
                len(v),
                round(percentile(v, 50), 1),
                round(percentile(v, 99), 1),
                round(max(v), 1),
            ]
            for w, v in sorted(windows.items())
        ]

    def breakdown_ms(self) -> dict[str, float]:
        """Medians of the workers' own timings (from the result records), and of the rest."""
        rows = [(k, t) for k, t in self.timings.items() if k in self.done]
        names = sorted({n for _, t in rows for n in t})
        out = {
            n.removesuffix("_s") + "_ms": statistics.median(t.get(n, 0.0) * 1e3 for _, t in rows)
            for n in names
        }
        rest = [(self.done[k] - self.sent[k] - t.get("total_s", 0.0)) * 1e3 for k, t in rows]
        out["outside_process_object_ms"] = statistics.median(rest) if rest else 0.0
        return out
