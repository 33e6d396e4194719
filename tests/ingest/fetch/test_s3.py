"""S3 faults between the worker and SeaweedFS, injected by a real HTTP proxy (tests/faults.py).

Transient faults (500, 503 SlowDown, resets, stalls past the read timeout,
bodies cut short) are retried and every output stays bit-exact; a short body
is never taken as data; persistent failures end in the dead-letter topic
after a bounded number of attempts while the rest goes on; an object replaced
while it is read is re-read (412 on If-Match) and the output is the new
version's, or dead-lettered as ``object_changed`` if it never holds still.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from ingest.embedded.samples import example_bytes, synthetic_ct_series, synthetic_multiframe
from ingest.embedded.stack import Stack
from ingest.errors import (
    AccessDenied,
    IngestError,
    ObjectNotFound,
    SourceUnavailable,
    TruncatedBody,
)
from ingest.fetch.planning import ByteRange
from ingest.fetch.s3 import Presigned, S3Source
from ingest.settings import Settings
from ingest.worker import Outcome, Worker
from tests import harness
from tests.faults import (
    Fault,
    FaultPlan,
    FaultProxy,
    PutObject,
    Replace,
    Reset,
    Rule,
    ShortBody,
    Stall,
    Status,
)
from tests.reference import reference_array

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("aws_environment"),
]

MAX_ATTEMPTS = 4
READ_TIMEOUT_S = 1.0
STALL_S = 3 * READ_TIMEOUT_S  # the client gives up first; its disconnect ends the stall
RETRY_MAX_WAIT_S = 0.1
PART = 64 * 1024

# Faults injected over this module's run, by kind (printed at the end with -s / -rA).
TOTALS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_totals() -> Iterator[None]:
    yield
    print("\nfaults injected by kind:", dict(sorted(TOTALS.items())))


@asynccontextmanager
async def proxied(
    stack: Stack, plan: FaultPlan, idle_timeout_s: float = 3630.0
) -> AsyncIterator[FaultProxy]:
    """The proxy in front of the stack's SeaweedFS; ``Replace`` writes straight upstream."""
    async with harness.s3_client(stack) as s3:

        async def put(bucket: str, key: str, body: bytes) -> None:
            await s3.put_object(Bucket=bucket, Key=key, Body=body)

        putter: PutObject = put
        async with FaultProxy(
            stack.s3.endpoint_url, plan, put_object=putter, idle_timeout_s=idle_timeout_s
        ) as proxy:
            try:
                yield proxy
            finally:
                TOTALS.update(plan.injected)


def settings_for(
    stack: Stack, names: harness.Names, proxy: FaultProxy, **overrides: str
) -> Settings:
    return harness.make_settings(
        stack,
        names,
        **{
            "s3_endpoint_url": proxy.url,
            "read_timeout_s": str(READ_TIMEOUT_S),
            "max_attempts": str(MAX_ATTEMPTS),
            "retry_max_wait_s": str(RETRY_MAX_WAIT_S),
            **overrides,
        },
    )


async def upstream_etag(stack: Stack, bucket: str, key: str) -> str:
    async with harness.s3_client(stack) as s3:
        head = await s3.head_object(Bucket=bucket, Key=key)
        return str(head["ETag"]).strip('"')


# -- the proxy itself ---------------------------------------------------------------------------


