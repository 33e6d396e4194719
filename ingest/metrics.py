"""The worker's Prometheus instruments, and the one-line helpers the stages call.

Every number here is counted where the work already measures or counts it:
the stages call ``timed``/``timed_async`` (decorators on the GET, PUT,
decode and device-batch functions), the retry policy calls ``count_retry``
before each backoff, and the worker calls ``finished`` once per object or bad
record with what it already knows (the ``Processed`` timings, the error, the
Kafka record's timestamp). State that lives in objects of one worker (the ring,
the device thread, offsets) is read at scrape time by ``ingest/ops/metrics.py``,
which also serves ``/metrics``.

This module is a leaf (it imports nothing of the pipeline), so every stage may
import it without breaking the one-way layering. The instruments live in
prometheus-client's default registry, next to its process collector
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``); a process
runs one worker, and a test that runs several in one process reads differences.

Label values are bounded: outcomes, stages, ``IngestError.reason`` codes and
transfer syntax keywords from pydicom's dictionary (``other`` for a UID it does
not know), never keys, buckets or UIDs of instances.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from ingest.errors import IngestError
    from ingest.sink.records import Processed
    from ingest.source.notifications import ObjectRef

P = ParamSpec("P")
R = TypeVar("R")

# 1 ms (a CT slice's parse) to 10 min (a whole-slide image end to end)
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
STAGES = {
    "first_get": "per object: the first GET (size, ETag and the header or the whole object)",
    "parse": "per object: header parse (and hash, when the first GET held it all)",
    "pixels": "per object: Pixel Data reads, decode, device work and output writes",
    "object": "per object: first GET to outputs written (the sidecar's timings.total_s)",
    "end_to_end": "per object: Kafka record timestamp to result and audit acknowledged",
    "fetch": "per S3 GET or file read (one range or a first read), in its thread",
    "decode": "per group of frames decoded on the CPU (process pool or thread)",
    "device": "per device batch: submitted to the device thread until its results are back",
    "sink": "per S3 PUT (an output part or a sidecar), in its thread",
}

OBJECTS = Counter(
    "dicom_ingest_objects",
    "Objects finished, by outcome (processed, dead_lettered) and transfer syntax",
    ["outcome", "transfer_syntax"],
)
SOURCE_BYTES = Counter(
    "dicom_ingest_source_bytes",
    "Source object bytes of finished objects, by outcome and transfer syntax",
    ["outcome", "transfer_syntax"],
)
STAGE_SECONDS = Histogram(
    "dicom_ingest_stage_seconds",
    "Latency of each stage; " + "; ".join(f"{k}: {v}" for k, v in STAGES.items()),
    ["stage"],
    buckets=LATENCY_BUCKETS,
)
RETRIES = Counter(
    "dicom_ingest_retries", "Retried S3 and Kafka calls (one per backoff), by reason", ["reason"]
)
DEAD_LETTERS = Counter(
    "dicom_ingest_dead_letters",
    "Dead-letter records written, by reason (objects and bad records)",
    ["reason"],
)
RANGES_IN_FLIGHT = Gauge("dicom_ingest_ranges_in_flight", "S3 GETs and file reads under way")
PUTS_IN_FLIGHT = Gauge("dicom_ingest_puts_in_flight", "S3 PUTs (output parts) under way")

# Every stage's series exists from the start: rate() needs two points.
_STAGE_CHILDREN: Final = {stage: STAGE_SECONDS.labels(stage) for stage in STAGES}


def timed(stage: str, in_flight: Gauge | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a blocking function: each call is one observation of ``stage``."""
    histogram = STAGE_SECONDS.labels(stage)

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if in_flight is not None:
                in_flight.inc()
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                histogram.observe(time.perf_counter() - started)
                if in_flight is not None:
                    in_flight.dec()

        return wrapper

    return decorate


def timed_async(
    stage: str,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorate a coroutine function: each completed call is one observation of ``stage``
    (a cancelled call is not: its time says nothing about the stage)."""
    histogram = STAGE_SECONDS.labels(stage)

    def decorate(
        function: Callable[P, Coroutine[Any, Any, R]],
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(function)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            result = await function(*args, **kwargs)
            histogram.observe(time.perf_counter() - started)
            return result

        return wrapper

    return decorate


def count_retry(retry_state: Any) -> None:
    """tenacity's ``before_sleep``: one retry of a failed call, by its error's reason."""
    outcome = retry_state.outcome
    error = outcome.exception() if outcome is not None else None
    RETRIES.labels(getattr(error, "reason", "error")).inc()


@functools.lru_cache(maxsize=256)  # a worker sees few transfer syntaxes
def syntax_label(uid: str | None) -> str:
    """A transfer syntax as a bounded label: pydicom's keyword for it, else ``other``."""
    from pydicom.uid import UID  # the worker has it loaded; the GET threads' users need not

    return (UID(uid).keyword or "other") if uid else "unknown"


@functools.lru_cache(maxsize=256)
def _processed(uid: str | None) -> tuple[Counter, Counter]:
    """The processed-object counters' children of one transfer syntax."""
    syntax = syntax_label(uid)
    return OBJECTS.labels("processed", syntax), SOURCE_BYTES.labels("processed", syntax)


def finished(
    ref: ObjectRef | None,
    processed: Processed | None,
    error: IngestError | None,
    record_timestamp_ms: int | None,
) -> None:
    """One object (or bad record) finished durably: count it and observe its stages."""
    if processed is not None:
        objects, source_bytes = _processed(processed.header.transfer_syntax_uid)
        objects.inc()
        source_bytes.inc(processed.head.size)
        t = processed.timings
        stages = _STAGE_CHILDREN
        stages["first_get"].observe(t.first_get_s)
        stages["parse"].observe(t.parse_s)
        stages["pixels"].observe(t.device_s)
        stages["object"].observe(t.total_s)
        if record_timestamp_ms is not None and record_timestamp_ms > 0:
            waited = time.time() - record_timestamp_ms / 1000.0
            stages["end_to_end"].observe(max(0.0, waited))
    if error is not None:
        DEAD_LETTERS.labels(error.reason).inc()
        if ref is not None:
            OBJECTS.labels("dead_lettered", "unknown").inc()
            SOURCE_BYTES.labels("dead_lettered", "unknown").inc(ref.size or 0)
