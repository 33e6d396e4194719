"""Scaled ``ours``: N real worker processes in one consumer group, measured from outside.

For each N of ``bench --processes LIST`` and each mode the bench starts
``dicom-ingest worker --processes N [--gpus LIST]`` (the supervisor,
``ingest/ops/supervisor.py``, which starts N children) as a subprocess, with the
settings of the in-process runs, on a fresh source topic of ``4 x N``
partitions with fresh results and dead-letter topics. Labels: ``ours-hook-pN``
(``SINK=none``, the no-op hook) and ``ours-pN`` (S3 sink on).

The workers run unmodified, so everything is measured from outside them:

- publish: the AWS-format notifications of ``ours.notification``, round
  robin over the partitions; the time is taken just before each is handed to
  the producer (``perf_counter``);
- arrival: an aiokafka consumer of the run's results and dead-letter topics,
  started and positioned before the first publish, polling with
  ``fetch_max_wait_ms=10`` (Tansu answers a fetch only at that deadline, so an
  arrival is seen up to 10 ms late);
- latency of an object = arrival of its result record - its publish time
  (one clock, this process); for the paced pass also to the result record's
  own timestamp (the worker's producer stamps it: the bench's fetch left out),
  and by publish time in 0.5 s windows (``over_time``); throughput = objects
  and bytes / (last arrival - first publish);
- CPU: utime + stime (and reaped children's) of the supervisor's whole process
  tree from ``/proc/PID/stat``, before and after each pass; the bench's own
  publisher and consumer are apart (``bench_cpu_s``), the servers too;
- peak RSS: ``VmHWM`` of each child, reset through ``/proc/PID/clear_refs``
  before each pass; ``peak_rss_bytes`` is the largest child's and
  ``child_peak_rss_each`` lists them all.

Passes as ``ours``: once the group is formed (Stable with N members,
from the broker's DescribeGroups), one full pass discarded, ``repeats`` burst
passes, and for paced workloads one pass at ``--paced-rate`` (by default half
the median burst rate). Then SIGTERM: the supervisor must exit 0 (every child
drained), recorded as ``supervisor_exit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from anyio.abc import Process

from ingest.bench.measure import TreeMeter, percentile, summarize
from ingest.bench.ours import latency_summary, notification, pass_limit_s
from ingest.bench.scaled_pass import GapWatch, ScaledPass
from ingest.bench.workloads import BenchObject
from ingest.embedded.stack import create_topics
from ingest.settings import PREFIX, Settings, load_settings

PARTITIONS_PER_PROCESS = 4
GROUP_TIMEOUT_S = 120.0
SETTINGS_SHOWN = (
    "part_size",
    "ring_slots",
    "fetch_concurrency",
    "max_objects_in_flight",
    "output_dtype",
    "device",
    "sink",
    "hook",
    "source_topic",
    "group_id",
)
# Beyond the workers' drain deadline: the supervisor's own bound is 30 s.
STOP_GRACE_S = 60.0


def scaled_label(mode: str, processes: int) -> str:
    """``ours-hook`` with 8 processes -> ``ours-hook-p8``."""
    return f"{mode}-p{processes}"


@dataclass(frozen=True, slots=True)
class ScaledSpec:
    """One scaled run: N processes, one mode's worker environment, where the objects are."""

    processes: int
    gpus: str
    env: Mapping[str, str]  # the DICOM_INGEST_* of the workers (load_settings must accept it)
    bucket: str
    log_path: Path
    server_pids: tuple[int, ...] = ()


