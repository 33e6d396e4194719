"""Sealing audit records in order and producing them to the audit topic.

Records are sealed (chained and encrypted) in order under one lock and queued;
the queue goes to the producer a group at a time, the next group only once the
last is acknowledged, so the order of the chain is the order of the topic, and a
record that the topic refuses goes to the spool with everything after it. The
records sealed while a group is on its way make the next group (a group commit):
many objects' records share one round trip to the broker, where one record a
round trip held every object in the worker behind the last one's acknowledgement
(one process then finished at most one object a round trip). The message key is
the worker id: one worker's chain lives in one partition, in the order it was
sealed. ``record`` returns once the record is acknowledged: by the broker, or,
when the topic does not answer within ``audit_ack_timeout_s`` and a spool is
configured, by the local spool (``spool.py``), from which ``run`` forwards it
later, in order. Only then may the worker commit the offset.

Under the sealing lock the publisher rotates data keys (``keys.py``: after
``audit_rotate_records`` records or ``audit_rotate_s`` seconds) and signs
digests of the chain head (``digest.py``: every ``audit_digest_records``
records, every ``audit_digest_s`` seconds from ``run`` even when no record
came, a heartbeat, and a final one at stop). A trail opens with an
``application.start`` record naming the worker's previous trail (and a
trail-made digest key, when the site gave none) and closes with
``application.stop`` and the final digest. With a spool, each acknowledged
group moves the worker id's ``trail.json`` (``spool.TrailState``) on, which
the next trail of the worker id continues from.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime

import anyio
import structlog
from anyio.abc import TaskStatus
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ingest.audit.digest import (
    DigestSigner,
    KmsSigner,
    LocalSigner,
    Previous,
    Signer,
    load_signing_key,
)
from ingest.audit.keys import KeySource, KmsClient, context, key_source, kms_public_key
from ingest.audit.records import AuditEvent, AuditTrail
from ingest.audit.spool import Spool, TrailState, orphans
from ingest.errors import IngestError, KeyServiceError
from ingest.settings import Settings
from ingest.source.kafka import Publisher, make_producer

log = structlog.get_logger("dicom_ingest.audit")
STOP_TIMEOUT_S = 10.0
# Messages a group at most. A process's objects in flight (64 by default) each wait for
# their audit record's round trip, so a group takes what one round trip can: 64 sealed
# records (2-3.5 KB each) go in a few of the producer's batches (``make_producer``)
MAX_GROUP = 64


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _app_event(event: str) -> AuditEvent:
    return AuditEvent(event, "success", "", "", None, None)


class AuditPublisher:
    """One worker's audit trail on its topic."""

    def __init__(
        self,
        trail: AuditTrail,
        publisher: Publisher,
        topic: str,
        worker_id: str,
        *,
        keys: KeySource | None = None,
        signer: DigestSigner | None = None,
        settings: Settings | None = None,
        spool: Spool | None = None,
        state: TrailState | None = None,
        orphaned: list[Spool] | None = None,
    ) -> None:
        self._trail = trail
        self._publisher = publisher
        self._topic = topic
        self._key = worker_id.encode()
        self._seal_lock = anyio.Lock()  # the chain's order
        self._send_lock = anyio.Lock()  # one group on its way at a time
        self._queued: list[bytes] = []  # sealed, not yet acknowledged, in chain order
        # per queued message: (seq, envelope head) of a record, or the hash of a digest
        self._marks: list[tuple[int, str] | str] = []
        self._state = state
        self._acked = Previous(trail.trail)  # how far this trail was acknowledged
        self._orphans = list(orphaned or ())
        self._acked_total = 0  # messages acknowledged so far (by the topic or the spool)
        self._keys = keys
        self._signer = signer
        self._spool = spool
        s = settings
        self._rotate = (s.audit_rotate_records, s.audit_rotate_s) if s else (1 << 20, 86_400.0)
        self._digest_every = (s.audit_digest_records, s.audit_digest_s) if s else (1000, 60.0)
        self._ack_timeout = s.audit_ack_timeout_s if s else 10.0
        self.rotations = 0

    @property
    def trail(self) -> AuditTrail:
        return self._trail

    @property
    def paused(self) -> bool:
        """Intake should wait: the spool is close to full."""
        return self._spool is not None and self._spool.paused

    async def record(self, event: AuditEvent) -> None:
        """Seal the record in order, then wait until its group is acknowledged.

        Raises:
            BrokerRejected: the broker refused the record for good (it stays queued,
                first in the next group).
            KeyServiceError: no data key could be had for a rotation.
        """
        async with self._seal_lock:
            if self._keys is not None and self._trail.needs_key(*self._rotate, time.monotonic()):
                ctx = context(self._trail.worker, self._trail.trail)
                self._trail.install(await self._keys.new_data_key(ctx))
                self.rotations += 1
            message = self._trail.seal(event)
            last_seq, _, head = self._trail.head
            through = self._queue(message, (last_seq, head))
            if self._signer is not None:
                uncovered = self._trail.next_seq - self._signer.covered
                if uncovered >= self._digest_every[0]:
                    try:
                        through = await self._sign()
                    except KeyServiceError as exc:  # KMS away: the next digest covers these
                        log.warning("audit digest not signed yet", error=type(exc).__name__)
        await self._flush(through)

    async def digest(self, *, final: bool = False) -> None:
        """Sign the chain head now (a heartbeat when no record came since the last
        digest; ``final`` at stop), and send what is queued."""
        async with self._seal_lock:
            if self._signer is not None and not self._signer.finished:
                await self._sign(final)
            through = self._acked_total + len(self._queued)
        await self._flush(through)

    def _queue(self, message: bytes, mark: tuple[int, str] | str) -> int:
        """Queue a sealed message; returns how many were ever queued, it included."""
        self._queued.append(message)
        self._marks.append(mark)
        return self._acked_total + len(self._queued)

    async def _flush(self, through: int) -> None:
        """Send the queue in order, ``MAX_GROUP`` messages a group, until the
        ``through``-th message ever queued is acknowledged. A group that fails stays
        queued, first, and the error is raised."""
        async with self._send_lock:
            while self._acked_total < through:
                group = self._queued[:MAX_GROUP]
                await self._send_all(group)
                marks = self._marks[: len(group)]
                del self._queued[: len(group)], self._marks[: len(group)]
                self._acked_total += len(group)
                self._acknowledged(marks)

    def _acknowledged(self, marks: list[tuple[int, str] | str]) -> None:
        """Move ``trail.json`` on past an acknowledged group."""
        acked = self._acked
        for mark in marks:
            if isinstance(mark, str):
                acked = dataclasses.replace(acked, digest=mark)
            else:
                acked = dataclasses.replace(acked, seq=mark[0], head=mark[1])
        self._acked = acked
        if self._state is not None:
            self._state.save(acked)

    async def _sign(self, final: bool = False) -> int:
        """Queue a digest of the chain head (under the seal lock); as ``_queue``."""
        assert self._signer is not None
        last_seq, chain_head, envelope_head = self._trail.head
        message = await self._signer.sign(last_seq, chain_head, envelope_head, _now(), final)
        return self._queue(message, self._signer.last_digest)

    async def _send_all(self, messages: list[bytes]) -> None:
        """Hand every message over in order (under the send lock) and wait for each."""
        if self._spool is not None and len(self._spool):
            for message in messages:  # behind what waits already: the topic keeps the order
                await self._spool.append(message)
            return
        if self._spool is None:
            sent = [await self._publisher.enqueue(self._topic, m, self._key) for m in messages]
            for delivery, message in zip(sent, messages, strict=True):
                await self._publisher.confirm(delivery, self._topic, message, self._key)
            return
        waiting = list(messages)
        with anyio.move_on_after(self._ack_timeout):  # a broker away may block even enqueue
            try:
                deliveries = [
                    await self._publisher.enqueue(self._topic, m, self._key) for m in messages
                ]
                for delivery in deliveries:
                    await delivery
                    waiting.pop(0)
            except Exception as exc:  # any failure: the spool takes it and what follows it
                log.warning("audit topic refused; spooling", error=type(exc).__name__)
        for message in waiting:
            await self._spool.append(message)  # wakes the forwarder

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Periodic digests and the spool's forwarder; runs until cancelled."""
        task_status.started()
        async with anyio.create_task_group() as group:
            if self._spool is not None:
                group.start_soon(self._forwarder)
            while True:
                await anyio.sleep(self._digest_every[1])
                try:
                    await self.digest()
                except IngestError as exc:  # the broker away: kept, sent before what follows
                    log.warning("audit digest not sent yet", error=type(exc).__name__)

    async def _forwarder(self) -> None:
        assert self._spool is not None
        for orphan in self._orphans:  # other worker ids' spools that no process holds
            while len(orphan):
                await self._forward_one(orphan, orphan.name.encode())
            orphan.let_go()
            log.info("audit spool of another worker id forwarded", spool=orphan.name)
        while True:
            await self._forward_one(self._spool, self._key)

    async def _forward_one(self, spool: Spool, key: bytes) -> None:
        """Send the spool's oldest message, keyed as its worker's; wait when refused."""
        message = await spool.next_to_forward()
        with anyio.move_on_after(self._ack_timeout):
            try:
                delivery = await self._publisher.enqueue(self._topic, message, key)
                await delivery
            except Exception as exc:  # still away: try again later
                log.info("audit topic still unavailable", error=type(exc).__name__)
            else:
                spool.drop_oldest()
                if not len(spool):
                    log.info("audit spool forwarded")
                return
        await anyio.sleep(min(1.0, self._ack_timeout))

    async def start(self) -> None:
        """The trail's first record, ``application.start``, naming the previous trail and
        announcing the digest key; the trail's first digest right after it."""
        if self._signer is not None:
            self._trail.add_to_next(
                signing_key=self._signer.public_key, previous_trail=self._signer.previous.trail
            )
        await self.record(_app_event("application.start"))
        await self.digest()

    async def stop(self) -> None:
        """``application.stop`` and the final digest, within a bound, even when cancelled."""
        with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
            await self.record(_app_event("application.stop"))
            await self.digest(final=True)


