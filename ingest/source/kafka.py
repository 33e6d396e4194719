"""The Kafka edge: the consumer of notifications and the producer of results, DLQ, audit.

aiokafka exceptions are translated into ``BrokerError`` here and nowhere else.
Produces are acknowledged by all in-sync replicas (``acks="all"``) and awaited,
because an offset may be committed only once what its record caused is
durable. A broker outage is waited out (retried until shutdown) rather than
turned into lost work; only a broker's definite refusal ends a send.
Auto-commit is off: ``worker.py`` commits through ``OffsetTracker``.
A client that fails to start is stopped again and its failure translated too
(``start_client``): a refused SASL login ends the worker with a ``BrokerError``
that names the mechanism and the user, never the password. A broker that
refuses or drops the first connections (one restarting) is tried again for
half of ``KAFKA_CONNECT_TIMEOUT_S`` first.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, NodeNotReadyError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from ingest.errors import BrokerError, BrokerRejected
from ingest.redact import scrub_text
from ingest.retry import with_retries
from ingest.settings import PREFIX, Settings
from ingest.source.offsets import Partition

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# A partition's records in one produce request at most (aiokafka's default is 16 KiB):
# a group of sealed audit records (``ingest.audit.publish.MAX_GROUP``) in two to four
MAX_BATCH_BYTES = 64 * 1024


def make_consumer(settings: Settings) -> AIOKafkaConsumer:
    """A member-to-be of ``group_id``, auto-commit off; ``group.GroupMember`` subscribes it."""
    return _Consumer(
        settings,
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=settings.group_id,
        client_id=f"dicom-ingest-{settings.worker_id}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.session_timeout_ms,
        heartbeat_interval_ms=settings.heartbeat_interval_ms,
        max_poll_interval_ms=settings.max_poll_interval_ms,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
        fetch_max_bytes=4 * MAX_MESSAGE_BYTES,
        **client_security(settings),
    )


def make_producer(settings: Settings) -> AIOKafkaProducer:
    return _Producer(
        settings,
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=f"dicom-ingest-{settings.worker_id}",
        acks="all",
        linger_ms=2,
        max_batch_size=MAX_BATCH_BYTES,
        max_request_size=MAX_MESSAGE_BYTES,
        **client_security(settings),
    )


def client_security(settings: Settings) -> dict[str, Any]:
    """TLS and SASL arguments of every aiokafka client the worker makes (docs/security.md).

    TLS verifies the broker's certificate and host name against the system CAs
    or ``kafka_ssl_cafile``; ``kafka_ssl_certfile``/``keyfile`` add a client
    certificate. There is no setting that turns verification off.
    """
    s = settings
    args: dict[str, Any] = {"security_protocol": s.kafka_security_protocol}
    if s.kafka_security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        args["ssl_context"] = create_ssl_context(
            cafile=str(s.kafka_ssl_cafile) if s.kafka_ssl_cafile else None,
            certfile=str(s.kafka_ssl_certfile) if s.kafka_ssl_certfile else None,
            keyfile=str(s.kafka_ssl_keyfile) if s.kafka_ssl_keyfile else None,
            password=s.kafka_ssl_key_password,
        )
    if s.kafka_security_protocol.startswith("SASL"):
        args |= {
            "sasl_mechanism": s.kafka_sasl_mechanism,
            "sasl_plain_username": s.kafka_sasl_username,
            "sasl_plain_password": s.kafka_sasl_password,
        }
    return args


class _Consumer(AIOKafkaConsumer):  # type: ignore[misc]  # aiokafka has no types
    """An ``AIOKafkaConsumer`` whose ``start`` fails as ``start_client`` says."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ingest_settings = settings

    async def start(self) -> None:
        await start_client(
            super().start, self.stop, self._ingest_settings, "consumer", self._client.bootstrap
        )