async def test_proxy_forwards_signed_requests_and_credentials_stay_enforced(stack: Stack) -> None:
    """No rules: requests pass unchanged (SigV4 still verifies upstream), wrong keys still fail."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    stack.s3.create_bucket(names.source_bucket)
    key = "dir with space/multi+frame é.dcm"  # the raw, encoded path must reach the upstream
    body = bytes(range(256)) * 1000
    plan = FaultPlan()
    creds = stack.endpoints.credentials
    async with proxied(stack, plan) as proxy:
        session = get_session()
        async with session.create_client(
            "s3",
            endpoint_url=proxy.url,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            region_name=creds.region,
        ) as s3:
            await s3.put_object(Bucket=names.source_bucket, Key=key, Body=body)
            got = await s3.get_object(Bucket=names.source_bucket, Key=key, Range="bytes=10-99")
            async with got["Body"] as stream:
                assert await stream.read() == body[10:100]
            head = await s3.head_object(Bucket=names.source_bucket, Key=key)
            assert head["ContentLength"] == len(body)
        async with session.create_client(
            "s3",
            endpoint_url=proxy.url,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key="not-the-secret",
            region_name=creds.region,
        ) as wrong:
            with pytest.raises(ClientError) as denied:
                await wrong.get_object(Bucket=names.source_bucket, Key=key)
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert plan.injected == {}
    assert [r.method for r in plan.requests] == ["PUT", "GET", "HEAD", "GET"]
    assert {r.key for r in plan.requests} == {key}


# -- the source alone: one HEAD / one ranged GET through the proxy ----------------------------

TRANSIENT: dict[str, Fault] = {
    "500": Status.internal_error(),
    "503": Status.slow_down(),
    "reset": Reset(0.5),
    "stall": Stall(STALL_S),
    "stall_mid_body": Stall(STALL_S, fraction=0.5),
    "short_body": ShortBody(0.5),
    "short_body_declared": ShortBody(0.5, honest_length=True),
}


@asynccontextmanager
async def source_through(
    stack: Stack, plan: FaultPlan, data: bytes, key: str = "obj/x.dcm"
) -> AsyncIterator[tuple[S3Source, Presigned, str]]:
    names = harness.make_names(uuid.uuid4().hex[:10])
    stack.s3.create_bucket(names.source_bucket)
    await harness.upload(stack, names.source_bucket, [(key, data)])
    async with proxied(stack, plan) as proxy, S3Source(settings_for(stack, names, proxy)) as src:
        yield src, await src.locate(names.source_bucket, key, None), key


async def test_source_presigns_with_sigv4_that_the_server_verifies(stack: Stack) -> None:
    """SigV4 query auth (AWS refuses SigV2 for buckets made since 2020; botocore presigns
    with SigV2 unless told), and a URL whose signature is altered is refused."""
    data = bytes(range(256)) * 4
    async with source_through(stack, FaultPlan(), data, "dir with space/é+x.dcm") as (
        src,
        where,
        _,
    ):
        assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in where.url
        assert "AWSAccessKeyId=" not in where.url
        target = bytearray(PART)
        head, filled = await src.read_first(where, memoryview(target))
        assert bytes(target[:filled]) == data
        signature = where.url.rindex("X-Amz-Signature=") + len("X-Amz-Signature=")
        flipped = "0" if where.url[signature] != "0" else "1"
        altered = where.url[:signature] + flipped + where.url[signature + 1 :]
        with pytest.raises(AccessDenied):
            await src.read_first(dataclasses.replace(where, url=altered), memoryview(target))
    assert head.size == len(data)


@pytest.mark.parametrize("kind", sorted(TRANSIENT))
async def test_source_retries_each_transient_fault(stack: Stack, kind: str) -> None:
    data = bytes(range(256)) * (3 * PART // 256)
    faults = 1 if kind.startswith("stall") else MAX_ATTEMPTS - 1  # a stall costs a timeout
    rule = Rule(TRANSIENT[kind], method="GET", times=faults)
    plan = FaultPlan([rule])
    rule = Rule(TRANSIENT[kind], method="GET", range=r"^bytes=[1-9]", times=faults)
    plan = FaultPlan([rule])
    async with source_through(stack, plan, data) as (src, url, key):
        head, filled = await src.read_first(url, memoryview(bytearray(PART)))
        target = bytearray(b"\xee" * PART)
        await src.read_into(url, head, ByteRange(PART, 2 * PART), memoryview(target))
    assert (head.size, filled) == (len(data), PART)
    assert bytes(target) == data[PART : 2 * PART]
    assert plan.injected == {TRANSIENT[kind].kind: faults}
    assert len(plan.seen("GET", key)) == faults + 2


@pytest.mark.parametrize("kind", ["500", "stall", "short_body"])
async def test_source_first_read_retries_and_learns_the_object(stack: Stack, kind: str) -> None:
    """The first GET replaces the HEAD: its answer gives the size and ETag, after retries."""
    data = bytes(range(256)) * 4
    plan = FaultPlan([Rule(TRANSIENT[kind], method="GET", times=1)])
    async with source_through(stack, plan, data) as (src, url, key):
        target = bytearray(PART)
        head, filled = await src.read_first(url, memoryview(target))
    assert (head.size, filled) == (len(data), len(data))
    assert bytes(target[:filled]) == data
    assert head.etag == await upstream_etag(stack, url.bucket, key)
    assert plan.injected == {TRANSIENT[kind].kind: 1}
    assert len(plan.seen("GET", key)) == 2
    assert plan.seen("HEAD", key) == []


async def test_source_empty_object_answers_size_zero(stack: Stack) -> None:
    """Any range of an empty object is 416; a HEAD then confirms the size of 0."""
    plan = FaultPlan()
    async with source_through(stack, plan, b"") as (src, url, _key):
        head, filled = await src.read_first(url, memoryview(bytearray(PART)))
    assert (head.size, filled) == (0, 0)
    assert [r.method for r in plan.requests] == ["GET", "HEAD"]


async def test_source_cancelled_read_stops_at_once_and_never_writes_late(stack: Stack) -> None:
    """Cancelling a stalled GET shuts its socket: it ends now, not at the read timeout."""
    data = b"\x11" * (4 * PART)
    plan = FaultPlan([Rule(Stall(30.0, fraction=0.5), method="GET", range=r"^bytes=[1-9]")])
    async with source_through(stack, plan, data) as (src, url, _key):
        head, _ = await src.read_first(url, memoryview(bytearray(PART)))
        target = bytearray(b"\xee" * (2 * PART))
        started = anyio.current_time()
        with anyio.move_on_after(0.3):
            await src.read_into(url, head, ByteRange(PART, 3 * PART), memoryview(target))
        elapsed = anyio.current_time() - started
        await anyio.sleep(0.2)
        after_cancel = bytes(target)
        await anyio.sleep(0.3)
    assert elapsed < READ_TIMEOUT_S  # the read timeout would end it only at 1 s
    assert bytes(target) == after_cancel  # nothing wrote into the buffer after the cancel


@dataclass(frozen=True, slots=True)
class GiveUp:
    fault: Fault
    method: str
    error: type[IngestError]
    attempts: int


GIVE_UP = {
    "503-get": GiveUp(Status.slow_down(), "GET", SourceUnavailable, MAX_ATTEMPTS),
    "500-first": GiveUp(Status.internal_error(), "FIRST", SourceUnavailable, MAX_ATTEMPTS),
    "reset-get": GiveUp(Reset(0.25), "GET", TruncatedBody, MAX_ATTEMPTS),
    "short-get": GiveUp(ShortBody(0.9), "GET", TruncatedBody, MAX_ATTEMPTS),
    "short-declared-get": GiveUp(
        ShortBody(0.9, honest_length=True), "GET", TruncatedBody, MAX_ATTEMPTS
    ),
    "403-get": GiveUp(Status.access_denied(), "GET", AccessDenied, 1),
    "403-first": GiveUp(Status.access_denied(), "FIRST", AccessDenied, 1),
    "404-first": GiveUp(Status(404, "NoSuchKey"), "FIRST", ObjectNotFound, 1),
}


@pytest.mark.parametrize("case", sorted(GIVE_UP))
async def test_source_gives_up_after_bounded_attempts(stack: Stack, case: str) -> None:
    spec = GIVE_UP[case]
    data = b"\x5a" * (2 * PART)
    first = spec.method == "FIRST"  # the first GET (no If-Match) rather than a later range
    plan = FaultPlan(
        [Rule(spec.fault, "GET", range=r"^bytes=0-" if first else "^bytes=[1-9]", times=None)]
    )
    async with source_through(stack, plan, data) as (src, url, key):

        async def first_then_read() -> None:
            head, _ = await src.read_first(url, memoryview(bytearray(PART)))
            await src.read_into(url, head, ByteRange(PART, 2 * PART), memoryview(bytearray(PART)))

        with pytest.raises(IngestError) as caught:
            await first_then_read()
    assert type(caught.value) is spec.error, caught.value
    assert caught.value.attempts == spec.attempts
    requests = [r for r in plan.seen("GET", key) if r.range != "bytes=0-65535" or first]
    assert len(requests) == spec.attempts
    # capped backoff: no wait between attempts beyond the cap (plus generous slack for a
    # loaded machine; uncapped waits would still be small here, this guards against hangs)
    gaps = [b.at - a.at for a, b in itertools.pairwise(requests)]
    assert all(gap < RETRY_MAX_WAIT_S + 2.0 for gap in gaps), gaps


# -- the worker ---------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerRun:
    names: harness.Names
    processed: set[str]
    dead: dict[str, dict[str, Any]]
    results: dict[str, Mapping[str, Any]]


async def run_worker_through(
    stack: Stack,
    plan: FaultPlan,
    objects: Mapping[str, bytes],
    names: harness.Names,
    **overrides: str,
) -> WorkerRun:
    """Upload ``objects`` (keys relative to the source bucket), announce each, run the worker."""
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    async with proxied(stack, plan) as proxy:
        with anyio.fail_after(45):
            run = await harness.run_worker(
                settings_for(stack, names, proxy, **overrides), stop_after=len(objects)
            )
    processed = {o.ref.key for o in run.outcomes if o.ref and o.processed}
    dead = {d["key"]: d for d in await harness.read_json_topic(stack, names.dlq_topic)}
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    return WorkerRun(names, processed, dead, results)


async def assert_bit_exact(stack: Stack, run: WorkerRun, expected: Mapping[str, bytes]) -> None:
    """Every key's output equals the reference of ``expected[key]``; sidecars name that version."""
    out = f"out/{run.names.source_bucket}"
    for key, data in expected.items():
        want = reference_array(data, None, "float32")
        got = harness.load_npy(
            await harness.get_object(stack, run.names.output_bucket, f"{out}/{key}.npy")
        )
        assert got.shape == want.shape, key
        assert got.tobytes() == want.tobytes(), key
        side = harness.load_json(
            await harness.get_object(stack, run.names.output_bucket, f"{out}/{key}.json")
        )
        assert side == run.results[key]
        assert side["source"]["crc64nvme"] == harness.crc64nvme(data), key
        assert side["source"]["size"] == len(data), key
        etag = await upstream_etag(stack, run.names.source_bucket, key)
        assert side["source"]["etag"] == etag, key


