"""``dicom-ingest dlq replay`` on the embedded stack: selection, idempotence, the fix taking.

A worker dead-letters an object that is missing (``not_found``), one that is not
DICOM and a bad record. The missing object is then uploaded (the fix), and
replay by reason re-publishes only its dead letter, once however often it runs;
a worker then processes it. The other selections (key prefix, time range, the
bad record's own bytes) and the dry run are checked against the same topic.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from ingest.cli import main
from ingest.embedded.samples import example_bytes, not_dicom
from ingest.embedded.stack import Stack, create_topics
from ingest.ops.dlq import HEADER, Selection, read_all, replay
from ingest.source.notifications import parse_notification
from tests import harness

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("aws_environment"),
]


async def source_records(stack: Stack, topic: str) -> list[tuple[bytes, dict[str, bytes]]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.kafka.bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        out = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                out += [(r.value, dict(r.headers)) for r in records]
        return out
    finally:
        await consumer.stop()


@pytest.mark.anyio
async def test_replay_selects_publishes_once_and_the_fix_takes(stack: Stack) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    bad_key, bad_body = not_dicom()
    await harness.upload(stack, names.source_bucket, [(f"b/{bad_key}", bad_body)])
    bad_record = b'{"Records": [{"eventName": 42}]}'
    messages = [
        harness.aws_notification(names.source_bucket, ["a/missing slice.dcm"]),
        harness.aws_notification(names.source_bucket, [f"b/{bad_key}"]),
        bad_record,
    ]
    await harness.publish(stack, names.source_topic, messages)
    settings = harness.make_settings(stack, names)
    started = datetime.now(UTC) - timedelta(seconds=1)
    run = await harness.run_worker(settings, stop_after=3)
    assert sorted(o.error.reason for o in run.outcomes if o.error) == [
        "bad_notification",
        "not_dicom",
        "not_found",
    ]
    published = len(messages)

    # nothing selected: a time range before the failures, a prefix nothing has
    before = Selection(until=started)
    assert (await replay(settings, before)).replayed.total() == 0
    report = await replay(settings, Selection(key_prefix="zzz/"))
    assert (report.replayed.total(), report.unselected) == (0, 3)
    # a dry run counts and publishes nothing
    dry = await replay(settings, Selection(key_prefix="b/"), dry_run=True)
    assert dict(dry.replayed) == {"not_dicom": 1}
    assert len(await source_records(stack, names.source_topic)) == published

    # the fix, then replay by reason: the missing object's notification only, once
    await harness.upload(
        stack, names.source_bucket, [("a/missing slice.dcm", example_bytes("CT_small.dcm"))]
    )
    selection = Selection(reasons=frozenset({"not_found"}), since=started)
    first = await replay(settings, selection)
    assert dict(first.replayed) == {"not_found": 1}
    again = await replay(settings, selection)
    assert (again.replayed.total(), again.already) == (0, 1)
    records = await source_records(stack, names.source_topic)
    assert len(records) == published + 1
    value, headers = records[-1]
    assert headers[HEADER].decode().startswith(f"{names.dlq_topic}/0/")
    (ref,) = parse_notification(value).objects
    assert (ref.bucket, ref.key, ref.version_id, ref.etag) == (
        names.source_bucket,
        "a/missing slice.dcm",
        None,
        None,
    )
    markers = await read_all(settings, names.dlq_topic + ".replayed")
    assert [m.key for m in markers] == [headers[HEADER].decode().split("/", 1)[1].encode()]

    # a bad record goes back as its own bytes
    bad = await replay(settings, Selection(reasons=frozenset({"bad_notification"})))
    assert dict(bad.replayed) == {"bad_notification": 1}
    assert (await source_records(stack, names.source_topic))[-1][0] == bad_record

    # the worker (same group) takes the replayed notification and processes the object
    rerun = await harness.run_worker(settings, stop_after=2)
    assert {o.ref.key for o in rerun.outcomes if o.processed and o.ref} == {"a/missing slice.dcm"}
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    assert list(results) == ["a/missing slice.dcm"]


def test_the_command_line_runs_replay(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dicom-ingest dlq replay --dry-run`` with the worker's environment (an empty DLQ)."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    create_topics(stack.kafka.bootstrap, [names.dlq_topic, names.source_topic])
    monkeypatch.setenv("DICOM_INGEST_KAFKA_BOOTSTRAP", stack.kafka.bootstrap)
    monkeypatch.setenv("DICOM_INGEST_DLQ_TOPIC", names.dlq_topic)
    monkeypatch.setenv("DICOM_INGEST_SOURCE_TOPIC", names.source_topic)
    assert main(["dlq", "replay", "--dry-run", "--reason", "not_found"]) == 0
    out = capsys.readouterr().out
    assert f"would replay 0 to {names.source_topic} (none)" in out
    assert main(["dlq", "replay", "--since", "2026-01-02", "--until", "2026-01-01"]) == 2
