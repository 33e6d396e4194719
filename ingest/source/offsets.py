"""Pure bookkeeping of which consumed offsets are finished and which may be committed.

At-least-once delivery with idempotent outputs: an offset is committed only
after everything its record announced is durable (output, result or
dead-letter record, audit record). Work finishes out of order, so the commit
point of a partition advances only over the *contiguous* run of finished
offsets at the front of what was consumed, in consumption order (Kafka offsets
need not be numerically contiguous: compaction and transaction markers leave
gaps).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

Partition = tuple[str, int]


@dataclass(slots=True)
class _PartitionLog:
    pending: OrderedDict[int, bool] = field(default_factory=OrderedDict)  # offset -> finished
    commit_point: int | None = None  # next offset to commit (last finished + 1)
    committed: int | None = None  # what Kafka last acknowledged
    first: int | None = None  # the first offset consumed since assignment (the group's position)


class OffsetTracker:
    """Tracks consumed offsets per partition; tells what may be committed."""

    def __init__(self) -> None:
        self._logs: dict[Partition, _PartitionLog] = {}

    def consumed(self, partition: Partition, offset: int) -> None:
        """Record an offset handed out by the consumer, not yet finished."""
        log = self._logs.setdefault(partition, _PartitionLog(first=offset))
        if offset in log.pending:
            return
        if log.pending and offset < next(reversed(log.pending)):
            raise ValueError(f"offset {offset} of {partition} consumed out of order")
        log.pending[offset] = False

    def finished(self, partition: Partition, offset: int) -> None:
        """Mark an offset finished; advance the commit point over the finished front."""
        log = self._logs.get(partition)
        if log is None or offset not in log.pending:
            return  # revoked meanwhile: its new owner will redo it, idempotently
        log.pending[offset] = True
        while log.pending:
            first, done = next(iter(log.pending.items()))
            if not done:
                break
            log.pending.popitem(last=False)
            log.commit_point = first + 1

    def to_commit(self) -> dict[Partition, int]:
        """Partitions whose commit point moved past what Kafka has; value = offset to commit."""
        return {
            p: log.commit_point
            for p, log in self._logs.items()
            if log.commit_point is not None and log.commit_point != log.committed
        }

    def committed(self, offsets: dict[Partition, int]) -> None:
        """Kafka acknowledged these commits."""
        for partition, offset in offsets.items():
            log = self._logs.get(partition)
            if log is not None:
                log.committed = offset

    def owes(self, partition: Partition) -> bool:
        """Whether the partition has consumed offsets not yet committed (unfinished, or
        finished and not yet acknowledged)."""
        log = self._logs.get(partition)
        return log is not None and (bool(log.pending) or log.commit_point != log.committed)

    def position(self, partition: Partition) -> int | None:
        """The group's position as this worker knows it (for lag): the last offset Kafka
        acknowledged a commit of, else the first offset consumed (None: nothing yet)."""
        log = self._logs.get(partition)
        if log is None:
            return None
        return log.committed if log.committed is not None else log.first

    def revoke(self, partitions: list[Partition]) -> None:
        """Forget partitions taken away by a rebalance."""
        for partition in partitions:
            self._logs.pop(partition, None)

    def in_flight(self, partition: Partition | None = None) -> int:
        """How many consumed offsets are not finished (all partitions when None)."""
        logs = self._logs.values() if partition is None else [self._logs.get(partition)]
        return sum(sum(1 for d in log.pending.values() if not d) for log in logs if log)
