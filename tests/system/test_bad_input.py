"""Bad input through the real worker, against the real broker (Tansu) and S3 server (SeaweedFS).

The corpus of ``tests/bad_inputs/`` (bad objects on both read paths, bad
notifications, events that announce nothing new, keys that do not exist) is
uploaded and announced interleaved with good objects under awkward keys. One
worker run must give every bad item one dead-letter record with the right
reason (a compressed object's naming its transfer syntax), process every good
object bit-exactly, skip what announces nothing, commit to the end of the topic,
and keep its peak RSS far below what any header's claims would need. A second run
does the same for Hypothesis mutants of valid objects, compressed ones among
them: each gets exactly one outcome, and the worker survives.

Compressed objects are also taken in this process, the way the worker decodes
them (``bad_inputs.decode_as_worker``): every entry of the compressed family, and
Hypothesis mutants of every compressed syntax, each refused with an
``IngestError`` or decoded to pydicom's values, in bounded memory. Known product
bugs are strict xfails, named in ``bad_inputs`` (``BUG_*``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import random
import re
import subprocess
import sys
import tracemalloc
import uuid
import warnings
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest
from aiokafka import AIOKafkaProducer
from hypothesis import HealthCheck, given, settings
from pydicom import dcmread
from pydicom.pixels.utils import pixel_array as decode_frame
from pydicom.uid import UID

from ingest.audit.verify import object_records, verify_trail
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
from tests.paths import ROOT
from tests.reference import reference_array

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(150),
    pytest.mark.usefixtures("aws_environment"),
]

RUN_TIMEOUT_S = 90.0
EXTS = (".npy", ".json")  # the outputs of a processed object
PATIENT_TEXT = ("PHANTOM", "SYNTHETIC", "CompressedSamples")  # names inside the samples
DICOM_REASONS = {
    e.reason for e in (NotDicom, MalformedDicom, UnsupportedDicom, LimitExceeded, DicomError)
}
# The dead letter's step: of a reason that has one; a DICOM error's is "parse" in the
# header and "decode" in the Pixel Data, as these show
STEPS_OF = {NotificationError.reason: ("notification",), ObjectNotFound.reason: ("get",)}
KNOWN_STEPS = {
    "object:random-4k": "parse",
    "object:cut-in-meta": "parse",
    "object:ranged-cut-in-dataset": "parse",
    "object:header-over-limit": "parse",
    "object:enc-frame-3-lies": "decode",
    "object:ranged-enc-frame-30-lies": "decode",
    "object:ranged-enc-delimiter-at-frame-20": "decode",
}


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
    syntax: str | None = None  # the transfer syntax the dead letter's error must name
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
            {
                "error_type": item.error.__name__,
                "syntax": item.syntax,
            },
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


async def get_objects(stack: Stack, bucket: str, keys: list[str]) -> dict[str, bytes]:
    """Each of ``keys``' bytes, through one client, eight at a time."""
    found: dict[str, bytes] = {}
    limit = anyio.Semaphore(8)
    async with harness.s3_client(stack) as s3:

        async def get(key: str) -> None:
            async with limit:
                response = await s3.get_object(Bucket=bucket, Key=key)
                async with response["Body"] as body:
                    found[key] = await body.read()

        async with anyio.create_task_group() as group:
            for key in keys:
                group.start_soon(get, key)
    return found


async def output_keys(stack: Stack, bucket: str) -> set[str]:
    keys: set[str] = set()
    async with harness.s3_client(stack) as s3:
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=bucket):
            keys.update(item["Key"] for item in page.get("Contents", []))
    return keys