@asynccontextmanager
async def open_audit(settings: Settings, publisher: Publisher) -> AsyncIterator[AuditPublisher]:
    """The worker's audit trail: key source, trail, digest signer and spool, from settings.

    Records ``application.start`` on entry and ``application.stop`` plus a final
    digest on exit.

    Raises:
        ConfigError: a keyring, signing key or spool directory that cannot be used.
        KeyServiceError: KMS gave no data key.
    """
    s = settings
    async with AsyncExitStack() as stack:
        if s.audit_kafka_bootstrap:  # an audit cluster of its own: a producer of its own
            producer = make_producer(
                dataclasses.replace(s, kafka_bootstrap=s.audit_kafka_bootstrap)
            )
            await producer.start()
            stack.push_async_callback(producer.stop)
            publisher = Publisher(producer, s)
        yield await stack.enter_async_context(_open_audit(s, publisher))


@asynccontextmanager
async def _open_audit(s: Settings, publisher: Publisher) -> AsyncIterator[AuditPublisher]:
    ca = str(s.s3_ca_bundle) if s.s3_ca_bundle else None
    keys = key_source(
        s.audit_key,
        s.audit_key_id,
        s.audit_keyring_file,
        s.audit_kms_key_id,
        s.audit_kms_endpoint_url,
        ca,
    )
    signer: Signer | None = None
    spool, orphaned = None, []
    try:
        static = s.audit_key if s.audit_key else None
        trail = AuditTrail(static, s.audit_key_id, s.worker_id, s3_endpoint=s.s3_endpoint_url)
        state, previous = None, Previous()
        if s.audit_spool_dir is not None:
            spool = Spool(s.audit_spool_dir / s.worker_id, s.audit_spool_max_bytes)
            state = TrailState(s.audit_spool_dir / s.worker_id)
            previous = state.previous()
            orphaned = orphans(s.audit_spool_dir, s.worker_id, s.audit_spool_max_bytes)
        signer = await open_signer(s)
        digests = DigestSigner(signer, s.worker_id, trail.trail, previous, s.audit_digest_s)
        audit = AuditPublisher(
            trail,
            publisher,
            s.audit_topic,
            s.worker_id,
            keys=keys,
            signer=digests,
            settings=s,
            spool=spool,
            state=state,
            orphaned=orphaned,
        )
        await audit.start()
        try:
            yield audit
        finally:
            await audit.stop()
    finally:
        for held in [*orphaned, *([spool] if spool else [])]:
            held.let_go()
        with anyio.CancelScope(shield=True):
            await keys.aclose()
            if signer is not None:
                await signer.aclose()


async def open_signer(s: Settings) -> Signer:
    """The digests' signer the settings name: a KMS key, the site's key file, or (for
    development) a key made for this trail alone.

    Raises:
        ConfigError: the key file cannot be used.
        KeyServiceError: KMS did not give the signing key's public half.
    """
    if s.audit_signing_kms_key_id:
        ca = str(s.s3_ca_bundle) if s.s3_ca_bundle else None
        kms = KmsClient(s.audit_kms_endpoint_url, ca)
        try:
            arn, public = await kms_public_key(kms, s.audit_signing_kms_key_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await kms.aclose()
            raise
        return KmsSigner(kms, arn, public)
    if s.audit_signing_key_file is not None:
        return LocalSigner(load_signing_key(s.audit_signing_key_file))
    return LocalSigner(Ed25519PrivateKey.generate())
