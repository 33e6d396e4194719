"""``Publisher``'s enqueue-then-confirm path against a scripted producer (pure logic).

The broker itself (outages waited out, acks) is exercised with Tansu in
``tests/ingest/source/test_group.py`` and ``tests/system/test_chaos.py``; here, what a refusal at
enqueue time becomes: a retriable one a failed delivery that ``confirm`` sends
again under the retry policy, a definite one ``BrokerRejected`` at once.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from ingest.errors import BrokerRejected
from ingest.settings import Settings, load_settings
from ingest.source.kafka import Publisher

pytestmark = pytest.mark.anyio


def settings() -> Settings:
    return load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
            "DICOM_INGEST_RETRY_MAX_WAIT_S": "0.01",
        }
    )


class ScriptedProducer:
    """``send`` raises the scripted errors in turn, then hands out deliveries."""

    def __init__(self, refusals: list[Exception]) -> None:
        self.refusals = refusals
        self.enqueued: list[tuple[str, bytes, bytes | None]] = []
        self.sent: list[tuple[str, bytes, bytes | None]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        if self.refusals:
            raise self.refusals.pop(0)
        self.enqueued.append((topic, value, key))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self.refusals:
            raise self.refusals.pop(0)
        self.sent.append((topic, value, key))


async def test_a_retriable_refusal_is_sent_again_by_confirm() -> None:
    producer = ScriptedProducer([KafkaTimeoutError(), KafkaTimeoutError()])
    publisher = Publisher(producer, settings())
    delivery = await publisher.enqueue("results", b"v", b"k")
    assert delivery.done()
    assert isinstance(delivery.exception(), KafkaTimeoutError)
    await publisher.confirm(delivery, "results", b"v", b"k")  # one more refusal, retried
    assert producer.sent == [("results", b"v", b"k")]
    assert producer.enqueued == []


async def test_a_definite_refusal_is_raised_at_enqueue() -> None:
    producer = ScriptedProducer([MessageSizeTooLargeError()])
    publisher = Publisher(producer, settings())
    with pytest.raises(BrokerRejected, match="MessageSizeTooLarge"):
        await publisher.enqueue("results", b"v", b"k")


async def test_a_result_is_enqueued_and_confirmed() -> None:
    producer = ScriptedProducer([])
    publisher = Publisher(producer, settings())
    pending = await publisher.enqueue_result({"b": 1, "a": 2}, b"key")
    await publisher.confirm(*pending)
    assert producer.enqueued == [(settings().results_topic, b'{"a":2,"b":1}', b"key")]
    assert producer.sent == []


async def test_a_broker_that_accepts_and_never_answers_is_named_within_the_timeout() -> None:
    """A TLS listener spoken to in plaintext takes the connection and waits for a
    handshake that never comes: aiokafka alone fails after 40 s with no reason."""
    import time

    import anyio
    from anyio.abc import SocketStream

    from ingest.errors import BrokerError
    from ingest.source.kafka import make_consumer

    held: list[SocketStream] = []

    async def hold(stream: SocketStream) -> None:
        held.append(stream)
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, hold)
        s = load_settings(
            {
                "DICOM_INGEST_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
                "DICOM_INGEST_OUTPUT_URL": "s3://out/",
                "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
                "DICOM_INGEST_KAFKA_CONNECT_TIMEOUT_S": "1",
            }
        )
        started = time.monotonic()
        with pytest.raises(BrokerError) as raised:
            await make_consumer(s).start()
        took = time.monotonic() - started
        for stream in held:
            await stream.aclose()
        group.cancel_scope.cancel()
    message = str(raised.value)
    assert f"broker 127.0.0.1:{port} accepted the connection but did not answer within 1 s" in (
        message
    )
    assert "TLS listener spoken to in plaintext" in message
    assert held  # it did connect
    assert took < 5.0