def fresh_names(stack: Stack) -> harness.Names:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    return names


async def test_worker_retries_transient_faults_and_outputs_stay_bit_exact(stack: Stack) -> None:
    objects = {
        "small/CT_small.dcm": example_bytes("CT_small.dcm"),
        "small/MR_small.dcm": example_bytes("MR_small.dcm"),
        "multi/mf16.dcm": synthetic_multiframe(12, 128, 96),  # header read + 5 chunks
        "multi/mf8.dcm": synthetic_multiframe(8, 128, 128, bits_allocated=8),
        **{f"ct/{k}": d for k, d in synthetic_ct_series(3, rows=128, columns=128)},
    }
    names = fresh_names(stack)
    src = names.source_bucket

    def once(
        fault: Fault, key: str, *, method: str = "GET", range: str | None = None, times: int = 1
    ) -> Rule:
        """Fires ``times`` times in all, at most once per (method, key, range)."""
        return Rule(fault, method, key, src, range, times=times, per_request=1)

    # At most two of these rules reach one request, plus the background one: no request
    # sees more than MAX_ATTEMPTS - 1 faults, so every one must end in success.
    counted = [
        once(Status.internal_error(), "ct/*", range=r"^bytes=0-", times=2),
        once(Status.slow_down(), "small/CT_small.dcm", range=r"^bytes=0-"),
        once(Stall(STALL_S), "small/CT_small.dcm"),
        once(ShortBody(0.5), "small/MR_small.dcm"),
        once(ShortBody(0.3, honest_length=True), "ct/*", times=3),
        once(Status.slow_down(), "multi/mf16.dcm", range=r"^bytes=[1-9]", times=2),
        once(Stall(STALL_S, fraction=0.5), "multi/mf16.dcm", range=r"^bytes=0-"),
        once(Reset(0.5), "multi/mf8.dcm", times=3),
        once(ShortBody(0.7), "multi/mf8.dcm", range=r"^bytes=[1-9]"),
    ]
    background = Rule(
        Status.internal_error(), probability=0.15, times=None, bucket=src, per_request=1
    )
    plan = FaultPlan([*counted, background], seed=20261121)

    run = await run_worker_through(stack, plan, objects, names)

    assert run.dead == {}
    assert run.processed == set(objects)
    await assert_bit_exact(stack, run, objects)
    for rule in counted:
        assert rule.fired == rule.times, rule
    # every kind was injected; short bodies among them, and none was taken as data
    kinds = set(plan.injected)
    assert {"500 InternalError", "503 SlowDown", "reset", "stall", "stall_mid_body"} <= kinds
    assert plan.injected["short_body"] >= 2
    assert plan.injected["short_body_declared"] == 3


