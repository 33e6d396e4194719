"""Series volumes across a consumer group: two workers on the real broker and S3.

A series' slices are spread over two partitions, so two workers each see part
of it, and in the second test a partition moves from one worker to the other
mid-series (slices held in memory by the first are written when it is taken
away). Either way one volume version is written, equal to the slices stacked
along their normal, and every offset is committed.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import anyio
import pytest
from aiokafka import AIOKafkaProducer

from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack
from ingest.worker import Outcome, Worker
from tests import harness
from tests.ingest.pipeline.test_series import (
    expected_volume,
    get_json,
    output_keys,
    series_prefix,
    volume_of,
)
from tests.ingest.source.test_group import group_lag

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("aws_environment"),
]


async def publish_split(stack: Stack, names: harness.Names, keys: Sequence[str]) -> None:
    """One notification a slice, to partitions 0 and 1 in turn."""
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        for index, key in enumerate(keys):
            message = harness.aws_notification(names.source_bucket, [key])
            await producer.send_and_wait(names.source_topic, message, partition=index % 2)
    finally:
        await producer.stop()


async def written(stack: Stack, names: harness.Names, prefix: str, slices: int) -> bool:
    latest = await get_json(stack, names.output_bucket, prefix + "latest.json")
    return (
        latest is not None
        and len(latest["slices"]) == slices
        and await group_lag(stack, names, partitions=2) == 0
    )


async def versions(stack: Stack, bucket: str, prefix: str) -> list[str]:
    """The volume sidecars written under ``prefix`` (``latest.json`` is a copy of one)."""
    return [
        k
        for k in await output_keys(stack, bucket)
        if k.startswith(prefix)
        and "/" not in k[len(prefix) :]
        and k.endswith(".json")
        and not k.endswith("latest.json")
    ]


@pytest.mark.parametrize("slices_mode", ["write", "hold"])
async def test_a_series_split_between_two_workers(stack: Stack, slices_mode: str) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names, partitions=2)
    slices = synthetic_ct_series(8, 16, 16, seed=81)
    await harness.upload(stack, names.source_bucket, slices)
    prefix = series_prefix(slices[0][1])
    # Images in Acquisition completes the series in `write`; a quiet period that ends while
    # the other worker is still at its half would write a partial version (on a busy
    # machine, 1 s did). `hold` completes by the quiet period: the other half is held.
    quiet_s = "10" if slices_mode == "write" else "3"
    overrides = {"series": "volume", "series_slices": slices_mode, "series_quiet_s": quiet_s}
    outcomes: dict[str, list[Outcome]] = {"a": [], "b": []}
    workers = {
        name: Worker(
            harness.make_settings(stack, names, worker_id=name, **overrides),
            outcomes[name].append,
        )
        for name in outcomes
    }

    async with anyio.create_task_group() as group:
        for worker in workers.values():
            group.start_soon(worker.run)
        with anyio.fail_after(30):  # one partition each before any slice is published
            while any(  # noqa: ASYNC110 (the group's assignment is polled)
                w._consumer is None or len(w._consumer.assignment()) != 1 for w in workers.values()
            ):
                await anyio.sleep(0.1)
        await publish_split(stack, names, [k for k, _ in slices])
        with anyio.fail_after(60):
            while not await written(stack, names, prefix, len(slices)):  # noqa: ASYNC110 (S3, Kafka)
                await anyio.sleep(0.2)
        for worker in workers.values():
            worker.stop()

    assert all(outcomes.values())  # each worker processed part of the series
    _, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert len(await versions(stack, names.output_bucket, prefix)) == 1  # no partial volume


@pytest.mark.slow  # 19-30 s each; the split series above keeps two workers in the default run
@pytest.mark.parametrize("slices_mode", ["write", "hold"])
async def test_a_partition_that_moves_mid_series(stack: Stack, slices_mode: str) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names, partitions=2)
    slices = synthetic_ct_series(12, 16, 16, seed=91)
    await harness.upload(stack, names.source_bucket, slices)
    prefix = series_prefix(slices[0][1])
    keys = [k for k, _ in slices]
    # longer than a rebalance under load: the first six slices alone (contiguous) would
    # make a volume of their own if the quiet period ended before the rest came
    overrides = {"series": "volume", "series_slices": slices_mode, "series_quiet_s": "10"}
    outcomes: list[Outcome] = []
    first = Worker(harness.make_settings(stack, names, worker_id="a", **overrides), outcomes.append)
    second = Worker(harness.make_settings(stack, names, worker_id="b", **overrides))

    async with anyio.create_task_group() as group:
        group.start_soon(first.run)
        await publish_split(stack, names, keys[:6])
        with anyio.fail_after(30):
            while len(outcomes) < 6:  # noqa: ASYNC110 (outcomes come from the worker)
                await anyio.sleep(0.05)
        assert first.series is not None
        if slices_mode == "hold":  # held, uncommitted: the volume is not there yet
            assert first.series.memory == 6 * 16 * 16 * 4
            assert await group_lag(stack, names, partitions=2) == 6
        group.start_soon(second.run)  # the group rebalances: a partition moves to it
        with anyio.fail_after(30):
            while second._consumer is None or not second._consumer.assignment():  # noqa: ASYNC110
                await anyio.sleep(0.1)
        await publish_split(stack, names, keys[6:])
        with anyio.fail_after(60):
            while not await written(stack, names, prefix, len(slices)):  # noqa: ASYNC110 (S3, Kafka)
                await anyio.sleep(0.2)
        first.stop()
        second.stop()

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert len(await versions(stack, names.output_bucket, prefix)) == 1
    if slices_mode == "hold":  # the first worker's held slices were written at the revoke
        own = {s["sop_instance_uid"] for s in latest["slices"] if s["npy"] is not None}
        assert len(own) >= 6
