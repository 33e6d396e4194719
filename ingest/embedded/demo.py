"""``dicom-ingest demo``: the whole job on the embedded default, no GPU or network needed.

Starts the embedded broker and S3 server, uploads a mixed set of sample
objects (pydicom's own example files, a synthetic CT series, a large
multi-frame object, a CT slice in each compressed syntax we can write, JPEG
baseline captures, a small JPEG-tiled whole-slide image, one object that is
not DICOM), publishes their
notifications in the AWS, MinIO and EventBridge formats plus one malformed
record, runs the real worker until every object is accounted for, checks the
dead-letter and audit topics, and prints a summary table, the series volumes
the worker assembled (``SERIES=volume``: the CT series' slices in one array with
its affine) and the slide's place of each tile in its whole matrix.
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
                "DICOM_INGEST_SERIES": "volume",
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
        volumes = await _series_volumes(settings.output_prefix)
        _print_table(console, outcomes, worker.backend)
        _print_volumes(console, volumes)
        _print_slides(console, outcomes)
        verdict = _verdict(console, expected, outcomes, dlq, audit, trail.ok)
        if not any(v["complete_by_data"] and v["npy"] for v in volumes):
            console.print("[red]problem: the CT series was not written as a volume")
            verdict = 1
        return verdict


async def _series_volumes(prefix: str) -> list[dict[str, Any]]:
    """The newest sidecar of each series volume the worker wrote."""
    async with get_session().create_client(
        "s3", endpoint_url=os.environ["DICOM_INGEST_S3_ENDPOINT_URL"]
    ) as s3:
        found = []
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=OUTPUT, Prefix=f"{prefix}series/"
        )
        async for page in pages:
            for item in page.get("Contents", []):
                if item["Key"].endswith("/latest.json"):
                    answer = await s3.get_object(Bucket=OUTPUT, Key=item["Key"])
                    async with answer["Body"] as body:
                        found.append(json.loads(await body.read()))
        return found


def _print_volumes(console: Console, volumes: list[dict[str, Any]]) -> None:
    table = Table(title="series volumes (SERIES=volume)")
    table.add_column("series", overflow="fold")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("spacing mm (slice, row, column)")
    table.add_column("origin (LPS mm)")
    table.add_column("complete")
    for v in sorted(volumes, key=lambda v: -len(v["slices"])):
        affine = v["affine"]
        if affine is None:
            spacing, origin = "-", "; ".join(v["refused"]) or "-"
        else:
            steps = [sum(affine[i][k] ** 2 for i in range(3)) ** 0.5 for k in range(3)]
            spacing = ", ".join(f"{s:.3g}" for s in steps)
            origin = ", ".join(f"{affine[i][3]:.1f}" for i in range(3))
        table.add_row(
            "..." + v["series_instance_uid"][-12:],
            "x".join(map(str, v["shape"])),
            v["dtype"],
            spacing,
            origin,
            "by Images in Acquisition" if v["complete_by_data"] else "after the quiet period",
        )
    console.print(table)


def _print_slides(console: Console, outcomes: list[Outcome]) -> None:
    for o in outcomes:
        slide = o.processed.header.slide if o.processed else None
        if slide is None or o.ref is None:
            continue
        places = slide.frame_places()
        console.print(
            f"[bold]{o.ref.key}[/bold]: {slide.frames} tiles of {slide.tile_rows}x"
            f"{slide.tile_columns} in a {slide.total_rows}x{slide.total_columns} matrix"
            f" ({slide.dimension_organization}), pixel spacing {slide.pixel_spacing} mm,"
            f" optical paths {list(slide.optical_paths)}"
        )
        table = Table(title="each tile's place in the matrix")
        table.add_column("frame", justify="right")
        table.add_column("matrix column", justify="right")
        table.add_column("matrix row", justify="right")
        for k in range(min(slide.frames, 8)):
            column, row = (places[0][k], places[1][k]) if places else ("-", "-")
            table.add_row(str(k), str(column), str(row))
        console.print(table)


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