class _Producer(AIOKafkaProducer):  # type: ignore[misc]  # aiokafka has no types
    """An ``AIOKafkaProducer`` whose ``start`` fails as ``start_client`` says."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ingest_settings = settings

    async def start(self) -> None:
        await start_client(
            super().start, self.stop, self._ingest_settings, "producer", self.client.bootstrap
        )


_SCRAM_SERVER_ERROR = re.compile(r"e=[\w-]{1,64}")


async def start_client(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    settings: Settings,
    what: str,
    bootstrap: Callable[[], Awaitable[None]],
) -> None:
    """Start an aiokafka client; if that fails, stop it again and raise a ``BrokerError``.

    ``bootstrap`` (the client's first metadata request, which ``start`` repeats) is
    tried first, again while connections are refused or closed for half of
    ``kafka_connect_timeout_s``: a worker started while its broker restarts waits for
    it instead of exiting. The other half is left for an attempt that hangs, so its
    timeout is told apart from a refusal.

    aiokafka 0.14 hides a refused login in two ways: its bootstrap logs each
    broker's answer (``SaslAuthenticationFailed``, a closed connection) and
    raises only "Unable to bootstrap"; its SCRAM client reads an RFC 5802
    server error (``e=unknown-user``, ``e=invalid-proof``) as a final message
    without ``v`` and raises ``KeyError`` (a wrong server signature or nonce:
    ``ValueError``). The messages here name the protocol, mechanism and user,
    and the server's ``e=`` word when there is one; never the password.

    Raises:
        BrokerRejected: a SASL (SCRAM) exchange failed; retrying cannot help.
        BrokerError: no broker answered or let us in (retriable as aiokafka says).
    """
    s = settings
    sasl = s.kafka_security_protocol.startswith("SASL")
    login = f" ({s.kafka_security_protocol}"
    login += f" {s.kafka_sasl_mechanism} as {s.kafka_sasl_username!r})" if sasl else ")"
    try:
        with anyio.fail_after(s.kafka_connect_timeout_s):
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(KafkaConnectionError),
                wait=wait_random_exponential(multiplier=0.05, max=1.0),
                stop=stop_after_delay(s.kafka_connect_timeout_s / 2),
                reraise=True,
            ):
                with attempt:
                    await bootstrap()
            await start()
    except TimeoutError as exc:
        # A broker that accepts TCP and never answers: aiokafka would wait its request
        # timeout (40 s) and then say "Unable to bootstrap" with no reason.
        await stop()
        hint = (
            "; a TLS listener spoken to in plaintext does this: is KAFKA_SECURITY_PROTOCOL "
            "SSL or SASL_SSL there?"
            if s.kafka_security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT")
            else ""
        )
        raise BrokerError(
            f"{what} start{login}: broker {s.kafka_bootstrap} accepted the connection but did "
            f"not answer within {s.kafka_connect_timeout_s:g} s "
            f"({PREFIX}KAFKA_CONNECT_TIMEOUT_S){hint}"
        ) from exc
    except Exception as exc:
        await stop()
        if isinstance(exc, KafkaError):
            raise translate_kafka_error(exc, f"{what} start{login}") from exc
        if sasl and isinstance(exc, KeyError | ValueError):
            said = _scram_server_error(exc) or f"{type(exc).__name__} in the SASL exchange"
            raise BrokerRejected(f"{what} start{login}: login refused: {said}") from exc
        raise


def _scram_server_error(exc: BaseException) -> str | None:
    """The ``e=...`` word a broker ended a SCRAM exchange with, read from aiokafka's frame."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "process_server_final_message":
            said = tb.tb_frame.f_locals.get("server_final")
            if isinstance(said, str) and _SCRAM_SERVER_ERROR.fullmatch(said):
                return said
        tb = tb.tb_next
    return None


def translate_kafka_error(exc: KafkaError, what: str) -> BrokerError:
    """aiokafka's own ``retriable`` flag decides; timeouts and lost connections are retriable."""
    retriable = getattr(exc, "retriable", False) or isinstance(
        exc, KafkaTimeoutError | KafkaConnectionError | NodeNotReadyError
    )
    kind = BrokerError if retriable else BrokerRejected
    return kind(f"{what}: {type(exc).__name__}: {exc}")


def encode_json(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


class Publisher:
    """Sends to the results, dead-letter and audit topics; each send is awaited."""

    def __init__(self, producer: AIOKafkaProducer, settings: Settings) -> None:
        self._producer = producer
        self._settings = settings

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """Produce and wait for the acknowledgement, retried on retriable broker errors.

        Raises:
            BrokerError: the broker did not take the message.
        """

        async def call() -> None:
            try:
                await self._producer.send_and_wait(topic, value, key=key)
            except KafkaError as exc:
                raise translate_kafka_error(exc, f"produce to {topic}") from exc

        await with_retries(self._settings, call, forever=True)

    async def enqueue(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        """Hand a message to the producer without waiting for the broker; keeps send order.

        A retriable refusal (no metadata yet, the broker away) comes back as a
        failed delivery, which ``confirm`` sends again under the retry policy.

        Raises:
            BrokerRejected: the producer refused the message for good (too large...).
        """
        try:
            delivery: asyncio.Future[Any] = await self._producer.send(topic, value, key=key)
        except KafkaError as exc:
            error = translate_kafka_error(exc, f"produce to {topic}")
            if not error.retriable:
                raise error from exc
            delivery = asyncio.get_running_loop().create_future()
            delivery.set_exception(exc)
        return delivery

    async def confirm(
        self, delivery: asyncio.Future[Any], topic: str, value: bytes, key: bytes | None
    ) -> None:
        """Wait for an enqueued message; if it failed, send the same bytes again, retried."""
        try:
            await delivery
        except KafkaError:
            await self.send(topic, value, key)

    async def enqueue_result(
        self, document: Mapping[str, Any], key: bytes
    ) -> tuple[asyncio.Future[Any], str, bytes, bytes]:
        """``enqueue`` a result event; what ``confirm`` needs: (delivery, topic, value, key)."""
        topic, value = self._settings.results_topic, encode_json(document)
        return await self.enqueue(topic, value, key), topic, value, key

    async def dead_letter(self, document: Mapping[str, Any], key: bytes | None) -> None:
        """Send a dead letter; its ``error`` text is scrubbed of patient data and secrets."""
        if isinstance(document.get("error"), str):
            document = {**document, "error": scrub_text(document["error"])}
        await self.send(self._settings.dlq_topic, encode_json(document), key)


async def commit(consumer: AIOKafkaConsumer, offsets: Mapping[Partition, int]) -> None:
    """Commit offsets (next offset to read) for partitions.

    Raises:
        BrokerError: the commit failed (e.g. the partitions were rebalanced away).
    """
    try:
        await consumer.commit(
            {TopicPartition(t, p): OffsetAndMetadata(o, "") for (t, p), o in offsets.items()}
        )
    except KafkaError as exc:
        raise translate_kafka_error(exc, "commit") from exc


async def read_records(
    bootstrap: str,
    topic: str,
    *,
    client: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
    missing_ok: bool = False,
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of a topic, partition by partition, from the beginning to the end it
    has now (no group). Whole batches are kept: Tansu's end offset can stop inside its
    last batch. ``client``: TLS/SASL arguments (``client_security``); ``missing_ok``: a
    topic with no partitions known reads as empty (else partition 0 is read).

    Raises:
        BrokerError: the broker could not be read within ``timeout_s``.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, **dict(client or {})
    )
    try:
        with anyio.fail_after(timeout_s):
            await consumer.start()
            await consumer.topics()  # loads the metadata partitions_for_topic reads
            known = consumer.partitions_for_topic(topic)
            if not known and missing_ok:
                return []
            parts = [TopicPartition(topic, p) for p in sorted(known or {0})]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            ends = await consumer.end_offsets(parts)
            records: list[ConsumerRecord[bytes, bytes]] = []
            for tp in parts:
                while await consumer.position(tp) < ends[tp]:
                    batch = await consumer.getmany(tp, timeout_ms=1000)
                    records += [r for rs in batch.values() for r in rs]
            return records
    except (KafkaError, TimeoutError) as exc:
        raise BrokerError(f"reading {topic}: {type(exc).__name__}: {exc}") from exc
    finally:
        await consumer.stop()


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[bytes]:
    """Every message value of a topic (``read_records``).

    Raises:
        BrokerError: the broker could not be read within ``timeout_s``.
    """
    records = await read_records(bootstrap, topic, timeout_s=timeout_s)
    return [r.value for r in records]
