"""``dicom-ingest backfill``: publish a notification for every object already stored.

An archive's objects were written before the worker ran, or must be processed
again with new settings; their notifications are long gone from the source topic.
Backfill walks a bucket prefix (``s3://bucket/prefix``) or a folder under a file
root (``file:///root/path``), keeps the objects last modified within
``[since, until)``, and publishes for each the notification the worker reads: an
AWS S3 event record (with size and ETag, so a worker that has the version
already drops the repeat), or a ``file://`` notification (size, and the version as
an ETag, ``ingest/fetch/files.py``).

How it stays within bounds and survives a kill:

- Listing is streamed: S3's ``ListObjectsV2`` a page (1,000 keys) at a time through
  aiobotocore's paginator, with botocore's retries; a folder one directory at a
  time, its names sorted. Memory holds a page (or the directories on the path from
  the root to the current one) and one chunk of messages, whatever the size of the
  archive.
- Both orders are total and stable: S3 lists keys in UTF-8 byte order; the walk goes
  depth first with names sorted, which is the order of the keys' tuples of path
  segments. So "everything up to key K" names a prefix of the walk.
- Messages go out in chunks; after a chunk's acknowledgements (``acks=all``) the
  checkpoint file is replaced (written aside, fsync'd, renamed) with the last key
  handled. A resumed run lists from after that key (S3's ``StartAfter``; the walk
  skips the directories and names before it), so after a kill at most one chunk,
  the one in flight, is published twice. Its objects' outputs are idempotent, and a
  worker that finished them already drops the repeats.
- ``rate`` paces the publication (objects a second, 0: as fast as the broker
  takes them): a chunk holds a tenth of a second's worth and leaves no earlier than
  the rate allows after the one before it, so no second holds more than the rate
  and one chunk.
- ``dry_run`` lists and counts, connects to no broker and writes no checkpoint.

Raises of this module's functions: ``ConfigError`` for a URL or checkpoint it
cannot use, ``SourceError`` (and subclasses) when listing fails, ``BrokerError``
when publishing fails; the checkpoint keeps what was acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

import anyio
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from aiokafka.errors import KafkaError

from ingest.errors import ConfigError, IngestError
from ingest.fetch.files import file_etag, translate_file_error
from ingest.fetch.s3 import translate_s3_error
from ingest.fetch.threaded_http import ca_bundle
from ingest.settings import Settings
from ingest.source.kafka import make_producer, translate_kafka_error
from ingest.source.notifications import file_object

HEADER = "dicom-ingest-backfill"  # Kafka header on every message: the run's checkpoint id
PAGE = 1000  # S3's largest ListObjectsV2 page
MAX_CHUNK = 1000  # messages awaited together before the checkpoint moves
CHECKPOINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Spec:
    """What one backfill publishes: the objects under ``url`` modified in [since, until)."""

    url: str  # s3://bucket/prefix or file:///path
    topic: str
    since: datetime | None = None
    until: datetime | None = None

    @property
    def identity(self) -> str:
        """Names the run's checkpoint: a resume must select the same objects."""
        text = json.dumps([self.url, self.topic, _iso(self.since), _iso(self.until)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def wants(self, modified: datetime) -> bool:
        return (self.since is None or modified >= self.since) and (
            self.until is None or modified < self.until
        )


@dataclass(frozen=True, slots=True)
class Listed:
    """One stored object, as the listing told it."""

    key: str  # S3: the object key; a file: its path below the listed folder's root
    size: int
    etag: str
    modified: datetime


@dataclass(slots=True)
class Progress:
    """What a run did; kept in the checkpoint, so a resumed run's counts go on."""

    listed: int = 0
    published: int = 0
    skipped: int = 0  # modified outside [since, until)
    bytes: int = 0  # of the objects published
    last: str | None = None  # the last key handled (published or skipped)
    done: bool = False
    resumed_from: str | None = None  # this run only: the key it started after
    finished_before: bool = False  # this run only: the checkpoint said done; nothing ran
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Source:
    """Where a backfill lists: an S3 bucket and prefix, or a folder under a file root."""

    scheme: str  # "s3" | "file"
    bucket: str  # S3: the bucket; a file: the root's name
    prefix: str  # S3: the key prefix; a file: the folder's path below the root ("" for it)
    folder: str = ""  # a file: the folder's absolute path
    root: str = ""  # a file: the root's absolute path


def parse_source(url: str, roots: tuple[tuple[str, str], ...]) -> Source:
    """The bucket and prefix (or the folder under its root) ``url`` names.

    Raises:
        ConfigError: not ``s3://bucket[/prefix]``, nor ``file:///path`` of a folder
            under one of ``roots``.
    """
    parts = urlsplit(url)
    if parts.scheme == "s3" and parts.netloc and not parts.query:
        return Source("s3", parts.netloc, unquote(parts.path.lstrip("/")))
    if parts.scheme == "file":
        path = unquote(parts.path).rstrip("/")
        for name, root in roots:
            if path == root.rstrip("/"):
                return Source("file", name, "", root, root)
        try:  # a file below the folder has a notification only if the folder is inside
            name, below = file_object(url.rstrip("/") + "/x", roots)
        except IngestError:
            raise ConfigError(
                f"backfill {url}: not a folder under DICOM_INGEST_FILE_ROOTS"
            ) from None
        below = below.removesuffix("x").rstrip("/")
        root = dict(roots)[name]
        return Source("file", name, below, f"{root.rstrip('/')}/{below}", root)
    raise ConfigError(f"backfill {url}: expected s3://bucket/prefix or file:///path")


def s3_notification(bucket: str, item: Listed) -> bytes:
    """An AWS S3 ``ObjectCreated:Put`` record for a listed object."""
    record = {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": "ObjectCreated:Put",
        "eventTime": _iso(item.modified),
        "s3": {
            "bucket": {"name": bucket},
            "object": {"key": quote_plus(item.key), "size": item.size, "eTag": item.etag},
        },
    }
    return json.dumps({"Records": [record]}, separators=(",", ":")).encode()


def file_notification(root: str, item: Listed) -> bytes:
    """A ``file://`` notification for a listed file (``item.key`` below ``root``)."""
    url = "file://" + quote(f"{root.rstrip('/')}/{item.key}")
    doc = {"url": url, "size": item.size, "etag": item.etag, "time": _iso(item.modified)}
    return json.dumps(doc, separators=(",", ":")).encode()


def segments(key: str) -> tuple[str, ...]:
    """A file key's place in the walk's order (depth first, names sorted)."""
    return tuple(key.split("/"))


# -- listing ----------------------------------------------------------------------


async def list_s3(settings: Settings, source: Source, after: str | None) -> AsyncIterator[Listed]:
    """The objects under ``source``'s prefix, in key order, from after key ``after``.

    Raises:
        SourceError: listing failed after botocore's retries.
    """
    config = AioConfig(
        retries={"max_attempts": settings.max_attempts, "mode": "standard"},
        connect_timeout=min(10.0, settings.read_timeout_s),
        read_timeout=settings.read_timeout_s,
        s3={"addressing_style": "path"} if settings.s3_endpoint_url else None,
    )
    session = get_session()
    verify = ca_bundle(settings.s3_ca_bundle)
    args: dict[str, Any] = {"Bucket": source.bucket, "Prefix": source.prefix}
    args["PaginationConfig"] = {"PageSize": PAGE}
    if after is not None:
        args["StartAfter"] = after
    try:
        async with session.create_client(
            "s3", endpoint_url=settings.s3_endpoint_url, config=config, verify=verify
        ) as client:
            async for page in client.get_paginator("list_objects_v2").paginate(**args):
                for entry in page.get("Contents", ()):
                    yield Listed(
                        entry["Key"],
                        int(entry["Size"]),
                        str(entry.get("ETag", "")).strip('"'),
                        entry["LastModified"],
                    )
    except IngestError:
        raise
    except Exception as exc:
        raise translate_s3_error(exc, "ListObjectsV2") from exc


async def list_files(source: Source, after: str | None) -> AsyncIterator[Listed]:
    """The regular files under ``source``'s folder, depth first with names sorted, from
    after key ``after``; keys are paths below the root. Symbolic links are not followed
    (a link's target is listed where it lies, if under the folder).

    Raises:
        SourceError: a folder could not be read (``translate_file_error``).
    """
    mark = segments(after) if after is not None else None
    base = segments(source.prefix) if source.prefix else ()

    def scan(folder: str) -> list[tuple[str, bool, os.stat_result | None]]:
        found: list[tuple[str, bool, os.stat_result | None]] = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    found.append((entry.name, True, None))
                elif entry.is_file(follow_symlinks=False):
                    found.append((entry.name, False, entry.stat(follow_symlinks=False)))
        return sorted(found)

    async def walk(folder: str, place: tuple[str, ...]) -> AsyncIterator[Listed]:
        try:
            entries = await anyio.to_thread.run_sync(scan, folder)
        except OSError as exc:
            raise translate_file_error(exc, "listing a folder") from exc
        for name, is_dir, st in entries:
            here = (*place, name)
            if mark is not None and here < mark[: len(here)]:
                continue  # all of it comes before the checkpoint
            if is_dir:
                async for item in walk(f"{folder}/{name}", here):
                    yield item
            elif st is not None and (mark is None or here > mark):
                modified = datetime.fromtimestamp(st.st_mtime_ns / 1e9, UTC)
                yield Listed("/".join(here), st.st_size, file_etag(st), modified)

    async for item in walk(source.folder, base):
        yield item


# -- the checkpoint ------------------------------------------------------------------


def default_checkpoint(spec: Spec) -> Path:
    """Where a run keeps its checkpoint unless told: the current folder, named by the spec."""
    return Path(f"dicom-ingest-backfill-{spec.identity}.json")


def read_checkpoint(path: Path, spec: Spec) -> Progress | None:
    """The progress a previous run of ``spec`` left at ``path``; None when there is none.

    Raises:
        ConfigError: the file is unreadable, or belongs to another backfill.
    """
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"backfill --checkpoint {path}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("spec_id") != spec.identity:
        raise ConfigError(
            f"backfill --checkpoint {path}: made by another backfill (URL, topic or times);"
            " give another file, or --restart"
        )
    fields = {k: v for k, v in doc.get("progress", {}).items() if k in Progress.__slots__}
    return Progress(**fields)


def write_checkpoint(path: Path, spec: Spec, progress: Progress) -> None:
    """Replace the checkpoint atomically: written aside, flushed to disk, renamed over."""
    doc = {
        "version": CHECKPOINT_VERSION,
        "spec_id": spec.identity,
        "spec": {"url": spec.url, "topic": spec.topic},
        "since": _iso(spec.since),
        "until": _iso(spec.until),
        "updated": _iso(datetime.now(UTC)),
        "progress": asdict(progress) | {"resumed_from": None, "finished_before": False},
    }
    aside = path.with_name(path.name + ".tmp")
    with open(aside, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# -- the run ----------------------------------------------------------------------


@dataclass(slots=True)
class _Pacer:
    """Holds publication to ``rate`` objects a second: a chunk leaves no earlier than its
    predecessor's size allows after it (a pause, a slow page, is not made up for)."""

    rate: float
    next: float = 0.0

    async def before(self, count: int) -> None:
        if self.rate <= 0:
            return
        await anyio.sleep(max(0.0, self.next - time.monotonic()))
        self.next = max(self.next, time.monotonic()) + count / self.rate


def chunk_size(rate: float) -> int:
    """Messages per chunk: a tenth of a second at ``rate``, 1 to ``MAX_CHUNK``."""
    return MAX_CHUNK if rate <= 0 else max(1, min(MAX_CHUNK, int(rate / 10)))


async def backfill(
    settings: Settings,
    spec: Spec,
    *,
    rate: float = 0.0,
    dry_run: bool = False,
    checkpoint: Path | None = None,
    restart: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
) -> Progress:
    """List ``spec``'s objects and publish their notifications (see the module's doc).

    ``on_progress`` is called after each chunk (and at the end).

    Raises:
        ConfigError, SourceError, BrokerError: see the module's doc.
    """
    source = parse_source(spec.url, settings.file_roots)
    path = checkpoint or default_checkpoint(spec)
    previous = None if restart else read_checkpoint(path, spec)
    progress = previous or Progress()
    if progress.done:
        progress.finished_before = True
        return progress
    if dry_run:  # what a run would publish now: counted afresh, from the checkpoint on
        progress = Progress(last=progress.last)
    progress.resumed_from = progress.last
    started = time.monotonic() - progress.seconds
    if source.scheme == "s3":
        listing = list_s3(settings, source, progress.last)

        def message(item: Listed) -> bytes:
            return s3_notification(source.bucket, item)
    else:
        listing = list_files(source, progress.last)

        def message(item: Listed) -> bytes:
            return file_notification(source.root, item)

    def report() -> None:
        progress.seconds = time.monotonic() - started
        if on_progress is not None:
            on_progress(progress)

    if dry_run:
        async for item in listing:
            _count(progress, spec, item)
            if progress.listed % PAGE == 0:
                report()
        report()
        return progress
    producer = make_producer(settings)
    await producer.start()
    try:
        pacer, size = _Pacer(rate), chunk_size(rate)
        chunk: list[tuple[bytes, bytes]] = []
        headers = [(HEADER, spec.identity.encode())]
        async for item in listing:
            if _count(progress, spec, item):
                chunk.append((message(item), item.key.encode()))
            if len(chunk) >= size:
                await pacer.before(len(chunk))
                await _publish(producer, spec.topic, chunk, headers)
                progress.published += len(chunk)
                progress.last = item.key
                chunk = []
                await anyio.to_thread.run_sync(write_checkpoint, path, spec, progress)
                report()
            elif progress.listed % PAGE == 0:
                report()  # a long run of objects outside the times: progress all the same
        await pacer.before(len(chunk))
        await _publish(producer, spec.topic, chunk, headers)
        progress.published += len(chunk)
        progress.done = True
        report()
        await anyio.to_thread.run_sync(write_checkpoint, path, spec, progress)
    finally:
        with anyio.CancelScope(shield=True):
            await producer.stop()
    return progress


def _count(progress: Progress, spec: Spec, item: Listed) -> bool:
    """Count ``item``; whether it is selected (its bytes then count too)."""
    progress.listed += 1
    progress.last = item.key
    if not spec.wants(item.modified):
        progress.skipped += 1
        return False
    progress.bytes += item.size
    return True


async def _publish(
    producer: Any, topic: str, chunk: list[tuple[bytes, bytes]], headers: list[tuple[str, bytes]]
) -> None:
    """Send ``chunk`` and wait for every acknowledgement.

    Raises:
        BrokerError: a message was not acknowledged.
    """
    try:
        sent = [await producer.send(topic, value, key=key, headers=headers) for value, key in chunk]
        for acknowledged in sent:
            await acknowledged
    except KafkaError as exc:
        raise translate_kafka_error(exc, f"publishing to {topic}") from exc


def summary(progress: Progress, spec: Spec, *, dry_run: bool) -> Iterator[str]:
    """The lines a run ends with."""
    if progress.finished_before:
        yield (
            f"backfill {spec.url}: finished before ({progress.published} published to "
            f"{spec.topic}); nothing to do (--restart publishes everything again)"
        )
        return
    verb = "would publish" if dry_run else "published"
    rate = progress.published / progress.seconds if progress.seconds > 0 else 0.0
    count = progress.listed - progress.skipped if dry_run else progress.published
    yield f"backfill {spec.url}: {verb} {count} notifications to {spec.topic}"
    yield (
        f"listed {progress.listed}, skipped {progress.skipped} (modified outside the times), "
        f"{progress.bytes / 1e9:.3f} GB selected, {progress.seconds:.1f} s"
        + (f", {rate:.0f}/s" if not dry_run else "")
    )
    if progress.resumed_from is not None:
        yield "resumed after the checkpoint's last key"


def _iso(when: datetime | None) -> str | None:
    if when is None:
        return None
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
