"""Sealing audit records in order and producing them to the audit topic.

Records are sealed (chained and encrypted) and handed to the producer under
one lock, so the order of the chain is the order of the topic. The message
key is the worker id: one worker's chain lives in one partition, in the order
it was sealed. ``record`` returns once the broker has acknowledged the record.
"""

from __future__ import annotations

import anyio

from ingest.audit.records import AuditEvent, AuditTrail
from ingest.source.kafka import Publisher


class AuditPublisher:
    """One worker's audit trail on its topic."""

    def __init__(self, trail: AuditTrail, publisher: Publisher, topic: str, worker_id: str) -> None:
        self._trail = trail
        self._publisher = publisher
        self._topic = topic
        self._key = worker_id.encode()
        self._lock = anyio.Lock()

    async def record(self, event: AuditEvent) -> None:
        """Seal and enqueue under the lock, then wait for the broker's acknowledgement.

        Raises:
            BrokerRejected: the broker refused the record for good.
        """
        async with self._lock:
            envelope = self._trail.seal(event)
            delivery = await self._publisher.enqueue(self._topic, envelope, self._key)
        await self._publisher.confirm(delivery, self._topic, envelope, self._key)
