"""Bad input through the real worker, against the real broker (Tansu) and S3 server (SeaweedFS).

The corpus of ``tests/bad_inputs.py`` (bad objects on both read paths, bad
notifications, events that announce nothing new, keys that do not exist) is
uploaded and announced interleaved with good objects under awkward keys. One
worker run must give every bad item one dead-letter record with the right
reason, process every good object bit-exactly, skip what announces nothing,
commit to the end of the topic, and keep its peak RSS far below what any
header's claims would need. A second run does the same for Hypothesis mutants
of valid objects: each gets exactly one outcome, and the worker survives.
"""

from __future__ import annotations

import base64
import hashlib
import random
import resource
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaProducer

from ingest.audit.records import open_envelope, verify_chain
from ingest.dicom.parse import parse_header
from ingest.embedded.samples import synthetic_rgb
from ingest.embedded.stack import Stack
from ingest.errors import (
    DicomError,
    IngestError,
    LimitExceeded,
    MalformedDicom,
    NotDicom,
    NotificationError,
    ObjectNotFound,
    UnsupportedDicom,
)
from ingest.settings import Settings
from ingest.worker import Outcome, Worker, WorkerStats
from tests import bad_inputs, harness
from tests.reference import reference_array

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(150)]

RUN_TIMEOUT_S = 90.0
RSS_HEADROOM = 200 * 1024 * 1024
PATIENT_TEXT = ("PHANTOM", "SYNTHETIC", "CompressedSamples")  # names inside the samples
DICOM_REASONS = {
    e.reason for e in (NotDicom, MalformedDicom, UnsupportedDicom, LimitExceeded, DicomError)
}


