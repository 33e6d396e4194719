"""A worker's membership of its consumer group, joined before the rest of the worker starts.

A broker holds a join for a while: Kafka a new group's first join for
``group.initial.rebalance.delay.ms`` (3 s by default), Tansu every join until
half the session timeout has passed (docs/operations.md, "Start-up"). A
worker has work of its own to start meanwhile: importing its stages, the
device thread, the pinned ring, the S3 client, the producer, the audit trail.

So ``GroupMember.start`` only connects and subscribes. A consumer subscribed
before its ``start()`` waits there until it is assigned partitions; one
subscribed after runs the join in the background, and its first ``getmany``
waits for the assignment (aiokafka waits while a reassignment is in
progress). ``dicom-ingest worker`` starts the member before it imports the
worker's modules (in a thread, so the join's round trips go on); a ``Worker``
given no member starts one itself, first thing in ``run``.

Leaving: aiokafka 0.14 sends LeaveGroup only from generation 1 on, Kafka's
first; Tansu's first generation is 0, so a worker stopped in it stayed a member
until its session timed out, and a worker started again meanwhile waited for
that. ``start`` lets aiokafka's own leave run for generation 0 too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import structlog

from ingest.settings import Settings
from ingest.source.commits import Commits, Rebalance
from ingest.source.kafka import make_consumer

CLOSE_TIMEOUT_S = 10.0
log = structlog.get_logger("dicom_ingest.group")


class GroupMember:
    """The consumer of the source topic and the commits of its offsets: one worker's share."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.commits = Commits(settings.shutdown_deadline_s)
        self.consumer = self.commits.consumer = make_consumer(settings)
        self._started = False

    async def start(self) -> None:
        """Connect and subscribe; the group join goes on in the background. Idempotent.

        Raises:
            BrokerError: no broker answered, or it refused us (the consumer is closed again).
        """
        if self._started:
            return
        await self.consumer.start()
        self._started = True
        _leave_from_generation_zero(self.consumer._coordinator)
        listener = Rebalance(self.commits)
        self.consumer.subscribe([self.settings.source_topic], listener=listener)

    async def aclose(self) -> None:
        """Leave the group and close the consumer, within a bound, even when cancelled.

        Idempotent. Without the shield a cancelled worker would leave its
        consumer's heartbeat running: a zombie member that stalls the group's
        next rebalance.
        """
        with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            try:
                await self.consumer.stop()
            except asyncio.CancelledError:
                # aiokafka's stop passes on the cancellation of its own tasks (its group
                # coordinator's, when the broker is gone): the consumer is closed either
                # way. A cancellation of this task is kept; the shield holds the outer ones.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                log.warning("consumer closed with its broker unreachable")


def _leave_from_generation_zero(coordinator: Any) -> None:
    """Make aiokafka's LeaveGroup at close cover a member of generation 0 (Tansu's first).

    ``GroupCoordinator.close`` stops the heartbeat, then calls
    ``_maybe_leave_group``, which leaves only when ``generation > 0``; a
    LeaveGroup carries no generation, so counting 0 as 1 there changes nothing
    else. Kafka never hands out generation 0, so there it never applies.
    """
    leave = coordinator._maybe_leave_group

    async def maybe_leave_group() -> None:
        if coordinator.generation == 0 and coordinator._group_instance_id is None:
            coordinator.generation = 1
        await leave()

    coordinator._maybe_leave_group = maybe_leave_group