class ScaledRunner:
    """Runs ``dicom-ingest worker --processes N`` on a topic of its own and measures passes."""

    def __init__(self, spec: ScaledSpec) -> None:
        self.spec = spec
        source = spec.env[f"{PREFIX}SOURCE_TOPIC"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        self.env |= dict(spec.env)
        self.env[f"{PREFIX}RESULTS_TOPIC"] = f"{source}-results"
        self.env[f"{PREFIX}DLQ_TOPIC"] = f"{source}-dlq"
        self.settings: Settings = load_settings(self.env)
        self.partitions = PARTITIONS_PER_PROCESS * spec.processes
        self._current = ScaledPass(0)
        self._next_partition = 0
        self._process: Process | None = None
        self._producer: Any = None
        self._gaps = GapWatch()

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "ingest.cli", "worker", "--processes"]
        argv += [str(self.spec.processes), "--parent-pid", str(os.getpid())]  # dies with us
        return argv + (["--gpus", self.spec.gpus] if self.spec.gpus else [])

    def log_tail(self, size: int = 3000) -> str:
        with contextlib.suppress(OSError), self.spec.log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
        return ""

    async def measure(
        self,
        objects: Sequence[BenchObject],
        warmup: Sequence[BenchObject],
        repeats: int,
        paced: float | None,
    ) -> dict[str, Any]:
        """Start the workers, wait for the group, warm up, run the passes, stop; all figures.

        Raises:
            RuntimeError: the workers died, failed an object, or did not form the group.
        """
        s = self.settings
        # The results and dead-letter topics get as many partitions as the source: with
        # several producers on one partition Tansu's live fetch skips acknowledged records
        # (GapWatch); spread out, fewer workers write one partition at once.
        await anyio.to_thread.run_sync(
            create_topics,
            s.kafka_bootstrap,
            [s.source_topic, s.results_topic, s.dlq_topic],
            self.partitions,
        )
        consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
        )
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, acks="all", linger_ms=1)
        await consumer.start()
        try:
            await self._assign(consumer)
            await producer.start()
            self._producer = producer
            try:
                return await self._with_workers(consumer, objects, warmup, repeats, paced)
            finally:
                await producer.stop()
        finally:
            await consumer.stop()

    async def _assign(self, consumer: AIOKafkaConsumer) -> None:
        await consumer.topics()  # metadata for partitions_for_topic
        parts = [
            TopicPartition(topic, p)
            for topic in (self.settings.results_topic, self.settings.dlq_topic)
            for p in sorted(consumer.partitions_for_topic(topic) or {0})
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)  # fresh topics: nothing before this run
        self._gaps.expected = dict.fromkeys(parts, 0)

    async def _with_workers(
        self,
        consumer: AIOKafkaConsumer,
        objects: Sequence[BenchObject],
        warmup: Sequence[BenchObject],
        repeats: int,
        paced: float | None,
    ) -> dict[str, Any]:
        with self.spec.log_path.open("ab") as log:
            process = await anyio.open_process(
                self.argv(), env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self._process = process
        async with process:  # cancelled or failed: aclose() kills the supervisor
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._consume, consumer)
                    formed_s = await self._wait_for_group()
                    result = await self._passes(objects, warmup, repeats, paced)
                    group.cancel_scope.cancel()
            finally:
                code = await self._stop(process)
        result["group_formed_s"] = formed_s
        result["supervisor_exit"] = code
        return result

    async def _stop(self, process: Process) -> int:
        """SIGTERM; the exit status (SIGKILLed after the drain deadline and a grace: -9)."""
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(self.settings.shutdown_deadline_s + STOP_GRACE_S, shield=True):
            return await process.wait()
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with anyio.CancelScope(shield=True):
            code: int = await process.wait()
        return code

    def _check_alive(self) -> None:
        assert self._process is not None
        if self._process.returncode is not None:
            raise RuntimeError(
                f"{self.argv()} exited with {self._process.returncode}:\n{self.log_tail()}"
            )

    async def _wait_for_group(self) -> float:
        """Seconds until the group is Stable with one member per child.

        Raises:
            RuntimeError: it was not within ``GROUP_TIMEOUT_S``, or the workers died.
        """
        started = time.perf_counter()
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        await admin.start()
        try:
            state, members = "", 0
            while time.perf_counter() - started < GROUP_TIMEOUT_S:
                self._check_alive()
                (response,) = await admin.describe_consumer_groups([self.settings.group_id])
                # each group: (error, group, state, protocol_type, protocol, members)
                for described in response.groups:
                    # Tansu 0.6 lists members but leaves their metadata and assignment
                    # empty; Stable with N members is what both it and Kafka report after
                    # the assignment was synced.
                    state, members = described[2], len(described[5])
                    if state == "Stable" and members == self.spec.processes:
                        return time.perf_counter() - started
                await anyio.sleep(0.2)
        finally:
            await admin.close()
        raise RuntimeError(
            f"group {self.settings.group_id}: {state!r} with {members} members, not "
            f"{self.spec.processes}, after {GROUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}"
        )

    async def _consume(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for tp, records in batch.items():
                for record in records:
                    back = self._gaps.check(tp, record.offset)
                    if back is not None:  # arrivals are then seen late, never early
                        consumer.seek(tp, back)
                        break
                    self._arrived(tp.topic, record.key, record.value, now, record.timestamp)

    def _arrived(
        self, topic: str, key: bytes | None, value: bytes, now: float, stamp_ms: int
    ) -> None:
        p = self._current
        document = json.loads(value)
        if topic == self.settings.dlq_topic:
            p.errors.append(
                f"{document.get('key')}: {document.get('error_type')}: {document.get('error')}"
            )
            p.finished.set()
            return
        name = key.decode() if key else str(document.get("source", {}).get("key"))
        if name in p.sent and name not in p.done:
            p.done[name] = now
            p.produced[name] = stamp_ms / 1000.0
            timings = document.get("timings") or {}
            p.timings[name] = {k: float(v) for k, v in timings.items()}
            p.backends[str(document.get("backend"))] += 1
            if len(p.done) >= p.expected:
                p.finished.set()

    async def _pass(
        self, objects: Sequence[BenchObject], interval_s: float, limit_s: float
    ) -> tuple[ScaledPass, float]:
        p = self._current = ScaledPass(len(objects))
        topic, bucket = self.settings.source_topic, self.spec.bucket
        deliveries = []
        start = time.perf_counter()
        for index, obj in enumerate(objects):
            if interval_s:
                await anyio.sleep(max(0.0, start + index * interval_s - time.perf_counter()))
            partition = self._next_partition
            self._next_partition = (partition + 1) % self.partitions
            p.sent[obj.key] = time.perf_counter()
            p.sent_epoch[obj.key] = time.time()
            p.partition_of[obj.key] = partition
            message = notification(bucket, obj)
            deliveries.append(await self._producer.send(topic, message, partition=partition))
        for delivery in deliveries:
            await delivery
        with anyio.move_on_after(limit_s):
            while not p.finished.is_set():
                with anyio.move_on_after(1.0):
                    await p.finished.wait()
                self._check_alive()
        if not p.finished.is_set():
            raise RuntimeError(await self._unfinished(p, limit_s))
        if p.errors:
            raise RuntimeError(f"{len(p.errors)} objects dead-lettered, e.g. {p.errors[0]}")
        return p, max(p.done.values()) - min(p.sent.values())

    async def _unfinished(self, p: ScaledPass, limit_s: float) -> str:
        """What a pass that ran out of time was missing: which source partitions, and
        whether the missing results are in the results topic after all (read again from
        the beginning), i.e. written and acknowledged but skipped by the live fetch."""
        missing = {k for k in p.sent if k not in p.done}
        partitions = Counter(p.partition_of[k] for k in missing)
        last = f"{max(p.done.values()) - min(p.sent.values()):.1f} s" if p.done else "never"
        found = await self._reread(missing)
        return (
            f"{len(p.done)} of {p.expected} results arrived within {limit_s:.0f} s (the last "
            f"one after {last}); {len(missing)} missing, by source partition "
            f"{dict(sorted(partitions.items()))}; {found} of those {len(missing)} are in the "
            f"results topic when it is read again from the beginning:\n{self.log_tail()}"
        )

    async def _reread(self, keys: set[str], timeout_s: float = 20.0) -> int:
        """How many of ``keys`` have a result record, reading the topic from its start."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=10,
        )
        await consumer.start()
        seen: set[str] = set()
        try:
            await consumer.topics()
            topic = self.settings.results_topic
            parts = [TopicPartition(topic, n) for n in consumer.partitions_for_topic(topic) or {0}]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            with anyio.move_on_after(timeout_s):
                while not keys <= seen:
                    for records in (await consumer.getmany(timeout_ms=200)).values():
                        seen.update(r.key.decode() for r in records if r.key)
        finally:
            await consumer.stop()
        return len(keys & seen)

    async def _passes(
        self,
        objects: Sequence[BenchObject],
        warmup: Sequence[BenchObject],
        repeats: int,
        paced: float | None,
    ) -> dict[str, Any]:
        assert self._process is not None
        total = sum(o.size for o in objects)
        limit_s = pass_limit_s(total)
        await self._pass(warmup, 0.0, limit_s)
        runs: list[dict[str, Any]] = []
        burst_ms: list[float] = []
        breakdown: dict[str, float] = {}
        for _ in range(repeats):
            meter = TreeMeter(self._process.pid, self.spec.server_pids)
            meter.start()
            p, seconds = await self._pass(objects, 0.0, limit_s)
            run = meter.run(total, len(objects), seconds)
            run.extra["backends"] = dict(p.backends)
            ms = p.latencies_ms()
            burst_ms += ms
            breakdown = p.breakdown_ms()  # of the last pass
            run.extra |= {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
            runs.append(run.as_dict())
        s = self.settings
        result: dict[str, Any] = {
            "status": "ok",
            "runs": runs,
            **summarize(runs),
            "warmup": f"{len(warmup)} objects processed first and discarded",
            "latency_burst": latency_summary(burst_ms, breakdown),
            "processes": self.spec.processes,
            "gpus": self.spec.gpus or None,
            "partitions": self.partitions,
            "workers": [f"{s.worker_id}-{i}" for i in range(self.spec.processes)],
            "ring_bytes_per_process": s.ring_slots * s.part_size,
            "settings": {name: getattr(s, name) for name in SETTINGS_SHOWN},
        }
        if paced is not None and runs:
            rate = paced or float(result["median"]["objects_per_s"]) / 2.0
            p, _ = await self._pass(objects, 1.0 / rate, limit_s)
            summary = latency_summary(p.latencies_ms(), p.breakdown_ms())
            stamped = p.to_record_ms()
            result["latency_paced"] = {
                "rate_objects_per_s": rate,
                **summary,
                "to_result_record": {
                    "p50_ms": percentile(stamped, 50),
                    "p99_ms": percentile(stamped, 99),
                    "max_ms": max(stamped, default=0.0),
                },
                "over_time": p.over_time(),
            }
        # all passes: seeks back over result offsets the broker's live fetch skipped
        result["result_gaps"] = {"refetched": self._gaps.refetched, "given_up": self._gaps.given_up}
        return result