@pytest.fixture(autouse=True)
def aws_environment(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker takes S3 credentials from the standard AWS variables, as botocore does."""
    for name, value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, value)


# -- what each published record should lead to -------------------------------------------


@dataclass(slots=True)
class Expected:
    """One Kafka record and what should come of it.

    ``objects``: (key, reason or "ok") per object it announces; ``record``:
    "bad_notification", "skipped" or "duplicate" for the record as a whole.
    """

    label: str
    value: bytes | None
    objects: list[tuple[str, str]] = field(default_factory=list)
    record: str | None = None
    error_type: str | None = None
    offset: int = -1


@dataclass(slots=True)
class Plan:
    bucket: str
    records: list[Expected] = field(default_factory=list)
    uploads: dict[str, bytes] = field(default_factory=dict)  # key -> bytes
    good: dict[str, bytes] = field(default_factory=dict)  # key -> bytes, processed

    def add_object(self, key: str, data: bytes, reason: str, label: str, **kw: Any) -> None:
        self.uploads[key] = data
        if reason == "ok":
            self.good[key] = data
        note = bad_inputs.notification(kw.pop("fmt", "aws"), self.bucket, key)
        self.records.append(Expected(label, note, [(key, reason)], **kw))


def build_plan(bucket: str) -> Plan:
    plan = Plan(bucket)
    bad_objects = [
        (
            f"bad/{item.kind}/{item.name}.dcm",
            item.data,
            item.reason,
            f"object:{item.name}",
            {"error_type": item.error.__name__},
        )
        for item in bad_inputs.bad_objects()
    ]
    good_objects = [
        (g.key, g.data, "ok", f"good:{g.key}", {"fmt": g.fmt}) for g in bad_inputs.good_objects()
    ]
    anchor = "good/CT_small.dcm"  # exists, so processing a record about it would show
    others: list[Expected] = [
        Expected(f"notification:{n.name}", n.value, record=NotificationError.reason)
        for n in bad_inputs.bad_notifications(bucket, anchor)
    ]
    others += [
        Expected(f"skipped:{name}", value, record="skipped")
        for name, value in bad_inputs.skipped_notifications(bucket, anchor)
    ]
    missing = ObjectNotFound.reason
    others += [
        Expected(
            "not-found:key",
            bad_inputs.notification("aws", bucket, "no/such key.dcm"),
            [("no/such key.dcm", missing)],
            error_type="ObjectNotFound",
        ),
        Expected(
            "not-found:bucket",
            bad_inputs.notification("aws", "b-no-such-bucket-dicom-ingest", "x.dcm"),
            [("x.dcm", missing)],
            error_type="ObjectNotFound",
        ),
    ]
    # one record, two objects: one good, one missing; the record finishes when both do
    pair = "good/in-a-pair.dcm"
    plan.uploads[pair] = plan.good[pair] = bad_inputs.small_base()
    others.append(
        Expected(
            "two-records:good+missing",
            bad_inputs.aws_records(bucket, [pair, "no/pair-partner.dcm"]),
            [(pair, "ok"), ("no/pair-partner.dcm", missing)],
            error_type="ObjectNotFound",
        )
    )
    # the same object version announced twice: processed once, the repeat counted
    repeat = "good/repeated.dcm"
    plan.uploads[repeat] = plan.good[repeat] = synthetic_rgb(1, 5, 7)
    twice = bad_inputs.aws_records(bucket, [repeat], sequencer="00A1B2C3D4E5F60718")
    first = Expected("repeat:first", twice, [(repeat, "ok")])

    for key, data, reason, label, kw in bad_objects + good_objects:
        plan.add_object(key, data, reason, label, **kw)
    plan.records += others
    random.Random(20261121).shuffle(plan.records)  # good and bad interleaved, the same each run
    plan.records.insert(len(plan.records) // 3, first)
    plan.records.insert(
        2 * len(plan.records) // 3, Expected("repeat:second", twice, record="duplicate")
    )
    plan.add_object("good/last.dcm", bad_inputs.ct_small(), "ok", "good:last")  # after all else
    return plan


# -- running ------------------------------------------------------------------------------


async def publish(stack: Stack, topic: str, values: list[bytes | None]) -> list[int]:
    """Produce in order (null values need a key); returns each record's offset."""
    producer = AIOKafkaProducer(
        bootstrap_servers=stack.kafka.bootstrap, acks="all", max_request_size=16 << 20
    )
    await producer.start()
    try:
        offsets = []
        for value in values:
            key = b"null-value" if value is None else None
            sent = await producer.send_and_wait(topic, value, key=key)
            offsets.append(int(sent.offset))
        return offsets
    finally:
        await producer.stop()


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise LookupError(name)


class PeakRss:
    """Peak RSS growth of this process (the worker runs in it) over a block, in bytes.

    Resets the kernel's high-water mark (``/proc/self/clear_refs``) when it may,
    else compares ``ru_maxrss`` before and after (a lower bound then).
    """

    def __init__(self) -> None:
        self.growth = 0
        self._base = 0
        self._reset = False

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset = True
            self._base = _status_kib("VmRSS") * 1024
        except OSError:
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._reset:
            peak = _status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.growth = max(0, peak - self._base)


async def run_until_done(settings: Settings, outcomes: int) -> tuple[list[Outcome], WorkerStats]:
    """Run one worker until it has reported ``outcomes`` outcomes, then stop it gracefully.

    A crash propagates out of the task group; a hang ends in ``TimeoutError``.
    The plans end with a good object, so its outcome means every record was read.
    """
    seen: list[Outcome] = []
    done = anyio.Event()

    def on_outcome(outcome: Outcome) -> None:
        seen.append(outcome)
        if len(seen) >= outcomes:
            done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        await group.start(worker.run)
        with anyio.fail_after(RUN_TIMEOUT_S):
            await done.wait()
        worker.stop()
    return seen, worker.stats


async def output_keys(stack: Stack, bucket: str) -> set[str]:
    keys: set[str] = set()
    async with harness.s3_client(stack) as s3:
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=bucket):
            keys.update(item["Key"] for item in page.get("Contents", []))
    return keys


def shown_value(value: bytes | None) -> tuple[str, str]:
    raw = (value or b"")[: 256 * 1024]
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode(), "base64"


# -- the corpus -----------------------------------------------------------------------------