def names_syntax(message: str, syntax: str) -> bool:
    """Whether ``message`` names the transfer syntax ``syntax``, by its UID or its name."""
    name = UID(syntax).name
    return syntax in message or (name != syntax and name in message)


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

    with harness.PeakRss() as rss:
        run_outcomes, stats = await run_until_done(settings, len(objects) + len(notes))
    ring_bytes = settings.ring_slots * settings.slot_size
    print(f"\npeak RSS growth over the run: {rss.growth / 2**20:.1f} MiB (ring {ring_bytes >> 20})")
    assert rss.growth < ring_bytes + harness.RSS_HEADROOM

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
            if record.syntax is not None:
                assert names_syntax(document["error"], record.syntax), (record.label, document)
            assert document["attempts"] == 1, record.label
            assert document["retriable"] is False, record.label
            assert document["error"], record.label
            assert document["step"] in STEPS_OF.get(reason, ("parse", "decode")), record.label
            if record.label in KNOWN_STEPS:
                assert document["step"] == KNOWN_STEPS[record.label], (record.label, document)
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
        f"{prefix}{key}{ext}" for key in plan.good for ext in EXTS
    }
    outputs = await get_objects(
        stack, names.output_bucket, [f"{prefix}{key}{ext}" for key in plan.good for ext in EXTS]
    )
    for key, data in plan.good.items():
        expected = reference_array(data, None, "float32")
        out = harness.load_npy(outputs[f"{prefix}{key}.npy"])
        assert out.shape == expected.shape, key
        assert out.tobytes() == expected.tobytes(), key
        sidecar = harness.load_json(outputs[f"{prefix}{key}.json"])
        assert sidecar == results[key]
        assert sidecar["source"]["key"] == key
        assert sidecar["source"]["crc64nvme"] == harness.crc64nvme(data)

    # one audit record per outcome, a valid chain; and the whole topic committed
    trail = verify_trail(
        await harness.read_topic_raw(stack, names.audit_topic),
        keys={settings.audit_key_id: harness.AUDIT_KEY},
        trust_on_first_use=True,  # each trail's own key: the tests set no site key
    )
    audit = object_records(trail.records)
    assert len(audit) == len(run_outcomes)
    assert trail.ok, trail.findings
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
    # compressed ones too (decoded by the worker's processes), but not those the worker
    # decodes otherwise than pydicom's pixel_array (BUG_FRAME_STATE: checked in this
    # process) nor a frame header of height 0 (decoded isolated, ISOLATED_MUTATIONS)
    compressed = [
        data
        for data in bad_inputs.compressed_mutations(COMPRESSED_MUTANTS)
        if decoded_or_refused(data) in SAME_AS_PYDICOM
    ]
    mutants |= {f"mutant/compressed-{i:03d}.dcm": data for i, data in enumerate(compressed)}
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


# -- compressed objects, in this process: what the worker's decode stage makes of them ------

COMPRESSED = bad_inputs.compressed_cases()
REFUSAL_TRACED_BYTES = 64 * 1024 * 1024  # what a refusal may allocate (Python's allocators)


def _case(case: bad_inputs.CompressedCase) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=case.bug)] if case.bug else []
    return pytest.param(case, id=case.name, marks=marks)


IN_PROCESS = [c for c in COMPRESSED if c.mutation not in bad_inputs.ISOLATED_MUTATIONS]


def decode_quietly(data: bytes) -> npt.NDArray[Any] | None:
    """``bad_inputs.decode_as_worker`` with warnings ignored, as in the worker (where
    a warning does not turn into an exception, as ``filterwarnings=error`` makes it here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bad_inputs.decode_as_worker(data)


@pytest.mark.parametrize("case", [_case(case) for case in IN_PROCESS])
def test_compressed_mutant_refused_or_decoded_as_pydicom(case: bad_inputs.CompressedCase) -> None:
    """Each mutant the way the worker reads it (one GET, or streamed): refused with its
    error class, allocating little; or decoded to pydicom's ``pixel_array``."""
    if case.error is None:
        got = decode_quietly(case.data)
        assert got is not None
        expected = bad_inputs.pixel_array(case.data)
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert np.array_equal(got, expected)
        return
    tracemalloc.start()
    try:
        with pytest.raises(case.error):
            decode_quietly(case.data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < REFUSAL_TRACED_BYTES, f"{peak >> 20} MiB allocated before the refusal"


def test_compressed_refusals_name_the_syntax() -> None:
    """What cannot be decoded is dead-lettered naming the transfer syntax."""
    cases = [c for c in IN_PROCESS if c.error is not None and c.bug is None]
    assert cases
    unnamed = []
    for case in cases:
        with pytest.raises(IngestError) as refused:
            decode_quietly(case.data)
        if not names_syntax(str(refused.value), case.syntax):
            unnamed.append(f"{case.name}: {refused.value}")
    assert not unnamed, f"{len(unnamed)} of {len(cases)} do not name the syntax: {unnamed[:3]}"


ISOLATED_LIMIT = 256 * 1024 * 1024  # address space: every base decodes well within it
ISOLATED = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), resource.RLIM_INFINITY))
from ingest.errors import IngestError
from tests import bad_inputs
for path in sys.argv[2:]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad_inputs.decode_as_worker(open(path, "rb").read())
        print("decoded", flush=True)
    except IngestError as exc:
        print(type(exc).__name__, flush=True)
