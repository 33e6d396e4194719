"""Offset commits: the finished front of each partition, sent as offsets finish.

``Commits`` owns the ``OffsetTracker`` of one worker. Object tasks report a
record finished (``finished``); the commit loop then commits the contiguous
finished front of every assigned partition, coalescing bursts into one
commit and retrying each second while a commit is still owed. On a rebalance
the partitions being taken away get the shutdown deadline to finish, their
front is committed, and they are forgotten. A graceful stop finishes the held
work of every assigned partition (``stopping``) before the final commit:
aiokafka's close leaves the group without calling ``on_partitions_revoked``.

A commit once sent is never abandoned half way: it is shielded and bounded,
because aiokafka carries a cancelled commit on to the broker after we stopped
looking, and it would fail unheard if the consumer closed first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from aiokafka import ConsumerRebalanceListener

from ingest.errors import BrokerError
from ingest.source.kafka import commit
from ingest.source.offsets import OffsetTracker, Partition

log = structlog.get_logger("dicom_ingest.commits")
COMMIT_TIMEOUT_S = 10.0  # a commit is never abandoned half way, but not waited on forever
COALESCE_S = 0.05  # finished offsets arriving within this share one commit


class Commits:
    """The tracker of consumed and finished offsets, and the loop that commits them."""

    def __init__(self, revoke_deadline_s: float) -> None:
        self.tracker = OffsetTracker()
        self.consumer: Any = None  # set once the consumer exists, before ``loop`` starts
        self.count = 0  # commits that the broker acknowledged
        # per partition: the last acknowledged commit, or when it began to owe one (metrics)
        self.committed_at: dict[Partition, float] = {}
        self._revoke_deadline_s = revoke_deadline_s
        self._changed = anyio.Event()
        self._progress = anyio.Event()
        # given the partitions being taken away first: work held for them is finished
        # (series slices held in memory, SERIES_SLICES=hold) before their front is committed
        self.revoking: Callable[[list[Partition]], Awaitable[None]] | None = None

    def consumed(self, partition: Partition, offset: int) -> None:
        if not self.tracker.owes(partition):  # owing a commit starts now (commit age)
            self.committed_at[partition] = time.monotonic()
        self.tracker.consumed(partition, offset)

    def finished(self, partition: Partition, offset: int) -> None:
        """The record at ``offset`` is done for good: its outputs and records are durable."""
        self.tracker.finished(partition, offset)
        self._changed.set()

    def task_ended(self) -> None:
        """An object task ended, finished or not: a revocation waiting on it looks again."""
        self._progress.set()
        self._progress = anyio.Event()

    async def loop(self) -> None:
        """Commit when offsets finish; retry each second while a commit is still owed."""
        while True:
            with anyio.move_on_after(1.0 if self.tracker.to_commit() else math.inf):
                await self._changed.wait()
            self._changed = anyio.Event()
            await self.now()
            await anyio.sleep(COALESCE_S)

    async def now(self) -> None:
        """Commit the finished front of every assigned partition, shielded and bounded."""
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        offsets = {p: o for p, o in self.tracker.to_commit().items() if p in assigned}
        if not offsets:
            return
        with anyio.move_on_after(COMMIT_TIMEOUT_S, shield=True) as scope:
            try:
                await commit(self.consumer, offsets)
            except BrokerError as exc:
                log.warning("commit failed", error=str(exc))
                return
        if scope.cancelled_caught:
            log.warning("commit timed out", timeout_s=COMMIT_TIMEOUT_S)
            return
        self.tracker.committed(offsets)
        self.committed_at.update(dict.fromkeys(offsets, time.monotonic()))
        self.count += 1

    async def stopping(self) -> None:
        """A graceful stop, its objects drained: finish the work held for every assigned
        partition (``revoking``) so that the final commit covers it. The caller bounds it
        (the shutdown deadline); what is not finished is redone by the next owner."""
        if self.revoking is None:
            return
        assigned = [(tp.topic, tp.partition) for tp in self.consumer.assignment()]
        try:
            await self.revoking(assigned)
        except Exception as exc:  # what is not finished is redone by the next owner
            log.warning("held work not finished at stop", error=str(exc))

    async def on_revoked(self, revoked: list[Partition]) -> None:
        """Let in-flight work of partitions being taken away finish, commit it, forget them.

        Bounded by the deadline: what has not finished by then is redone by the
        partition's next owner (outputs are idempotent).
        """
        started = time.monotonic()
        with anyio.move_on_after(self._revoke_deadline_s) as deadline:
            if self.revoking is not None:
                try:
                    await self.revoking(revoked)
                except Exception as exc:  # what is not finished is redone by the next owner
                    log.warning("revoked work not finished", error=str(exc))
            while any(self.tracker.in_flight(p) for p in revoked):
                await self._progress.wait()
        waited = time.monotonic() - started
        await self.now()
        self.tracker.revoke(revoked)
        for partition in revoked:
            self.committed_at.pop(partition, None)
        if revoked:  # the group's rebalance waits for this member meanwhile
            log.info(
                "partitions revoked",
                partitions=sorted(p[1] for p in revoked),
                in_flight_s=round(waited, 3),
                commit_s=round(time.monotonic() - started - waited, 3),
                cut_off=deadline.cancelled_caught,
            )


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """aiokafka's rebalance callbacks, handed to ``Commits``."""

    def __init__(self, commits: Commits) -> None:
        self._commits = commits

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._commits.on_revoked([(tp.topic, tp.partition) for tp in revoked])

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))
