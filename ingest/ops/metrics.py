"""``/metrics``: the instruments of ``ingest/metrics.py`` plus the live state of a running worker.

The ring, the device thread, the offset tracker and the consumer already
keep their own counts; rather than mirror each change into a gauge, a
collector reads them when Prometheus scrapes (on the event loop, which owns
them, so it sees a consistent state at no cost between scrapes). ``watching``
registers a worker's objects for as long as it runs. The NVIDIA GPU's own
utilisation and memory come from NVML where it is present (``ingest/ops/nvml.py``).

Per partition, ``dicom_ingest_consumer_lag`` is the partition's high watermark
minus the group's position as this worker knows it (its last acknowledged
commit, else the first offset it consumed): the lag KEDA and Kafka's tools
report, from the worker's side. ``dicom_ingest_commit_age_seconds`` is how long
the partition has owed a commit (work consumed and not yet committed) since its
last acknowledged one; 0 while nothing is owed, so an idle partition does not
look stuck and a stuck object at a partition's front does.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ingest.errors import IngestError
from ingest.fetch.ring import PinnedRing
from ingest.logs import package_version
from ingest.metrics import finished as finished  # the worker's one call per outcome
from ingest.ops.nvml import NvmlCollector
from ingest.source.commits import Commits

# The text format every Prometheus (2.x and 3.x) and agent reads; generate_latest writes it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STOPPED_DEVICE_COUNTS = ("batches", "jobs", "failed_jobs", "device_")  # in "worker stopped"


class _Stats(Protocol):
    """What is read of ``WorkerStats`` (``ingest/worker.py``)."""

    records: int
    skipped_events: int
    duplicates: int


class _DeviceThread(Protocol):
    def stats(self) -> dict[str, int | float]: ...
    def busy_s(self) -> float: ...


class _Health(Protocol):
    def problems(self, now: float | None = None) -> list[str]: ...


class _Settings(Protocol):
    @property
    def worker_id(self) -> str: ...


class _Worker(Protocol):
    """What is read of a running ``Worker`` (``ingest/worker.py``)."""

    @property
    def settings(self) -> _Settings: ...
    @property
    def stats(self) -> _Stats: ...
    @property
    def _commits(self) -> Commits: ...
    @property
    def _consumer(self) -> Any: ...
    @property
    def health(self) -> _Health: ...


@dataclass(frozen=True, slots=True)
class _Watched:
    worker: str
    stats: _Stats
    commits: Commits
    consumer: Any
    ring: PinnedRing
    thread: _DeviceThread
    health: _Health


class WorkerCollector(Collector):
    """The live state of every worker running in this process (one, outside tests)."""

    def __init__(self) -> None:
        self.watched: list[_Watched] = []

    def describe(self) -> Iterable[Metric]:
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        families = _Families()
        families.collect(list(self.watched))
        return families.all()


# Every count the device thread keeps (``DeviceThread.stats``), each its own counter family:
# stat name -> (family name without the prefix, what it counts). A name not listed here
# (a new counter of ``gpu/``) is exported as ``device_<name>_total``.
DEVICE_FAMILIES: dict[str, tuple[str, str]] = {
    "batches": ("device_batches", "Batches the device thread ran"),
    "jobs": ("device_jobs", "Chunk jobs the device thread ran"),
    "failed_jobs": ("device_failed_jobs", "Chunk jobs that failed on the device thread"),
    "bytes_in": ("device_input_bytes", "Source bytes handed to the CPU runner"),
    "bytes_h2d": ("device_h2d_bytes", "Bytes copied host to device"),
    "bytes_d2h": ("device_d2h_bytes", "Bytes copied device to host"),
    "kernel_launches": ("device_kernel_launches", "Preprocessing kernel launches"),
    "device_allocations": ("device_allocations", "Device memory allocations (arena growth)"),
    "device_bytes": ("device_allocated_bytes", "Device memory bytes allocated (arena growth)"),
    "device_result_arrays": ("device_result_arrays", "Result arrays handed to a hook"),
    "pinned_staging_allocations": ("device_pinned_staging_allocations", "Pinned staging buffers"),
    "pageable_h2d_jobs": ("device_pageable_h2d_jobs", "Jobs copied from pageable memory"),
    "device_decode_calls": ("device_decode_calls", "nvImageCodec batched decode calls"),
    "device_decoded_frames": ("device_decoded_frames", "Frames decoded on the device"),
    "device_decode_failures": ("device_decode_failures", "Frames the device failed to decode"),
    "device_decode_fallbacks": (
        "device_decode_fallbacks",
        "Frames the hardware and CUDA decoders refused, given to the hybrid and CPU ones",
    ),
    "host_allocations": ("host_allocations", "Host buffers allocated on the device thread"),
    "pinned_allocations": ("host_pinned_allocations", "Page-locked host allocations"),
    "pinned_bytes": ("host_pinned_bytes", "Page-locked host bytes allocated"),
    "pageable_allocations": ("host_pageable_allocations", "Pageable host allocations"),
    "pageable_bytes": ("host_pageable_bytes", "Pageable host bytes allocated"),
}


class _Families:
    """One scrape's families. No family has a ``worker`` label: each worker process is its
    own scrape target (Prometheus' ``instance``, the pod), and its id is on
    ``dicom_ingest_build_info`` for joins. Several workers in one process (tests) add up."""

    def __init__(self) -> None:
        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"dicom_ingest_{name}", doc, labels=list(labels))

        def counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"dicom_ingest_{name}", doc, labels=list(labels))

        self.build_info = gauge(
            "build_info", "1, labelled with the version, Python and worker id", *BUILD_LABELS
        )
        self.ring_slots = gauge("ring_slots", "Slots in the ring of (pinned) host buffers")
        self.ring_slot_bytes = gauge("ring_slot_bytes", "Bytes of one ring slot (PART_SIZE)")
        self.ring_in_use = gauge("ring_slots_in_use", "Ring slots in use (a cut slot counts one)")
        self.ring_small = gauge("ring_small_slots_in_use", "1 MiB small slots in use")
        self.ring_pinned = gauge("ring_pinned", "1 when the ring is page-locked (CUDA)")
        self.ring_waits = counter("ring_waits", "Acquisitions that waited for a free slot")
        self.ring_acquired = counter("ring_acquired", "Slots and small slots handed out")
        self.records = counter("records", "Kafka records taken from the source topic")
        self.skipped = counter("skipped_events", "Notification records that were not creations")
        self.duplicates = counter("duplicates", "Repeated notifications of a known object")
        self.commits = counter("commits", "Offset commits the broker acknowledged")
        self.ready = gauge(
            "ready", "1 while /readyz answers 200: in the group, polling, broker and S3 answering"
        )
        self.device_busy = gauge(
            "device_busy_seconds",
            "How long the device thread's current work item has run (0: waiting for work)",
        )
        self.device: dict[str, CounterMetricFamily] = {
            stat: counter(name, doc) for stat, (name, doc) in DEVICE_FAMILIES.items()
        }
        self.lag = gauge(
            "consumer_lag", "High watermark minus the group's position", "topic", "partition"
        )
        self.commit_age = gauge(
            "commit_age_seconds", "Seconds a commit has been owed", "topic", "partition"
        )
        self.in_flight = gauge(
            "records_in_flight", "Records consumed, not yet finished", "topic", "partition"
        )

    def collect(self, watched: list[_Watched]) -> None:
        """Fill every family from the running workers; with none, build_info alone."""
        if not watched:
            self.build_info.add_metric(build_labels(""), 1)
            return
        # by name: families are not hashable
        totals: dict[str, tuple[GaugeMetricFamily | CounterMetricFamily, float]] = {}
        device: dict[str, float] = dict.fromkeys(DEVICE_FAMILIES, 0)
        busy, ready = 0.0, 1
        for w in watched:
            ready = min(ready, 0 if w.health.problems() else 1)
            self.build_info.add_metric(build_labels(w.worker), 1)
            ring = w.ring.stats()
            for family, value in (
                (self.ring_slots, ring.slots),
                (self.ring_slot_bytes, ring.slot_size),
                (self.ring_in_use, ring.in_use),
                (self.ring_small, ring.small_in_use),
                (self.ring_pinned, int(ring.pinned)),
                (self.ring_waits, ring.waits),
                (self.ring_acquired, ring.acquired),
                (self.records, w.stats.records),
                (self.skipped, w.stats.skipped_events),
                (self.duplicates, w.stats.duplicates),
                (self.commits, w.commits.count),
            ):
                totals[family.name] = (family, totals.get(family.name, (family, 0.0))[1] + value)
            for name, count in w.thread.stats().items():
                device[name] = device.get(name, 0) + count
            busy = max(busy, w.thread.busy_s())
        for summed, total in totals.values():
            summed.add_metric([], total)
        self.device_busy.add_metric([], busy)
        self.ready.add_metric([], ready)
        for name, count in device.items():
            if name not in self.device:  # a counter gpu/ added since: exported as it is
                self.device[name] = CounterMetricFamily(
                    f"dicom_ingest_device_{name}", f"Device thread counter {name}"
                )
            self.device[name].add_metric([], count)
        for w in watched:
            self._partitions(w)

    def _partitions(self, w: _Watched) -> None:
        now = time.monotonic()
        tracker = w.commits.tracker
        for tp in sorted(w.consumer.assignment()):
            partition = (tp.topic, tp.partition)
            labels = [tp.topic, str(tp.partition)]
            unfinished = tracker.in_flight(partition)
            self.in_flight.add_metric(labels, unfinished)
            since = w.commits.committed_at.get(partition)
            owed = tracker.owes(partition) and since is not None
            self.commit_age.add_metric(labels, now - since if owed and since else 0.0)
            try:
                highwater = w.consumer.highwater(tp)
            except Exception:  # taken away between assignment() and now
                continue
            position = tracker.position(partition)
            if highwater is not None and position is not None:
                self.lag.add_metric(labels, max(0, highwater - position))

    def all(self) -> list[Metric]:
        found: list[Metric] = []
        for value in vars(self).values():
            if isinstance(value, Metric):
                found.append(value)
            elif isinstance(value, dict):
                found.extend(value.values())
        return found


BUILD_LABELS = ("version", "python", "worker")


def build_labels(worker: str) -> list[str]:
    return [package_version(), platform.python_version(), worker]


def _reasons(kind: type[IngestError] = IngestError) -> Iterator[type[IngestError]]:
    yield kind
    for sub in kind.__subclasses__():
        yield from _reasons(sub)


def precreate_series() -> None:
    """Give every labelled counter its series from the start, at 0: ``rate()`` and
    ``increase()`` need a first point, and an alert on dead letters must see the first
    one. Reasons are the error tree's; syntaxes those the worker reads; dead-lettered
    objects are counted under ``unknown`` (their syntax may never have been read)."""
    from ingest import metrics
    from ingest.dicom.syntaxes import READABLE

    kinds = [kind for kind in _reasons() if kind.__module__ == IngestError.__module__]
    for kind in kinds:
        metrics.DEAD_LETTERS.labels(kind.reason)
        if kind.retriable:
            metrics.RETRIES.labels(kind.reason)
    for uid in READABLE:
        metrics.OBJECTS.labels("processed", metrics.syntax_label(uid))
        metrics.SOURCE_BYTES.labels("processed", metrics.syntax_label(uid))
    metrics.OBJECTS.labels("dead_lettered", "unknown")
    metrics.SOURCE_BYTES.labels("dead_lettered", "unknown")


WORKERS = WorkerCollector()
REGISTRY.register(WORKERS)
REGISTRY.register(NvmlCollector())


@contextmanager
def watching(worker: _Worker, ring: PinnedRing, thread: _DeviceThread) -> Iterator[None]:
    """Expose one running worker's ring, device thread, offsets and lag while in the block
    (its consumer and commits exist by then)."""
    precreate_series()
    watched = _Watched(
        worker.settings.worker_id,
        worker.stats,
        worker._commits,
        worker._consumer,
        ring,
        thread,
        worker.health,
    )
    WORKERS.watched.append(watched)
    try:
        yield
    finally:
        WORKERS.watched.remove(watched)


def stopped_summary(stats: Any, thread: _DeviceThread) -> dict[str, Any]:
    """The counts of the "worker stopped" log line: the worker's and the device's."""
    device = {k: v for k, v in thread.stats().items() if k.startswith(STOPPED_DEVICE_COUNTS)}
    return {**dataclasses.asdict(stats), "device": device}


async def metrics_endpoint(_: web.Request) -> web.Response:
    """``GET /metrics`` in Prometheus' text format."""
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE})


def exported_names() -> set[str]:
    """Every sample name ``/metrics`` of a worker can carry (dashboards are checked against it)."""
    from ingest import metrics
    from ingest.ops.nvml import families as nvml_families

    instruments = [metrics.OBJECTS, metrics.SOURCE_BYTES, metrics.STAGE_SECONDS, metrics.RETRIES]
    instruments += [metrics.DEAD_LETTERS, metrics.RANGES_IN_FLIGHT, metrics.PUTS_IN_FLIGHT]
    found: list[Metric] = [f for i in instruments for f in i.describe()]
    found += _Families().all() + list(nvml_families())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + s for f in found for s in suffixes.get(f.type, ("",))}
