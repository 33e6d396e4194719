"""``dicom-ingest backfill`` against the real S3 server and broker: thousands of keys, a
kill and a resume, the rate, a dry run, the times; folders under a file root."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from ingest.embedded.stack import Stack, create_topics
from ingest.errors import ConfigError
from ingest.settings import Settings, load_settings
from ingest.source import backfill as backfill_module
from ingest.source.backfill import (
    HEADER,
    Spec,
    backfill,
    chunk_size,
    default_checkpoint,
    parse_source,
    read_checkpoint,
)
from ingest.source.kafka import read_records
from ingest.source.notifications import parse_notification
from ingest.worker import Worker
from tests import harness
from tests.conftest import FreshNames

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

KEYS = 400  # a page of S3's listing, or four with the dry run's pages of 100
MANY_KEYS = 5000  # the slow test's: five pages and a kill, and a worker after it


def _key(n: int) -> str:
    return f"archive/{n // 100:02d}/slice {n:05d}+.dcm"  # spaces and '+' to encode


def _upload(stack: Stack, bucket: str, count: int) -> str:
    """``count`` small objects in a new bucket ``bucket``."""
    stack.s3.create_bucket(bucket)

    async def upload() -> None:
        limit = anyio.Semaphore(32)
        async with harness.s3_client(stack) as s3, anyio.create_task_group() as group:

            async def put(n: int) -> None:
                async with limit:
                    await s3.put_object(Bucket=bucket, Key=_key(n), Body=b"%d" % n)

            for n in range(count):
                group.start_soon(put, n)

    anyio.run(upload, backend="asyncio")
    return bucket


@pytest.fixture(scope="module")
def archive(stack: Stack) -> str:
    """A bucket of ``KEYS`` small objects, uploaded once for this module's tests."""
    return _upload(stack, f"b-backfill-{os.getpid()}", KEYS)