async def test_bad_inputs_interleaved_with_good_ones(stack: Stack) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    plan = build_plan(names.source_bucket)
    await harness.upload(stack, names.source_bucket, plan.uploads.items())
    offsets = await publish(stack, names.source_topic, [r.value for r in plan.records])
    for record, offset in zip(plan.records, offsets, strict=True):
        record.offset = offset
    settings = harness.make_settings(
        stack, names, max_header_bytes=str(bad_inputs.MAX_HEADER_BYTES)
    )
    assert settings.part_size == bad_inputs.PART_SIZE
    objects = [(r, key, reason) for r in plan.records for key, reason in r.objects]
    notes = [r for r in plan.records if r.record == NotificationError.reason]
    skipped = [r for r in plan.records if r.record == "skipped"]

    with PeakRss() as rss:
        run_outcomes, stats = await run_until_done(settings, len(objects) + len(notes))
    ring_bytes = settings.ring_slots * settings.slot_size
    print(f"\npeak RSS growth over the run: {rss.growth / 2**20:.1f} MiB (ring {ring_bytes >> 20})")
    assert rss.growth < ring_bytes + RSS_HEADROOM

    # every object exactly one outcome; every bad notification one keyless outcome
    by_key: dict[str, list[Outcome]] = {}
    for outcome in run_outcomes:
        if outcome.ref is not None:
            by_key.setdefault(outcome.ref.key, []).append(outcome)
    assert sorted(by_key) == sorted(key for _, key, _ in objects)
    assert all(len(found) == 1 for found in by_key.values())
    assert sum(o.ref is None for o in run_outcomes) == len(notes)
    assert (stats.processed, stats.dead_lettered) == (
        len(plan.good),
        len(objects) - len(plan.good) + len(notes),
    )
    assert stats.skipped_events == len(skipped) - 1  # s3:TestEvent carries no record
    assert stats.duplicates == 1
    assert stats.records == len(plan.records)

    # the dead-letter topic: one record per bad item, with its reason and the original record
    dlq = await harness.read_json_topic(stack, names.dlq_topic)
    by_offset: dict[int, list[dict[str, Any]]] = {}
    for document in dlq:
        by_offset.setdefault(document["record"]["offset"], []).append(document)
    expected_dlq = 0
    for record in plan.records:
        got = by_offset.pop(record.offset, [])
        bad = [(key, reason) for key, reason in record.objects if reason != "ok"]
        if record.record == NotificationError.reason:
            bad = [("", NotificationError.reason)]
        expected_dlq += len(bad)
        assert len(got) == len(bad), record.label
        for document, (key, reason) in zip(got, bad, strict=True):
            assert document["key"] == (key or None), record.label
            assert document["reason"] == reason, (record.label, document["error"])
            if record.error_type is not None:
                assert document["error_type"] == record.error_type, record.label
            assert document["attempts"] == 1, record.label
            assert document["retriable"] is False, record.label
            assert document["error"], record.label
            assert not any(text in document["error"] for text in PATIENT_TEXT), record.label
            if key:
                assert document["bucket"] in (names.source_bucket, "b-no-such-bucket-dicom-ingest")
            original = document["record"]
            text, encoding = shown_value(record.value)
            raw = record.value or b""
            assert (original["value"], original["value_encoding"]) == (text, encoding), record.label
            assert original["value_bytes"] == len(raw)
            assert original["value_truncated"] == (len(raw) > 256 * 1024)
            assert original["value_sha256"] == hashlib.sha256(raw).hexdigest()
            assert original["topic"] == names.source_topic
    assert not by_offset, "dead letters for records that should have none"
    assert len(dlq) == expected_dlq

    # good objects: bit-exact outputs under the decoded key, sidecars, results; nothing else
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    assert sorted(results) == sorted(plan.good)
    prefix = f"out/{names.source_bucket}/"
    assert await output_keys(stack, names.output_bucket) == {
        f"{prefix}{key}{ext}" for key in plan.good for ext in (".npy", ".json")
    }
    for key, data in plan.good.items():
        expected = reference_array(data, None, "float32")
        out = harness.load_npy(
            await harness.get_object(stack, names.output_bucket, f"{prefix}{key}.npy")
        )
        assert out.shape == expected.shape, key
        assert out.tobytes() == expected.tobytes(), key
        sidecar = harness.load_json(
            await harness.get_object(stack, names.output_bucket, f"{prefix}{key}.json")
        )
        assert sidecar == results[key]
        assert sidecar["source"]["key"] == key
        assert sidecar["source"]["sha256"] == harness.sha256(data)

    # one audit record per outcome, a valid chain; and the whole topic committed
    audit = [
        open_envelope(m, {settings.audit_key_id: harness.AUDIT_KEY})
        for m in await harness.read_topic_raw(stack, names.audit_topic)
    ]
    assert len(audit) == len(run_outcomes)
    assert verify_chain(audit).ok
    assert await harness.committed_offset(stack, names.group, names.source_topic) == len(
        plan.records
    )


