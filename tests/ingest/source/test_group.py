"""Reliability of the consumer side against the real broker: slow work, rebalances, outages."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

import ingest.pipeline.process
import ingest.source.commits
import ingest.worker
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack, embedded_stack, start_tansu
from ingest.pipeline.jobs import Context
from ingest.sink.records import Processed
from ingest.source.group import GroupMember
from ingest.source.kafka import make_consumer, make_producer
from ingest.source.notifications import ObjectRef
from ingest.worker import Outcome, Worker
from tests import harness

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("aws_environment"),
]


async def publish_slices(stack: Stack, names: harness.Names, count: int) -> list[str]:
    slices = synthetic_ct_series(count, rows=32, columns=32)
    await harness.upload(stack, names.source_bucket, slices)
    keys = [key for key, _ in slices]
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in keys],
    )
    return keys


async def test_work_slower_than_the_poll_interval_keeps_the_member_and_its_commits(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    keys = await publish_slices(stack, names, 3)
    real = ingest.pipeline.process.process_object  # the worker's name for it is patched below

    async def slow(ctx: Context, ref: ObjectRef) -> Processed:
        await anyio.sleep(2.0)  # twice the max poll interval below
        return await real(ctx, ref)

    monkeypatch.setattr(ingest.worker, "process_object", slow)
    settings = harness.make_settings(
        stack, names, max_poll_interval_ms="1000", max_objects_in_flight="1"
    )
    assignments: list[int] = []
    original = ingest.source.commits.Rebalance.on_partitions_assigned

    async def counting(self: ingest.source.commits.Rebalance, assigned: object) -> None:
        assignments.append(1)
        await original(self, assigned)

    monkeypatch.setattr(ingest.source.commits.Rebalance, "on_partitions_assigned", counting)
    run = await harness.run_worker(settings, stop_after=len(keys))
    assert sorted(harness.keys_of(run.outcomes)) == sorted(keys)
    assert len(assignments) == 1  # never evicted, so never re-assigned
    assert await harness.committed_offset(stack, names.group, names.source_topic) == len(keys)


async def test_two_workers_one_joins_late_one_leaves_nothing_lost(stack: Stack) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names, partitions=2)
    keys = await publish_slices(stack, names, 40)
    settings_a = harness.make_settings(stack, names, worker_id="a", max_objects_in_flight="2")
    settings_b = harness.make_settings(stack, names, worker_id="b", max_objects_in_flight="2")
    outcomes: list[Outcome] = []
    enough = anyio.Event()
    all_done = anyio.Event()

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) >= 10:
            enough.set()
        if {o.ref.key for o in outcomes if o.ref} >= set(keys):
            all_done.set()

    worker_a = Worker(settings_a, record)
    worker_b = Worker(settings_b, record)
    async with anyio.create_task_group() as group:
        group.start_soon(worker_a.run)
        await enough.wait()
        group.start_soon(worker_b.run)  # joins late: the group rebalances
        await anyio.sleep(3)
        worker_a.stop()  # leaves: b takes both partitions
        await all_done.wait()
        worker_b.stop()
    processed = {o.ref.key for o in outcomes if o.ref and o.processed}
    assert processed == set(keys)  # nothing lost; duplicates (if any) wrote the same outputs
    assert {o.processed.output_key for o in outcomes if o.processed} == {
        f"out/{names.source_bucket}/{k}.npy" for k in keys
    }
    assert await group_lag(stack, names, partitions=2) == 0  # every offset committed


async def group_lag(stack: Stack, names: harness.Names, partitions: int) -> int:
    """Messages not yet committed by the group, over all partitions."""
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.kafka.bootstrap, group_id=names.group)
    await consumer.start()
    try:
        parts = [TopicPartition(names.source_topic, p) for p in range(partitions)]
        ends = await consumer.end_offsets(parts)
        lag = 0
        for tp in parts:
            lag += ends[tp] - int(await consumer.committed(tp) or 0)
        return lag
    finally:
        await consumer.stop()


@pytest.fixture
def durable_stack(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """A stack of its own whose broker keeps its log in S3, so it survives a kill."""
    with embedded_stack(durable_broker=True) as running:
        for name, value in running.endpoints.environment().items():
            monkeypatch.setenv(name, value)
        yield running


def readyz(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_broker_killed_and_restarted_mid_run(durable_stack: Stack) -> None:
    stack = durable_stack
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    keys = await publish_slices(stack, names, 30)
    settings = harness.make_settings(
        stack,
        names,
        health_port=str(_free_port()),
        health_host="127.0.0.1",
        max_objects_in_flight="2",
    )
    outcomes: list[Outcome] = []
    halfway = anyio.Event()
    finished = anyio.Event()

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == 8:
            halfway.set()
        if {o.ref.key for o in outcomes if o.ref} >= set(keys):
            finished.set()

    worker = Worker(settings, record)
    statuses: list[int] = []
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await halfway.wait()
        assert worker.health_port is not None
        stack.kafka.kill()
        with anyio.fail_after(60):  # the outage shows on /readyz while it lasts
            while True:
                status, body = await anyio.to_thread.run_sync(readyz, worker.health_port)
                problems = body.get("problems")
                if (
                    status == 503
                    and isinstance(problems, list)
                    and any("broker" in str(p) for p in problems)
                ):
                    statuses.append(status)
                    break
                await anyio.sleep(0.5)
        stack.kafka.restart()
        with anyio.fail_after(120):
            await finished.wait()
        with anyio.fail_after(30):
            # polling an HTTP endpoint: the state lives in another server, no Event to wait on
            while (await anyio.to_thread.run_sync(readyz, worker.health_port))[0] != 200:  # noqa: ASYNC110
                await anyio.sleep(0.5)
        worker.stop()
    assert statuses == [503]
    assert {o.ref.key for o in outcomes if o.ref and o.processed} == set(keys)
    results = await harness.read_json_topic(stack, names.results_topic)
    assert {r["source"]["key"] for r in results} == set(keys)  # no loss
    assert await harness.committed_offset(stack, names.group, names.source_topic) == len(keys)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_repeat_is_not_committed_before_the_object_it_repeats_finished(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same object version announced on two partitions (S3 repeats notifications).

    The repeat must not finish (so its partition must not commit) while the
    original is still in flight: if the original's offset were lost to a
    rebalance, a crash then would lose the object.
    """
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names, partitions=2)
    [(key, data)] = synthetic_ct_series(1, rows=32, columns=32)
    await harness.upload(stack, names.source_bucket, [(key, data)])
    record = json.loads(harness.aws_notification(names.source_bucket, [key]))
    record["Records"][0]["s3"]["object"]["eTag"] = harness.md5(data)
    message = json.dumps(record).encode()
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        for partition in (0, 1):
            await producer.send_and_wait(names.source_topic, message, partition=partition)
    finally:
        await producer.stop()
    release = anyio.Event()
    started = anyio.Event()
    real = ingest.pipeline.process.process_object  # the worker's name for it is patched below

    async def held(ctx: Context, ref: ObjectRef) -> Processed:
        started.set()
        await release.wait()
        return await real(ctx, ref)

    monkeypatch.setattr(ingest.worker, "process_object", held)
    settings = harness.make_settings(stack, names)
    worker = Worker(settings)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await started.wait()
        await anyio.sleep(2.0)  # time enough for a premature commit to happen
        assert await group_lag(stack, names, partitions=2) == 2  # neither copy committed
        assert worker.stats.duplicates == 1
        release.set()
        with anyio.fail_after(30):
            while await group_lag(stack, names, partitions=2):  # noqa: ASYNC110 - broker state
                await anyio.sleep(0.2)
        worker.stop()
    assert worker.stats.processed == 1


