"""``dicom-ingest demo``: the whole job on the embedded default, no GPU or network needed.

Starts the embedded broker and S3 server, uploads a mixed set of sample
objects (pydicom's own example files, a synthetic CT series, a large
multi-frame object, a CT slice in each compressed syntax we can write, JPEG
baseline captures, a small JPEG-tiled whole-slide image, one object that is
not DICOM), publishes their
notifications in the AWS, MinIO and EventBridge formats plus one malformed
record, runs the real worker until every object is accounted for, checks the
dead-letter and audit topics, and prints a summary table.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote_plus

import anyio
from aiobotocore.session import get_session
from aiokafka import AIOKafkaProducer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ingest.audit.verify import object_records, verify_trail
from ingest.embedded.samples import OK, Sample, demo_objects
from ingest.embedded.samples_compressed import compressed_samples
from ingest.embedded.stack import create_topics, embedded_stack
from ingest.settings import load_settings
from ingest.source.kafka import read_topic
from ingest.worker import Outcome, Worker

SOURCE = "dicom-source"
OUTPUT = "dicom-output"
TOPICS = (
    "s3-events",
    "dicom-ingest.results",
    "dicom-ingest.dlq",
    "dicom-ingest.audit",
)


@dataclass(frozen=True, slots=True)
class Expectation:
    key: str
    size: int
    expect: str  # "ok", or the reason code it must be dead-lettered with


def aws_record(
    bucket: str, key: str, size: int, sequencer: int, event: str = "Put"
) -> dict[str, Any]:
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "awsRegion": "us-east-1",
        "eventTime": "2026-11-21T00:00:00.000Z",
        "eventName": f"ObjectCreated:{event}" if event != "Delete" else "ObjectRemoved:Delete",
        "s3": {
            "s3SchemaVersion": "1.0",
            "bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
            "object": {"key": quote_plus(key), "size": size, "sequencer": f"{sequencer:016X}"},
        },
    }


def notifications(bucket: str, objects: list[Expectation]) -> list[bytes]:
    """Messages in several real formats; one carries two records, one is malformed."""
    messages: list[bytes] = []
    for i, obj in enumerate(objects):
        if i % 5 == 1:  # MinIO: the same records plus EventName/Key
            record = aws_record(bucket, obj.key, obj.size, i)
            record["eventName"] = "s3:ObjectCreated:Put"
            doc: dict[str, Any] = {
                "EventName": "s3:ObjectCreated:Put",
                "Key": f"{bucket}/{obj.key}",
                "Records": [record],
            }
        elif i % 5 == 2:  # EventBridge
            doc = {
                "version": "0",
                "detail-type": "Object Created",
                "source": "aws.s3",
                "time": "2026-11-21T00:00:00Z",
                "detail": {
                    "version": "0",
                    "bucket": {"name": bucket},
                    "object": {"key": obj.key, "size": obj.size, "sequencer": f"{i:016X}"},
                    "reason": "PutObject",
                },
            }
        elif i % 5 == 3:  # AWS, with a removal record that must be skipped
            doc = {
                "Records": [
                    aws_record(bucket, obj.key, obj.size, i),
                    aws_record(bucket, "gone.dcm", 0, i, "Delete"),
                ]
            }
        else:
            doc = {"Records": [aws_record(bucket, obj.key, obj.size, i)]}
        messages.append(json.dumps(doc).encode())
    messages.append(b"this is not a notification {")
    return messages


async def upload(samples: Iterable[Sample]) -> None:
    async with get_session().create_client(
        "s3", endpoint_url=os.environ["DICOM_INGEST_S3_ENDPOINT_URL"]
    ) as s3:
        limiter = anyio.CapacityLimiter(8)

        async def put(sample: Sample) -> None:
            async with limiter:
                body = await anyio.to_thread.run_sync(sample.read)
                await s3.put_object(Bucket=SOURCE, Key=sample.key, Body=body)

        async with anyio.create_task_group() as group:
            for sample in samples:
                group.start_soon(put, sample)


async def publish(bootstrap: str, messages: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for message in messages:
            await producer.send_and_wait("s3-events", message)
    finally:
        await producer.stop()


async def run_demo(device: str, multiframe_mb: int, series: int) -> int:
    console = Console()
    with embedded_stack() as stack:
        os.environ.update(stack.endpoints.environment())
        stack.s3.create_bucket(SOURCE)
        stack.s3.create_bucket(OUTPUT)
        create_topics(stack.kafka.bootstrap, TOPICS, partitions=2)
        key = os.urandom(32)
        settings = load_settings(
            {
                **stack.endpoints.environment(),
                "DICOM_INGEST_OUTPUT_URL": f"s3://{OUTPUT}/processed/",
                "DICOM_INGEST_AUDIT_KEY": base64.b64encode(key).decode(),
                "DICOM_INGEST_DEVICE": device,
                "DICOM_INGEST_WORKER_ID": "demo-worker",
            }
        )
        with console.status("Preparing sample objects and uploading them to S3 ..."):
            frames = max(1, multiframe_mb * 1_000_000 // (512 * 512 * 2))
            samples = await anyio.to_thread.run_sync(
                functools.partial(
                    demo_objects,
                    stack.workdir,
                    ct_slices=series,
                    multiframe_shape=(frames, 512, 512),
                )
            )
            compressed = await anyio.to_thread.run_sync(compressed_samples)
            samples += [Sample(key, data, OK) for key, data in compressed]
            await upload(samples)
            expected = [Expectation(s.key, s.size, s.expect) for s in samples]
            await publish(stack.kafka.bootstrap, notifications(SOURCE, expected))
        outcomes: list[Outcome] = []
        total = len(expected) + 1  # + the malformed notification
        with Progress(
            TextColumn("[bold]processing"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            bar = progress.add_task("objects", total=total)
            worker: Worker

            def on_outcome(outcome: Outcome) -> None:
                outcomes.append(outcome)
                progress.advance(bar)
                if len(outcomes) >= total:
                    worker.stop()

            worker = Worker(settings, on_outcome)
            with anyio.fail_after(600):
                await worker.run()
        dlq = [json.loads(v) for v in await read_topic(stack.kafka.bootstrap, settings.dlq_topic)]
        trail = verify_trail(  # records, digests and signatures (`audit verify`)
            await read_topic(stack.kafka.bootstrap, settings.audit_topic),
            keys={settings.audit_key_id: key},
            trust_on_first_use=True,  # the demo's worker signs with a key of its own
        )
        audit = object_records(trail.records)  # less the application's start and stop
        _print_table(console, outcomes, worker.backend)
        return _verdict(console, expected, outcomes, dlq, audit, trail.ok)


def _print_table(console: Console, outcomes: list[Outcome], backend: str) -> None:
    table = Table(title=f"dicom-ingest demo ({backend} backend)")
    table.add_column("object", overflow="fold")
    table.add_column("shape")
    table.add_column("backend")
    table.add_column("MB/s", justify="right")
    table.add_column("outcome")
    for o in sorted(outcomes, key=lambda o: o.ref.key if o.ref else "~"):
        name = o.ref.key if o.ref else "(malformed notification)"
        if o.processed is not None:
            p = o.processed
            rate = p.head.size / 1e6 / p.timings.total_s if p.timings.total_s else 0.0
            shape = "x".join(map(str, p.header.pixel.shape))
            table.add_row(name, shape, p.backend, f"{rate:,.1f}", "[green]processed")
        elif o.error is not None:
            table.add_row(name, "-", "-", "-", f"[yellow]dead-letter: {o.error.reason}")
    console.print(table)


def _verdict(
    console: Console,
    expected: list[Expectation],
    outcomes: list[Outcome],
    dlq: list[dict[str, Any]],
    audit: list[dict[str, Any]],
    chain_ok: bool,
) -> int:
    processed = {o.ref.key for o in outcomes if o.ref and o.processed}
    dead = {d["key"]: d["reason"] for d in dlq}
    problems = []
    for e in expected:
        if e.expect == "ok" and e.key not in processed:
            problems.append(f"{e.key} was not processed ({dead.get(e.key, 'no outcome')})")
        elif e.expect != "ok" and dead.get(e.key) != e.expect:
            problems.append(f"{e.key}: expected dead-letter '{e.expect}', got {dead.get(e.key)}")
    if not any(d["key"] is None for d in dlq):
        problems.append("the malformed notification is not in the dead-letter topic")
    if len(audit) != len(outcomes):
        problems.append(f"{len(audit)} audit records for {len(outcomes)} outcomes")
    if not chain_ok:
        problems.append("the audit trail does not verify (dicom-ingest audit verify)")
    console.print(
        f"processed {len(processed)}, dead-lettered {len(dlq)} "
        f"(reasons: {', '.join(sorted({d['reason'] for d in dlq}))}), "
        f"audit records decrypted and chain-verified: {len(audit)}"
    )
    for problem in problems:
        console.print(f"[red]problem: {problem}")
    return 1 if problems else 0