# -- truncations on element boundaries, at the parser ------------------------------------


@pytest.mark.parametrize(
    "item", [i for i in bad_inputs.bad_objects() if i.kind == "truncated"], ids=lambda i: i.name
)
def test_truncated_objects_are_malformed_at_the_parser(item: bad_inputs.BadObject) -> None:
    with pytest.raises(item.error):
        parse_header(item.data, len(item.data), max_header_bytes=bad_inputs.MAX_HEADER_BYTES)


# -- mutants ------------------------------------------------------------------------------


async def test_mutated_objects_each_get_one_outcome(stack: Stack) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    mutants = {f"mutant/{i:03d}.dcm": data for i, data in enumerate(bad_inputs.mutations(10))}
    sentinel = {"mutant/zz-sentinel.dcm": bad_inputs.large_base()}
    objects = {**mutants, **sentinel}
    await harness.upload(stack, names.source_bucket, objects.items())
    await publish(
        stack,
        names.source_topic,
        [bad_inputs.notification("aws", names.source_bucket, k) for k in objects],
    )
    settings = harness.make_settings(
        stack, names, max_header_bytes=str(bad_inputs.MAX_HEADER_BYTES)
    )

    run_outcomes, _ = await run_until_done(settings, len(objects))

    keys = [o.ref.key for o in run_outcomes if o.ref is not None]
    assert sorted(keys) == sorted(objects)  # exactly one outcome each
    processed = {o.ref.key for o in run_outcomes if o.ref and o.processed}
    assert set(sentinel) <= processed
    reasons: dict[str, int] = {}
    for outcome in run_outcomes:
        if outcome.error is not None:
            assert isinstance(outcome.error, IngestError)
            assert outcome.error.reason in DICOM_REASONS, outcome.error  # never "processing"
            reasons[outcome.error.reason] = reasons.get(outcome.error.reason, 0) + 1
    prefix = f"out/{names.source_bucket}/"
    for key in sorted(processed):
        data = objects[key]
        out = harness.load_npy(
            await harness.get_object(stack, names.output_bucket, f"{prefix}{key}.npy")
        )
        expected = reference_array(data, None, "float32")
        assert out.tobytes() == expected.tobytes(), key
    print(f"\nmutants: {len(mutants)}, processed {len(processed) - 1}, dead-lettered {reasons}")
    assert await harness.committed_offset(stack, names.group, names.source_topic) == len(objects)


# -- header growth past a limit that is not 64 KiB times a power of two --------------------


async def test_header_under_an_uneven_limit_is_read(stack: Stack) -> None:
    """A 150 KiB header under a 200 KiB limit, in an object larger than the limit.

    The prefix grows from the 64 KiB probe (one part) to the limit (200 KiB; four times
    the probe would pass it), not past it.
    """
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    data = bad_inputs.padded(bad_inputs.large_base(), header_end=150 * 1024)
    assert len(data) > 200 * 1024
    await harness.upload(stack, names.source_bucket, [("header-150k.dcm", data)])
    note = bad_inputs.notification("aws", names.source_bucket, "header-150k.dcm")
    await publish(stack, names.source_topic, [note])
    settings = harness.make_settings(stack, names, max_header_bytes=str(200 * 1024))

    outcomes, _ = await run_until_done(settings, 1)

    assert outcomes[0].error is None, f"{type(outcomes[0].error).__name__}: {outcomes[0].error}"