class _StopPassesOnItsCancellation:
    """aiokafka's consumer as its ``stop`` behaves with the broker gone: the cancellation
    of its own coordinator task comes out of it."""

    async def stop(self) -> None:
        raise asyncio.CancelledError


class _StopWaits:
    async def stop(self) -> None:
        await asyncio.sleep(3600)


def _member_with(consumer: object) -> GroupMember:
    member = GroupMember.__new__(GroupMember)
    member.consumer = consumer
    return member


@pytest.mark.anyio
async def test_a_consumer_stop_that_passes_on_its_own_cancellation_closes_quietly() -> None:
    await _member_with(_StopPassesOnItsCancellation()).aclose()  # no CancelledError


@pytest.mark.anyio
async def test_a_close_that_is_itself_cancelled_ends_cancelled() -> None:
    task = asyncio.ensure_future(_member_with(_StopWaits()).aclose())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_clients_started_while_their_broker_restarts_wait_for_it(stack: Stack) -> None:
    """A worker (or a supervisor's child) that starts while the broker is down for a moment
    starts once it is back, where it used to exit: the consumer and the producer both."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    with start_tansu() as broker:
        # a restart on a busy machine may take seconds: 15 s of tries
        settings = harness.make_settings(
            stack, names, kafka_bootstrap=broker.bootstrap, kafka_connect_timeout_s="30"
        )
        broker.kill()
        clients = [make_consumer(settings), make_producer(settings)]
        started: list[float] = []

        async def start(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
            await client.start()
            started.append(anyio.current_time())

        async with anyio.create_task_group() as group:
            for client in clients:
                group.start_soon(start, client)
            await anyio.sleep(1.0)
            assert started == []  # waiting, not failed
            back = anyio.current_time()
            await anyio.to_thread.run_sync(broker.restart)
        assert len(started) == 2
        assert min(started) >= back
        for client in clients:
            await client.stop()