def _settings(stack: Stack, topic: str, **extra: str) -> Settings:
    env = {**stack.endpoints.environment(), "DICOM_INGEST_SOURCE_TOPIC": topic}
    env.update({f"DICOM_INGEST_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env, required=("kafka_bootstrap",))


async def _published(stack: Stack, topic: str) -> list[Any]:
    return await read_records(stack.kafka.bootstrap, topic, missing_ok=True)


def _keys(records: list[Any]) -> Counter[str]:
    keys: Counter[str] = Counter()
    for record in records:
        for ref in parse_notification(record.value).objects:
            keys[ref.key] += 1
    return keys


async def test_a_killed_backfill_resumes_and_publishes_each_key_once_more_at_most_a_chunk(
    stack: Stack,
    aws_environment: None,
    archive: str,
    fresh_names: FreshNames,
    tmp_path: Path,
) -> None:
    await _kill_and_resume(stack, archive, KEYS, fresh_names.topic(), tmp_path, work=False)


@pytest.mark.slow
async def test_thousands_of_keys_killed_and_resumed(
    stack: Stack, aws_environment: None, fresh_names: FreshNames, tmp_path: Path
) -> None:
    bucket = await anyio.to_thread.run_sync(_upload, stack, fresh_names.bucket(), MANY_KEYS)
    await _kill_and_resume(stack, bucket, MANY_KEYS, fresh_names.topic(), tmp_path)


async def _kill_and_resume(
    stack: Stack, archive: str, count: int, topic: str, tmp_path: Path, *, work: bool = True
) -> None:
    """A backfill killed (SIGKILL) after a third of ``count`` keys, then resumed in-process;
    with ``work``, a worker then finishes each object once."""
    create_topics(stack.kafka.bootstrap, [topic])
    checkpoint = tmp_path / "run.json"
    rate = max(500.0, count / 2.5)  # a second or two
    env = {**os.environ, **stack.endpoints.environment(), "DICOM_INGEST_SOURCE_TOPIC": topic}
    command = [sys.executable, "-m", "ingest.cli", "backfill", f"s3://{archive}/archive/"]
    command += ["--rate", str(rate), "--checkpoint", str(checkpoint)]
    spec = Spec(f"s3://{archive}/archive/", topic)
    process = await anyio.open_process(command, env=env)
    try:
        with anyio.fail_after(60):  # until a third or so is published and checkpointed
            while (
                done := read_checkpoint(checkpoint, spec)
            ) is None or done.published < count // 3:
                assert process.returncode is None
                await anyio.sleep(0.02)
        process.send_signal(signal.SIGKILL)  # no clean-up of any kind
    finally:
        process.kill()
        await process.wait()
    killed_at = read_checkpoint(checkpoint, spec)
    assert killed_at is not None
    assert not killed_at.done
    assert killed_at.published < count
    assert killed_at.last is not None
    before = _keys(await _published(stack, topic))
    assert sum(before.values()) < count  # the kill came mid-way

    settings = _settings(stack, topic)
    resumed = await backfill(settings, spec, rate=rate, checkpoint=checkpoint)

    assert resumed.done
    assert resumed.resumed_from == killed_at.last
    records = await _published(stack, topic)
    keys = _keys(records)
    assert set(keys) == {_key(n) for n in range(count)}  # every object
    twice = [k for k, n in keys.items() if n > 1]
    assert all(n <= 2 for n in keys.values())
    assert len(twice) <= chunk_size(rate)  # only the chunk in flight at the kill
    assert all(k > killed_at.last for k in twice)  # published after the checkpoint's key
    assert resumed.published == count  # the counts went on from the checkpoint
    first = parse_notification(records[0].value).objects[0]
    assert (first.size, first.etag) == (len(b"%d" % 0), harness.md5(b"%d" % 0))
    assert {dict(r.headers)[HEADER] for r in records} == {spec.identity.encode()}
    again = await backfill(settings, spec, checkpoint=checkpoint)  # finished: nothing more
    assert again.finished_before
    assert len(await _published(stack, topic)) == len(records)
    if work:
        await _each_object_once(stack, topic, count, len(records), len(twice))


async def _each_object_once(
    stack: Stack, topic: str, count: int, records: int, repeats: int
) -> None:
    """A worker over the backfill's topic finishes each object once: the notifications
    published twice carry the ETag of a version it has finished, so it drops them."""
    names = harness.make_names(topic.removeprefix("t-"))
    harness.prepare(stack, names)
    settings = harness.make_settings(stack, names, source_topic=topic)
    outcomes: Counter[str] = Counter()
    worker = Worker(settings, lambda o: outcomes.update([o.ref.key if o.ref else ""]))
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        with anyio.fail_after(120):
            # the worker signals outcomes, not records consumed: a repeat it drops has none
            while worker.stats.records < records or sum(outcomes.values()) < count:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        worker.stop()
    assert set(outcomes) == {_key(n) for n in range(count)}
    assert max(outcomes.values()) == 1  # not DICOM: each dead-lettered, once
    assert worker.stats.duplicates == repeats


async def test_the_rate_is_kept(
    stack: Stack,
    aws_environment: None,
    archive: str,
    fresh_names: FreshNames,
    tmp_path: Path,
) -> None:
    topic = fresh_names.topic()
    create_topics(stack.kafka.bootstrap, [topic])
    spec = Spec(f"s3://{archive}/archive/00/", topic)  # 100 keys
    rate = 50.0
    started = time.monotonic()
    done = await backfill(_settings(stack, topic), spec, rate=rate, checkpoint=tmp_path / "c.json")
    elapsed = time.monotonic() - started
    assert done.published == 100
    assert elapsed >= (100 - chunk_size(rate)) / rate  # never ahead of the rate
    stamps = sorted(r.timestamp for r in await _published(stack, topic))
    for i, stamp in enumerate(stamps):  # in any second, the rate and one chunk at most
        later = [s for s in stamps[i:] if s < stamp + 1000]
        assert len(later) <= rate + chunk_size(rate)


async def test_a_dry_run_counts_and_publishes_nothing(
    stack: Stack,
    aws_environment: None,
    archive: str,
    fresh_names: FreshNames,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = fresh_names.topic()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(backfill_module, "PAGE", 100)  # the listing goes over four pages
    no_broker = {k: v for k, v in stack.endpoints.environment().items() if "KAFKA" not in k}
    settings = load_settings(no_broker, required=())  # a dry run needs no broker
    spec = Spec(f"s3://{archive}/archive/", topic)
    done = await backfill(settings, spec, dry_run=True)
    assert (done.listed, done.skipped, done.published) == (KEYS, 0, 0)
    assert done.bytes == sum(len(b"%d" % n) for n in range(KEYS))
    assert await _published(stack, topic) == []
    assert not await anyio.Path(default_checkpoint(spec)).exists()
    assert [p async for p in anyio.Path(tmp_path).iterdir()] == []


async def test_since_and_until_select_by_last_modified(
    stack: Stack,
    aws_environment: None,
    archive: str,
    fresh_names: FreshNames,
    tmp_path: Path,
) -> None:
    topic = fresh_names.topic()
    url = f"s3://{archive}/archive/00/"  # 100 keys
    settings = _settings(stack, topic)
    now = datetime.now(UTC)
    later = await backfill(settings, Spec(url, topic, since=now), dry_run=True)
    assert (later.listed, later.skipped) == (100, 100)  # uploaded before now
    window = Spec(url, topic, since=now - timedelta(hours=1), until=now + timedelta(minutes=1))
    assert (await backfill(settings, window, dry_run=True)).skipped == 0


async def test_files_under_a_root_are_walked_in_order_and_resumed(
    stack: Stack, fresh_names: FreshNames, tmp_path: Path
) -> None:
    root = tmp_path / "archive"
    names = ["a/x.dcm", "a/y/z.dcm", "a-b.dcm", "b/c/d.dcm", "b/e.dcm", "old.dcm"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(name.encode())
    os.utime(root / "old.dcm", (0, 0))
    (root / "link.dcm").symlink_to(root / "a-b.dcm")  # links are not listed
    topic = fresh_names.topic()
    create_topics(stack.kafka.bootstrap, [topic])
    settings = _settings(stack, topic, file_roots=f"scans={root}")
    since = datetime(2000, 1, 1, tzinfo=UTC)
    spec = Spec(f"file://{root}", topic, since=since)
    checkpoint = tmp_path / "files.json"
    done = await backfill(settings, spec, rate=10, checkpoint=checkpoint)  # chunks of one
    assert (done.listed, done.published, done.skipped) == (6, 5, 1)
    records = await _published(stack, topic)
    refs = [parse_notification(r.value, roots=settings.file_roots).objects[0] for r in records]
    order = ["a/x.dcm", "a/y/z.dcm", "a-b.dcm", "b/c/d.dcm", "b/e.dcm"]  # depth first
    assert [r.key for r in refs] == order
    assert {r.bucket for r in refs} == {"scans"}
    assert refs[0].size == len(b"a/x.dcm")
    assert refs[0].etag
    # a run stopped after "a/y/z.dcm" goes on with the rest only, and a sub-folder works
    doc = json.loads(checkpoint.read_text())
    doc["progress"] |= {"last": "a/y/z.dcm", "done": False, "published": 2}
    checkpoint.write_text(json.dumps(doc))
    resumed = await backfill(settings, spec, checkpoint=checkpoint)
    assert resumed.published == 5
    assert [r.key for r in _refs(await _published(stack, topic), settings)][5:] == order[2:]
    sub = await backfill(settings, Spec(f"file://{root}/b", topic), dry_run=True)
    assert (sub.listed, sub.skipped) == (2, 0)


def _refs(records: list[Any], settings: Settings) -> list[Any]:
    return [parse_notification(r.value, roots=settings.file_roots).objects[0] for r in records]


def test_urls_it_cannot_list_and_checkpoints_of_another_run_are_refused(tmp_path: Path) -> None:
    roots = (("scans", str(tmp_path)),)
    assert parse_source("s3://bucket/some prefix/", roots).prefix == "some prefix/"
    assert parse_source(f"file://{tmp_path}/a/b/", roots).prefix == "a/b"
    for url in ("http://x/y", "file:///etc", f"file://{tmp_path}/../x", "s3:///nobucket"):
        with pytest.raises(ConfigError):
            parse_source(url, roots)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"spec_id": "another", "progress": {}}))
    with pytest.raises(ConfigError, match="another backfill"):
        read_checkpoint(path, Spec("s3://b/p", "t"))


def test_the_command_line_counts_a_folder_and_refuses_what_it_cannot_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ingest.cli import main

    (tmp_path / "ct").mkdir()
    for n in range(3):
        (tmp_path / "ct" / f"{n}.dcm").write_bytes(b"x" * 10)
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("DICOM_INGEST_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DICOM_INGEST_FILE_ROOTS", f"scans={tmp_path}")
    assert main(["backfill", f"file://{tmp_path}/ct", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"backfill file://{tmp_path}/ct: would publish 3 notifications")
    assert "listed 3, skipped 0" in out
    assert main(["backfill", "file:///elsewhere", "--dry-run"]) == 2  # not under a root
    assert "not a folder under DICOM_INGEST_FILE_ROOTS" in capsys.readouterr().err
    assert main(["backfill", "s3://b/p"]) == 2  # publishing needs a broker
    assert "DICOM_INGEST_KAFKA_BOOTSTRAP" in capsys.readouterr().err
    since_after_until = ["--since", "2026-02-01", "--until", "2026-01-01", "--dry-run"]
    assert main(["backfill", "s3://b/p", *since_after_until]) == 2
    with pytest.raises(SystemExit):
        main(["backfill", "s3://b/p", "--rate", "-1"])