async def test_worker_dead_letters_persistent_failures_and_keeps_going(stack: Stack) -> None:
    good = {
        "ok/CT_small.dcm": example_bytes("CT_small.dcm"),
        "ok/mf16.dcm": synthetic_multiframe(12, 128, 96),
    }
    bad = {
        "fail/first-503.dcm": example_bytes("MR_small.dcm"),
        "fail/chunk-500.dcm": synthetic_multiframe(8, 128, 128, bits_allocated=8),
        "fail/denied.dcm": example_bytes("CT_small.dcm"),
        "fail/truncated.dcm": synthetic_multiframe(5, 64, 64, bits_allocated=16, signed=True),
    }
    names = fresh_names(stack)

    def always(fault: Fault, key: str, method: str = "GET", range: str | None = None) -> Rule:
        return Rule(fault, method, key, names.source_bucket, range, times=None)

    plan = FaultPlan(
        [
            always(Status.slow_down(), "fail/first-503.dcm"),
            always(Status.internal_error(), "fail/chunk-500.dcm", range=r"^bytes=[1-9]"),
            always(Status.access_denied(), "fail/denied.dcm"),
            always(ShortBody(0.5, honest_length=True), "fail/truncated.dcm"),
        ]
    )

    run = await run_worker_through(stack, plan, {**good, **bad}, names)

    assert run.processed == set(good)
    await assert_bit_exact(stack, run, good)
    assert {k: (d["reason"], d["attempts"]) for k, d in run.dead.items()} == {
        "fail/first-503.dcm": ("source_unavailable", MAX_ATTEMPTS),
        "fail/chunk-500.dcm": ("source_unavailable", MAX_ATTEMPTS),
        "fail/denied.dcm": ("access_denied", 1),
        "fail/truncated.dcm": ("truncated_body", MAX_ATTEMPTS),
    }
    for key, dead in run.dead.items():  # enough to tell what went wrong, and where
        assert dead["step"] == "get", (key, dead)
        assert dead["error"].startswith("GET bytes="), (key, dead)
    assert len(plan.seen("GET", "fail/first-503.dcm")) == MAX_ATTEMPTS  # bounded
    assert plan.seen("HEAD", "fail/first-503.dcm") == []  # no HEAD: the first GET tells all
    assert len(plan.seen("GET", "fail/denied.dcm")) == 1  # a 403 is not retried
    assert len(plan.seen("GET", "fail/truncated.dcm")) == MAX_ATTEMPTS
    assert plan.injected["short_body_declared"] == MAX_ATTEMPTS
    outputs = f"out/{names.source_bucket}"
    async with harness.s3_client(stack) as s3:
        listed = await s3.list_objects_v2(Bucket=names.output_bucket, Prefix=f"{outputs}/fail/")
    assert listed.get("KeyCount", 0) == 0  # nothing partial for the failed ones


