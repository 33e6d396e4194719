"""``Commits.on_revoked``: a member gives partitions up once their work in flight is done, or
at its deadline, commits what finished, and says how long the group waited for it (pure
logic: a consumer that records its commits stands in for aiokafka's)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import anyio
import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from ingest.source.commits import Commits

pytestmark = pytest.mark.anyio
PARTITION = ("events", 0)


class RecordingConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(*PARTITION)}

    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})


def revoked_lines(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [line for line in logs if line["event"] == "partitions revoked"]


async def test_a_revoke_waits_for_work_in_flight_then_commits_it() -> None:
    commits = Commits(revoke_deadline_s=10.0)
    commits.consumer = consumer = RecordingConsumer()
    commits.consumed(PARTITION, 5)

    async def finish_later() -> None:
        await anyio.sleep(0.2)
        commits.finished(PARTITION, 5)
        commits.task_ended()

    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as group:
            group.start_soon(finish_later)
            await commits.on_revoked([PARTITION])

    assert consumer.commits == [{TopicPartition(*PARTITION): 6}]
    assert commits.tracker.in_flight() == 0
    [line] = revoked_lines(logs)
    assert line["partitions"] == [0]
    assert 0.15 <= line["in_flight_s"] < 5.0
    assert line["cut_off"] is False


async def test_a_revoke_gives_up_on_work_in_flight_at_its_deadline() -> None:
    commits = Commits(revoke_deadline_s=0.2)
    commits.consumer = consumer = RecordingConsumer()
    commits.consumed(PARTITION, 5)  # never finished: its next owner redoes it

    with structlog.testing.capture_logs() as logs:
        await commits.on_revoked([PARTITION])

    assert consumer.commits == []
    assert commits.tracker.in_flight() == 0  # forgotten with the partition
    [line] = revoked_lines(logs)
    assert line["in_flight_s"] >= 0.19  # the deadline, less the clocks' rounding
    assert line["cut_off"] is True