"""


def decode_isolated(paths: list[Path]) -> subprocess.Popen[bytes]:
    """A process that decodes each of ``paths`` in turn as the worker would, under an
    address-space limit of ``ISOLATED_LIMIT``, printing what came of each."""
    command = [sys.executable, "-c", ISOLATED, str(ISOLATED_LIMIT), *map(str, paths)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )


def test_bases_decode_within_the_isolated_limit(tmp_path: Path) -> None:
    """What ``test_jpeg_height_zero_refused_in_bounded_memory`` relies on: under its
    limit every compressed base decodes."""
    paths = []
    for base in bad_inputs.compressed_bases():
        paths.append(tmp_path / f"{base.name}.dcm")
        paths[-1].write_bytes(base.write())
    process = decode_isolated(paths)
    out, _ = process.communicate(timeout=60)
    assert (process.returncode, out.decode().split()) == (0, ["decoded"] * len(paths))


@pytest.mark.timeout(60)
def test_jpeg_height_zero_refused_in_bounded_memory(tmp_path: Path) -> None:
    """The mutants that grow memory without bound, each decoded in a process of its own
    under the address-space limit: each must be refused with its error class, and the
    process end normally (no MemoryError, no abort)."""
    cases = [c for c in COMPRESSED if c.mutation in bad_inputs.ISOLATED_MUTATIONS]
    assert cases
    running = []
    for case in cases:
        path = tmp_path / f"{case.name}.dcm"
        path.write_bytes(case.data)
        running.append(decode_isolated([path]))
    outcomes = {}
    for case, process in zip(cases, running, strict=True):
        out, _ = process.communicate(timeout=50)
        outcomes[case.name] = (process.returncode, out.decode().strip())
    expected = {case.name: (0, case.error.__name__ if case.error else "decoded") for case in cases}
    assert outcomes == expected


class Footprint:
    """Memory taken over a block: Python's allocations at their peak (``tracemalloc``,
    NumPy's included) and the process's peak RSS growth (native allocations too)."""

    def __init__(self) -> None:
        self.traced = self.rss = 0

    def __enter__(self) -> Footprint:
        self._rss = harness.PeakRss().__enter__()
        tracemalloc.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        self._rss.__exit__()
        self.rss = self._rss.growth


def decoded_bound(data: bytes) -> int:
    """What decoding ``data`` may allocate: 16 MiB, and eight times the frames its header
    claims (as many as the largest base has fragments, plus one)."""
    frame = 0
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data), stop_before_pixels=True, force=True)
        frame = int(ds.Rows) * int(ds.Columns) * int(ds.SamplesPerPixel)
        frame *= -(-int(ds.BitsAllocated) // 8)
    frames = max(len(base.frames) for base in bad_inputs.compressed_bases()) + 1
    return 16 * 1024 * 1024 + 8 * max(frame, 0) * frames


# a JPEG (-LS) frame header of height 0, once a way to take all memory: decoded isolated
SOF_HEIGHT_0 = re.compile(rb"\xff[\xc0-\xc3\xc5-\xc7\xc9-\xcb\xcd-\xcf\xf7].{3}\x00\x00", re.S)


def frame_by_frame(data: bytes, count: int) -> npt.NDArray[Any]:
    """pydicom's decode of each frame on its own (``pixel_array(..., index=k)``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.stack([decode_frame(BytesIO(data), index=k) for k in range(count)])


MUTANT_EXAMPLES = 800  # ~10 s on the 2-core machine
COMPRESSED_MUTANTS = 40  # of them through the worker as well
SAME_AS_PYDICOM = {"decoded", "MalformedDicom", "LimitExceeded", "UnsupportedDicom"}


@pytest.mark.timeout(120)
def test_mutated_codestreams_refused_or_decoded_as_pydicom() -> None:
    """Hypothesis mutants of every compressed syntax (``bad_inputs.mutated_compressed``),
    the way the worker decodes them: an ``IngestError``, or pydicom's ``pixel_array``
    (where pydicom decodes it at all); nothing else raised, memory bounded by what the
    header claims however large the codestream's claims, no hang (the timeout)."""
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=MUTANT_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bad_inputs.mutated_compressed())
    def check(mutant: bad_inputs.Mutant) -> None:
        outcome = decoded_or_refused(mutant.data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    check()
    print(f"\ncompressed mutants: {sum(outcomes.values())}, {outcomes}")
    assert sum(outcomes.values()) >= MUTANT_EXAMPLES // 2


def decoded_or_refused(data: bytes) -> str:
    """Check one mutant (see the test); returns what came of it."""
    if SOF_HEIGHT_0.search(data):
        return "skipped: a frame header of height 0 (decoded isolated, in its own test)"
    bound = decoded_bound(data)
    got: npt.NDArray[Any] | None = None
    with Footprint() as memory:
        try:
            got = decode_quietly(data)
            outcome = "decoded" if got is not None else "not compressed"
        except IngestError as exc:
            outcome = type(exc).__name__
    assert memory.traced < bound, f"{memory.traced >> 20} MiB traced, bound {bound >> 20}"
    assert memory.rss < bound + 64 * 1024 * 1024, f"peak RSS grew {memory.rss >> 20} MiB"
    if got is None:
        return outcome
    try:
        expected = bad_inputs.pixel_array(data)
    except Exception:  # pydicom cannot decode it: nothing to compare with
        return "decoded, pydicom fails"
    if got.shape == expected.shape and not np.array_equal(got, expected):
        # BUG_FRAME_STATE: where pydicom's whole-object decode is not its decode of each
        # frame on its own, the worker's is the latter
        frames = frame_by_frame(data, len(got)).reshape(got.shape)
        if not np.array_equal(frames, expected):
            outcome, expected = "decoded as pydicom decodes each frame", frames
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert np.array_equal(got, expected)
    return outcome