async def test_worker_rereads_an_object_replaced_while_read(stack: Stack) -> None:
    old_large = synthetic_multiframe(12, 128, 96)
    new_large = synthetic_multiframe(10, 128, 96, per_frame_rescale=False)
    slices = [d for _, d in synthetic_ct_series(2, rows=96, columns=96)]
    restless = tuple(synthetic_multiframe(12 + i, 128, 96) for i in range(64))
    objects = {
        "replace/large.dcm": old_large,  # replaced at its 3rd ranged GET (a Pixel Data chunk)
        "replace/small.dcm": slices[0],  # replaced at its first GET
        "replace/restless.dcm": old_large,  # replaced at every GET
        "ok/CT_small.dcm": example_bytes("CT_small.dcm"),
    }
    names = fresh_names(stack)
    src = names.source_bucket
    plan = FaultPlan(
        [
            Rule(Replace((new_large,)), key="replace/large.dcm", bucket=src, skip=2),
            Rule(Replace((slices[1],)), key="replace/small.dcm", bucket=src),
            # a new version at every GET, never one seen before: with ranges read
            # concurrently, alternating two bodies could bring the ETag the first GET
            # saw back just in time for a range, which then (rightly) matches
            Rule(Replace(restless), key="replace/restless.dcm", bucket=src, times=None),
        ]
    )

    run = await run_worker_through(stack, plan, objects, names)

    assert run.processed == {"replace/large.dcm", "replace/small.dcm", "ok/CT_small.dcm"}
    await assert_bit_exact(
        stack,
        run,
        {
            "replace/large.dcm": new_large,
            "replace/small.dcm": slices[1],
            "ok/CT_small.dcm": objects["ok/CT_small.dcm"],
        },
    )
    dead = run.dead["replace/restless.dcm"]
    assert (dead["reason"], dead["attempts"]) == ("object_changed", 3)
    assert len(first_gets(plan, "replace/restless.dcm")) == 3
    assert list(run.dead) == ["replace/restless.dcm"]
    # the large object was read twice from the start: the old version, then the new one
    assert len(first_gets(plan, "replace/large.dcm")) == 2
    # a small object is read in one GET, which cannot mix versions: no re-read was needed
    assert len(plan.seen("GET", "replace/small.dcm")) == 1
    assert plan.injected["replace"] >= 2 + 3 * 2  # restless: replaced at every GET, 2+ a try


def first_gets(plan: FaultPlan, key: str) -> list[Any]:
    """The GETs that began a read of ``key`` from its first byte (one per version tried)."""
    return [r for r in plan.seen("GET", key) if (r.range or "").startswith("bytes=0-")]


async def test_worker_rereads_a_replaced_object_whose_output_is_multipart(stack: Stack) -> None:
    """The 412 arrives after the output's multipart upload has begun (outputs > 16 MiB)."""
    old = synthetic_multiframe(65, 256, 256, bits_allocated=8)  # 4.2 MB in, 17 MB float32 out
    new = synthetic_multiframe(66, 256, 256, bits_allocated=8)
    names = fresh_names(stack)
    # 256 KiB parts: the first 8 MiB output part is sent after ~9 GETs; replace at the 13th
    plan = FaultPlan([Rule(Replace((new,)), key="huge.dcm", bucket=names.source_bucket, skip=12)])

    run = await run_worker_through(stack, plan, {"huge.dcm": old}, names, part_size=str(256 * 1024))

    assert run.dead == {}
    assert run.processed == {"huge.dcm"}
    await assert_bit_exact(stack, run, {"huge.dcm": new})
    assert len(first_gets(plan, "huge.dcm")) == 2


async def test_worker_retries_output_faults_and_dead_letters_a_denied_output(
    stack: Stack,
) -> None:
    """Output PUTs (single, multipart parts, sidecars) go through the same retry policy."""
    objects = {
        "small/CT_small.dcm": example_bytes("CT_small.dcm"),
        "multi/big.dcm": synthetic_multiframe(70, 256, 256, bits_allocated=8),  # 18 MB out
        **{f"ct/{k}": d for k, d in synthetic_ct_series(3, rows=128, columns=128)},
    }
    denied = {"denied/MR_small.dcm": example_bytes("MR_small.dcm")}
    names = fresh_names(stack)
    out = names.output_bucket
    plan = FaultPlan(
        [
            Rule(Status.internal_error(), "PUT", "*/ct/*.npy", out, times=2, per_request=1),
            Rule(Status.internal_error(), "PUT", "*/multi/*.npy", out, times=2),  # parts
            Rule(Status.slow_down(), "PUT", "*/small/*.json", out, times=1),
            Rule(Status.slow_down(), "PUT", "*/ct/*.json", out, times=1),
            Rule(Status.access_denied(), "PUT", "*/denied/*", out, times=None),
        ]
    )

    run = await run_worker_through(
        stack, plan, {**objects, **denied}, names, part_size=str(256 * 1024)
    )

    assert run.processed == set(objects)
    await assert_bit_exact(stack, run, objects)
    assert [r.fired for r in plan.rules[:4]] == [2, 2, 1, 1]
    big = f"out/{names.source_bucket}/multi/big.dcm.npy"
    assert sum("uploadId" in r.query for r in plan.seen("PUT", big, out)) >= 2  # multipart
    dead = run.dead["denied/MR_small.dcm"]
    assert (dead["reason"], dead["step"], dead["attempts"]) == ("sink", "sink", 1), dead
    assert "access denied" in dead["error"], dead


async def test_worker_reads_on_after_the_server_closed_its_idle_connections(
    stack: Stack,
) -> None:
    """Reported: a worker idle for 400 s dead-lettered the next object (64 MB, multi-frame)
    as ``source_unavailable`` after its attempts, each on a keep-alive connection that
    SeaweedFS had closed meanwhile (it closes them after 120 s idle). Here the proxy
    closes idle connections after a fraction of a second: the object after the pause
    must be processed, and a dead connection must not cost an attempt."""
    names = fresh_names(stack)
    first = {"multi/before.dcm": synthetic_multiframe(40, 128, 128)}  # 20 ranges, 1.3 MB out
    after = {"multi/after.dcm": synthetic_multiframe(24, 128, 96)}
    await harness.upload(stack, names.source_bucket, [*first.items(), *after.items()])
    idle_s = 0.3
    outcomes: list[Outcome] = []
    reached = {1: anyio.Event(), 2: anyio.Event()}

    def on_outcome(outcome: Outcome) -> None:
        outcomes.append(outcome)
        reached[len(outcomes)].set()

    async with proxied(stack, FaultPlan([]), idle_timeout_s=idle_s) as proxy:
        # one attempt per request: any dead connection used would dead-letter the object
        worker = Worker(settings_for(stack, names, proxy, max_attempts="1"), on_outcome)
        async with anyio.create_task_group() as group:
            await group.start(worker.run)
            await harness.publish(
                stack, names.source_topic, [harness.aws_notification(names.source_bucket, first)]
            )
            with anyio.fail_after(30):
                await reached[1].wait()
            assert worker._ctx is not None
            pooled = worker._ctx.source.connections_opened
            assert pooled >= 2, pooled  # connections that will be dead after the pause
            await anyio.sleep(idle_s * 5)  # the proxy closes every one of them
            await harness.publish(
                stack, names.source_topic, [harness.aws_notification(names.source_bucket, after)]
            )
            with anyio.fail_after(30):
                await reached[2].wait()
            worker.stop()
    assert [(o.ref.key if o.ref else None, o.error) for o in outcomes] == [
        ("multi/before.dcm", None),
        ("multi/after.dcm", None),
    ]
    assert await harness.read_json_topic(stack, names.dlq_topic) == []
