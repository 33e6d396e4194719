"""Chaos runs: the real ``dicom-ingest worker`` process, SIGKILLed at random points and
restarted until every object is accounted for, then a consistency check of everything
the run left behind (docs/reliability.md: at-least-once with idempotent outputs).

Building blocks:

- ``make_corpus``/``make_messages``: supported objects (small CT slices on the
  one-GET path, multi-frame objects of a few hundred KB on the multi-range path)
  and bad ones (not DICOM, truncated DICOM, missing keys, malformed
  notifications), announced in shuffled notifications of one to four records.
- ``worker_environment`` and ``WorkerProcess``: the worker as a subprocess
  (``python -m ingest.cli worker``), its JSON log in a file, followed as it grows.
- ``run_chaos``: publish in batches, start a worker, SIGKILL it (during start-up
  or after a random number of processed objects plus jitter), restart, ... then a
  last worker finishes the rest and is stopped with SIGTERM.
- ``check_consistency``: outputs, sidecars, results, dead letters and audit trail
  against the corpus; ``ChaosReport.problems()`` lists every violation.

Duplicates are allowed by at-least-once (an object redone after a kill publishes
its result again), so they are counted, not failed, as long as every copy
describes the same output.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Self

import anyio
import numpy as np
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from ingest.audit.records import verify_chain
from ingest.audit.verify import object_records, verify_trail
from ingest.embedded.samples import not_dicom, synthetic_ct_series, synthetic_multiframe
from ingest.embedded.stack import Stack
from tests import harness
from tests.reference import reference_array

REPO_ROOT = Path(__file__).resolve().parent.parent
OK = "ok"
BAD_NOTIFICATION = "bad_notification"
LIVE: set[WorkerProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    """A crashed test run must not leave workers behind."""
    for process in list(LIVE):
        process.kill()


# ---------------------------------------------------------------------------------------
# Corpus and notifications


@dataclass(frozen=True, slots=True)
class ChaosObject:
    """One announced object: ``data`` None means announced but never uploaded."""

    key: str
    data: bytes | None
    expect: str  # "ok", or the reason code its dead-letter record must carry


@dataclass(frozen=True, slots=True)
class Corpus:
    objects: tuple[ChaosObject, ...]
    bad_notifications: tuple[bytes, ...]

    @property
    def supported(self) -> list[ChaosObject]:
        return [o for o in self.objects if o.expect == OK]

    @property
    def bad_objects(self) -> list[ChaosObject]:
        return [o for o in self.objects if o.expect != OK]


def make_corpus(
    seed: int,
    *,
    ct_slices: int,
    multiframes: int,
    not_dicom_objects: int = 3,
    truncated: int = 3,
    missing: int = 2,
    bad_notifications: int = 2,
) -> Corpus:
    """A deterministic mix of supported and bad objects (keys unique, some with ' ', '+', 'é')."""
    rng = random.Random(seed)
    objects = [
        ChaosObject(f"ct/{'batch +' if i % 7 == 0 else 'batch'} {i // 100}/{key}", data, OK)
        for i, (key, data) in enumerate(
            synthetic_ct_series(ct_slices, rows=64, columns=64, seed=seed)
        )
    ]
    for i in range(multiframes):
        bits = (16, 16, 8, 32)[i % 4]
        frames, rows, columns = 4 + i % 9, 96 + 16 * (i % 3), 112 + 8 * (i % 5)
        data = synthetic_multiframe(
            frames,
            rows,
            columns,
            bits_allocated=bits,
            signed=i % 2 == 1,
            per_frame_rescale=i % 3 != 0,
        )
        objects.append(ChaosObject(f"multiframe/mf-{i:03d} é.dcm", data, OK))
    png_key, png = not_dicom()
    for i in range(not_dicom_objects):
        body = (png, rng.randbytes(300 + 97 * i), b"just text, not an image\n" * (i + 1))[i % 3]
        if i % 4 == 3:
            body = rng.randbytes(200_000)  # long enough for the multi-range path
        objects.append(
            ChaosObject(f"bad/not-dicom-{i:02d}-{Path(png_key).name}", body, "not_dicom")
        )
    spare = synthetic_ct_series(max(truncated, 1), rows=64, columns=64, seed=seed + 1_000_003)
    big = synthetic_multiframe(6, 128, 128, bits_allocated=16, per_frame_rescale=False)
    for i in range(truncated):
        whole = big if i % 2 else spare[i][1]
        cut = int(len(whole) * rng.uniform(0.6, 0.95))
        objects.append(ChaosObject(f"bad/truncated-{i:02d}.dcm", whole[:cut], "malformed_dicom"))
    objects += [ChaosObject(f"bad/missing-{i:02d}.dcm", None, "not_found") for i in range(missing)]
    notes = tuple(
        (b'{"Records": [{"eventName": 42, "n": %d}]}' % i) if i % 2 == 0 else b"not json %d" % i
        for i in range(bad_notifications)
    )
    return Corpus(tuple(objects), notes)


def make_messages(corpus: Corpus, bucket: str, rng: random.Random) -> list[bytes]:
    """Every object announced once, shuffled; a third of messages carry 2-4 records."""
    keys = [o.key for o in corpus.objects]
    rng.shuffle(keys)
    messages: list[bytes] = []
    while keys:
        take = 1 if rng.random() < 0.67 else rng.randint(2, 4)
        messages.append(harness.aws_notification(bucket, keys[:take]))
        del keys[:take]
    for note in corpus.bad_notifications:
        messages.insert(rng.randrange(len(messages) + 1), note)
    return messages


def expected_npy(data: bytes) -> bytes:
    """What the worker must write (float32, no window): NumPy's own ``.npy`` of the reference."""
    out = io.BytesIO()
    np.save(out, reference_array(data, None, "float32"), allow_pickle=False)
    return out.getvalue()


# ---------------------------------------------------------------------------------------
# The worker as a process


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the thread that started it dies.

    So a test runner killed outright (no ``finally``, no ``atexit``) leaves no
    worker behind. Start workers from the event loop's (long-lived) thread.
    """
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_environment(stack: Stack, names: harness.Names, **overrides: str) -> dict[str, str]:
    """A worker process's environment: ours without DICOM_INGEST_*, plus the test worker's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DICOM_INGEST_")}
    env |= harness.worker_environment(stack, names, **overrides)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class WorkerProcess:
    """``python -m ingest.cli worker`` with stdout and stderr in ``log_path``.

    ``poll_log`` follows the JSON log as it grows: how many times each event
    was logged, when (monotonic) it was first seen, and the fields of each
    (but "processed", only counted). Use as a context manager (or call
    ``kill`` in a ``finally``) so no worker outlives its test.
    """

    def __init__(self, env: Mapping[str, str], log_path: Path, args: Sequence[str] = ()) -> None:
        self.env = dict(env)
        self.log_path = log_path
        self.args = tuple(args)  # after ``worker``: e.g. ``--processes 8``
        self.worker_id = self.env.get("DICOM_INGEST_WORKER_ID", "")
        self.started_at = 0.0
        self.spawned_wall = 0.0
        self.counts: Counter[str] = Counter()
        self.first_seen: dict[str, float] = {}
        self.events: list[tuple[float, dict[str, Any]]] = []  # (monotonic time seen, fields)
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._partial = b""

    def start(self) -> Self:
        with self.log_path.open("ab") as out:
            self._log_offset = out.tell()
            self.started_at = time.monotonic()
            self.spawned_wall = time.time()
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "ingest.cli", "worker", *self.args],
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no terminal signals
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        LIVE.add(self)
        return self

    def __enter__(self) -> Self:
        return self.start() if self._popen is None else self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    @property
    def pid(self) -> int:
        assert self._popen is not None, "never started"
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            assert self._popen is not None
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL (a crash: no drain, no commit, no LeaveGroup) and reap; idempotent."""
        if self._popen is not None:
            self.signal(signal.SIGKILL)
            self._popen.wait()
        LIVE.discard(self)

    async def wait(self, within_s: float) -> int | None:
        """The exit status, or None if still running after ``within_s`` seconds."""
        deadline = time.monotonic() + within_s
        while self.alive() and time.monotonic() < deadline:
            self.poll_log()
            await anyio.sleep(0.02)
        self.poll_log()
        code = self.returncode
        if code is not None:
            LIVE.discard(self)
        return code

    def poll_log(self) -> None:
        """Read what the log gained since the last call: count events, keep their fields."""
        now = time.monotonic()
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                chunk = log.read()
        except OSError:
            return
        self._log_offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"{"):
                continue
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            event = fields.get("event") if isinstance(fields, dict) else None
            if isinstance(event, str):
                self.counts[event] += 1
                self.first_seen.setdefault(event, now)
                if event != "processed":  # the one frequent event: counted only
                    self.events.append((now, fields))

    def last(self, event: str) -> dict[str, Any] | None:
        """The fields of the last ``event`` logged (not for "processed")."""
        return next((f for _, f in reversed(self.events) if f["event"] == event), None)

    def assigned_after_s(self) -> float | None:
        """Seconds from spawn to the first non-empty partition assignment, by the log's clock."""
        self.poll_log()
        for _, fields in self.events:
            if fields["event"] == "partitions assigned" and fields.get("partitions"):
                logged = datetime.fromisoformat(fields["timestamp"].replace("Z", "+00:00"))
                return logged.timestamp() - self.spawned_wall
        return None

    async def wait_until(
        self, done: Callable[[Self], bool], within_s: float = 30.0
    ) -> float | None:
        """Seconds from start until ``done(self)`` held (checked as the log grows)."""
        deadline = time.monotonic() + within_s
        while True:
            self.poll_log()
            if done(self):
                return time.monotonic() - self.started_at
            if not self.alive() or time.monotonic() > deadline:
                return None
            await anyio.sleep(0.01)

    async def wait_for(self, event: str, count: int = 1, within_s: float = 30.0) -> float | None:
        """Seconds from start until ``event`` was logged ``count`` times; None on timeout/exit."""
        return await self.wait_until(lambda w: w.counts[event] >= count, within_s)

    async def wait_for_partitions(self, within_s: float = 30.0) -> float | None:
        """Seconds from start until the worker logged a non-empty partition assignment."""

        def assigned(w: WorkerProcess) -> bool:
            return any(
                f["event"] == "partitions assigned" and f.get("partitions") for _, f in w.events
            )

        return await self.wait_until(assigned, within_s)

    def log_tail(self, size: int = 4000) -> str:
        with self.log_path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - size))
            return log.read().decode(errors="replace")


# ---------------------------------------------------------------------------------------
# Kafka views


class GroupProgress:
    """Committed offsets of the group vs what was published, on the source topic.

    The published end of each partition comes from the producer's acknowledgements,
    not from ListOffsets: Tansu 0.6 answers "latest" with the base offset of the
    last record batch + 1, short of the real end when a batch holds several records.
    """

    def __init__(self, stack: Stack, names: harness.Names, partitions: int) -> None:
        self._group = names.group
        self.topic = names.source_topic
        self.partitions = [TopicPartition(names.source_topic, p) for p in range(partitions)]
        self.published: dict[int, int] = dict.fromkeys(range(partitions), 0)
        self._bootstrap = stack.kafka.bootstrap
        self._admin = AIOKafkaAdminClient(bootstrap_servers=stack.kafka.bootstrap)

    async def __aenter__(self) -> GroupProgress:
        await self._admin.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._admin.close()

    async def publish(self, messages: Sequence[bytes], round_robin: bool = False) -> None:
        """Send a batch (no key: spread over partitions by the producer, or ``round_robin``
        over every partition), wait for every acknowledgement.

        A producer per batch: one that lives across a broker restart can be left by
        aiokafka holding a connection it no longer tracks, never closed.
        """
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, acks="all")
        await producer.start()
        try:
            futures = [
                await producer.send(
                    self.topic, m, partition=i % len(self.partitions) if round_robin else None
                )
                for i, m in enumerate(messages)
            ]
            await producer.flush()
            for future in futures:
                meta = await future
                end = max(self.published[meta.partition], meta.offset + 1)
                self.published[meta.partition] = end
        finally:
            await producer.stop()

    async def committed(self) -> dict[int, int]:
        found = await self._admin.list_consumer_group_offsets(
            self._group, partitions=self.partitions
        )
        return {
            tp.partition: max(0, found[tp].offset) if tp in found else 0 for tp in self.partitions
        }

    async def backlog(self) -> int:
        """Records published but not committed yet (over all partitions)."""
        committed = await self.committed()
        return sum(end - committed[p] for p, end in self.published.items())


# ---------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 0
    ct_slices: int = 150
    multiframes: int = 6
    not_dicom_objects: int = 3
    truncated: int = 3
    missing: int = 2
    bad_notifications: int = 2
    partitions: int = 2
    kills: int = 6
    first_batch_share: float = 0.3  # a backlog from the start, so most kills land mid-work
    startup_kill_share: float = 0.2  # kills during start-up (imports, connect, join)
    max_processed_before_kill: int = 40
    kill_jitter_s: float = 0.25
    cycle_timeout_s: float = 30.0
    finish_timeout_s: float = 120.0
    shutdown_deadline_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Kill:
    """One SIGKILL: which process, how it was timed, when, what it had finished."""

    worker: str
    mode: str  # "startup" or "after N" finished objects (+ jitter)
    after_s: float  # since the process was spawned
    finished: int  # objects processed or dead-lettered by this process
    phase: str  # "startup", "working" or "idle"


@dataclass(slots=True)
class ChaosReport:
    """Figures and findings of one run; ``problems()`` is empty when it is consistent."""

    objects: int = 0
    supported: int = 0
    bad_objects: int = 0
    bad_notifications: int = 0
    messages: int = 0
    kills: int = 0
    kills_by_phase: Counter[str] = field(default_factory=Counter)
    kill_log: list[Kill] = field(default_factory=list)
    assignment_s: list[float] = field(default_factory=list)  # spawn -> partitions, per process
    restarts: int = 0
    processes: int = 0
    final_exit_code: int | None = None
    final_exit_s: float | None = None
    outputs_missing: list[str] = field(default_factory=list)
    outputs_wrong: list[str] = field(default_factory=list)
    unexpected_outputs: list[str] = field(default_factory=list)
    sidecars_wrong: list[str] = field(default_factory=list)
    result_events: int = 0
    duplicate_result_events: int = 0
    results_missing: list[str] = field(default_factory=list)
    distinct_duplicate_outputs: list[str] = field(default_factory=list)  # copies that disagree
    unexpected_results: list[str] = field(default_factory=list)
    dlq_records: int = 0
    dlq_by_reason: Counter[str] = field(default_factory=Counter)
    dlq_missing: list[str] = field(default_factory=list)
    dlq_wrong: list[str] = field(default_factory=list)
    audit_records: int = 0
    audit_trails: int = 0
    audit_duplicates: int = 0
    audit_undecryptable: int = 0
    audit_missing: list[str] = field(default_factory=list)
    audit_wrong: list[str] = field(default_factory=list)
    chain_problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def problems(self) -> list[str]:
        found = []
        for name in (
            "outputs_missing",
            "outputs_wrong",
            "unexpected_outputs",
            "sidecars_wrong",
            "results_missing",
            "distinct_duplicate_outputs",
            "unexpected_results",
            "dlq_missing",
            "dlq_wrong",
            "audit_missing",
            "audit_wrong",
            "chain_problems",
        ):
            items = getattr(self, name)
            if items:
                found.append(f"{name}: {len(items)}: {items[:5]}")
        if self.audit_undecryptable:
            found.append(f"audit_undecryptable: {self.audit_undecryptable}")
        if self.final_exit_code != 0:
            found.append(f"final worker exit code {self.final_exit_code} after SIGTERM")
        return found

    def format(self, verbose: bool = False) -> str:
        lines = [
            f"objects {self.objects} ({self.supported} supported, {self.bad_objects} bad)"
            f" + {self.bad_notifications} malformed notifications in {self.messages} messages",
            f"SIGKILLs {self.kills} by phase {dict(self.kills_by_phase)}; restarts {self.restarts};"
            f" worker processes {self.processes}; final SIGTERM exit {self.final_exit_code}"
            f" in {_seconds(self.final_exit_s)}",
            f"outputs missing {len(self.outputs_missing)}, wrong {len(self.outputs_wrong)},"
            f" unexpected {len(self.unexpected_outputs)},"
            f" sidecars wrong {len(self.sidecars_wrong)}",
            f"result events {self.result_events} (duplicates {self.duplicate_result_events},"
            f" distinct duplicate outputs {len(self.distinct_duplicate_outputs)},"
            f" missing {len(self.results_missing)}, unexpected {len(self.unexpected_results)})",
            f"DLQ records {self.dlq_records} by reason {dict(sorted(self.dlq_by_reason.items()))};"
            f" missing {len(self.dlq_missing)}, wrong {len(self.dlq_wrong)}",
            f"audit records {self.audit_records} in {self.audit_trails} trails"
            f" (duplicates {self.audit_duplicates}, undecryptable {self.audit_undecryptable});"
            f" missing {len(self.audit_missing)}, wrong {len(self.audit_wrong)},"
            f" chain problems {len(self.chain_problems)}",
            f"spawn to partitions assigned: {_spread(self.assignment_s)};"
            f" wall time {self.wall_s:.1f} s",
        ]
        if verbose:
            lines += [
                f"  kill {k.worker}: {k.mode}, at {k.after_s:.2f} s,"
                f" {k.finished} finished, {k.phase}"
                for k in self.kill_log
            ]
        problems = self.problems()
        lines.append("CONSISTENT" if not problems else "PROBLEMS:\n  " + "\n  ".join(problems))
        return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    median = ordered[len(ordered) // 2]
    return f"min {ordered[0]:.2f} s, median {median:.2f} s, max {ordered[-1]:.2f} s"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


async def upload_corpus(stack: Stack, bucket: str, corpus: Corpus, concurrency: int = 16) -> None:
    limiter = anyio.CapacityLimiter(concurrency)
    async with harness.s3_client(stack) as s3:

        async def put(key: str, body: bytes) -> None:
            async with limiter:
                await s3.put_object(Bucket=bucket, Key=key, Body=body)

        async with anyio.create_task_group() as group:
            for obj in corpus.objects:
                if obj.data is not None:
                    group.start_soon(put, obj.key, obj.data)


def _split(
    messages: list[bytes], parts: int, first_share: float, rng: random.Random
) -> list[list[bytes]]:
    """``parts`` consecutive batches: the first ``first_share`` of all, the rest at random."""
    first = max(1, int(len(messages) * first_share))
    room = range(first + 1, len(messages))
    cuts = sorted(rng.sample(room, min(parts - 2, len(room)))) if parts > 1 else []
    bounds = [0, first, *cuts, len(messages)] if parts > 1 else [0, len(messages)]
    batches = [messages[a:b] for a, b in itertools.pairwise(bounds)]
    return batches + [[] for _ in range(parts - len(batches))]


class CorpusConfig(Protocol):
    """What a chaos run's corpus is made of (``ChaosConfig``, ``GroupChaosConfig``)."""

    @property
    def seed(self) -> int: ...
    @property
    def ct_slices(self) -> int: ...
    @property
    def multiframes(self) -> int: ...
    @property
    def not_dicom_objects(self) -> int: ...
    @property
    def truncated(self) -> int: ...
    @property
    def missing(self) -> int: ...
    @property
    def bad_notifications(self) -> int: ...
    @property
    def partitions(self) -> int: ...


async def corpus_staged(
    stack: Stack, config: CorpusConfig, run: str
) -> tuple[harness.Names, Corpus, list[bytes], random.Random]:
    """Fresh buckets and topics for a run named ``run``, ``config``'s corpus uploaded, and
    its notifications in the order of ``config.seed``'s generator (returned to go on)."""
    rng = random.Random(config.seed)
    names = harness.make_names(f"{run}{uuid.uuid4().hex[:8]}")
    harness.prepare(stack, names, partitions=config.partitions)
    corpus = await anyio.to_thread.run_sync(
        lambda: make_corpus(
            config.seed,
            ct_slices=config.ct_slices,
            multiframes=config.multiframes,
            not_dicom_objects=config.not_dicom_objects,
            truncated=config.truncated,
            missing=config.missing,
            bad_notifications=config.bad_notifications,
        )
    )
    await upload_corpus(stack, names.source_bucket, corpus)
    return names, corpus, make_messages(corpus, names.source_bucket, rng), rng


async def run_chaos(stack: Stack, config: ChaosConfig, workdir: Path) -> ChaosReport:
    """Publish, SIGKILL and restart ``config.kills`` times, finish, SIGTERM, then check."""
    started = time.monotonic()
    names, corpus, messages, rng = await corpus_staged(stack, config, "chaos")
    batches = _split(messages, config.kills + 1, config.first_batch_share, rng)
    report = ChaosReport(
        objects=len(corpus.objects),
        supported=len(corpus.supported),
        bad_objects=len(corpus.bad_objects),
        bad_notifications=len(corpus.bad_notifications),
        messages=len(messages),
    )
    await anyio.Path(workdir).mkdir(parents=True, exist_ok=True)
    overrides = {"shutdown_deadline_s": str(config.shutdown_deadline_s)}

    def spawn(n: int) -> WorkerProcess:
        env = worker_environment(stack, names, worker_id=f"chaos-{n}", **overrides)
        report.processes += 1
        report.restarts = report.processes - 1
        return WorkerProcess(env, workdir / f"worker-{n:03d}.log").start()

    startup_kills = set(
        rng.sample(range(config.kills), round(config.kills * config.startup_kill_share))
    )
    async with GroupProgress(stack, names, config.partitions) as progress:
        for cycle in range(config.kills):
            with spawn(cycle) as worker:
                await progress.publish(batches[cycle])
                kill = await _kill_at_random_point(
                    worker, config, rng, progress, startup=cycle in startup_kills
                )
            _note_assignment(report, worker)
            report.kill_log.append(kill)
            report.kills += 1
            report.kills_by_phase[kill.phase] += 1
        with spawn(config.kills) as worker:
            await progress.publish(batches[config.kills])
            deadline = time.monotonic() + config.finish_timeout_s
            while await progress.backlog():
                if not worker.alive() or time.monotonic() > deadline:
                    raise AssertionError(
                        f"not finished: published {progress.published},"
                        f" committed {await progress.committed()}:\n{worker.log_tail()}"
                    )
                await anyio.sleep(0.1)
            stop = time.monotonic()
            worker.signal(signal.SIGTERM)
            report.final_exit_code = await worker.wait(config.shutdown_deadline_s + 10)
            report.final_exit_s = time.monotonic() - stop
        _note_assignment(report, worker)
    await check_consistency(stack, names, corpus, report)
    report.wall_s = time.monotonic() - started
    return report


def _note_assignment(report: ChaosReport, worker: WorkerProcess) -> None:
    seconds = worker.assigned_after_s()
    if seconds is not None:
        report.assignment_s.append(seconds)


async def _kill_at_random_point(
    worker: WorkerProcess,
    config: ChaosConfig,
    rng: random.Random,
    progress: GroupProgress,
    startup: bool,
) -> Kill:
    """SIGKILL during start-up, or after a random number of finished objects plus jitter.

    The phase it hit: "startup" (nothing finished yet), "working" (records
    outstanding) or "idle" (nothing left to do at that moment).
    """
    if startup:
        mode = "startup"
        await anyio.sleep(rng.uniform(0.05, 3.0))
    else:
        mode = f"after {rng.randint(1, config.max_processed_before_kill)}"
        target = int(mode.split()[1])
        deadline = time.monotonic() + config.cycle_timeout_s
        checked = 0.0
        while time.monotonic() < deadline and worker.alive():
            worker.poll_log()
            if worker.counts["processed"] + worker.counts["dead-lettered"] >= target:
                break
            if worker.counts["processed"] and time.monotonic() - checked > 0.2:
                checked = time.monotonic()
                if not await progress.backlog():
                    break  # nothing left until the next batch
            await anyio.sleep(0.01)
        await anyio.sleep(rng.uniform(0.0, config.kill_jitter_s))
    worker.poll_log()
    if not worker.alive():
        raise AssertionError(f"worker exited before its SIGKILL:\n{worker.log_tail()}")
    backlog = await progress.backlog()
    worker.kill()
    done = worker.counts["processed"] + worker.counts["dead-lettered"]
    phase = "startup" if not done else "working" if backlog else "idle"
    return Kill(worker.worker_id, mode, time.monotonic() - worker.started_at, done, phase)


# ---------------------------------------------------------------------------------------
# The consistency check


def _comparable(document: Mapping[str, Any]) -> str:
    """A result/sidecar document without what legitimately differs between two runs."""
    return json.dumps({k: v for k, v in document.items() if k != "timings"}, sort_keys=True)


async def _list_keys(s3: Any, bucket: str) -> list[str]:
    keys: list[str] = []
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys


async def _get_many(stack: Stack, bucket: str, keys: Sequence[str]) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    limiter = anyio.CapacityLimiter(16)
    async with harness.s3_client(stack) as s3:

        async def get(key: str) -> None:
            async with limiter:
                resp = await s3.get_object(Bucket=bucket, Key=key)
                async with resp["Body"] as body:
                    found[key] = await body.read()

        async with anyio.create_task_group() as group:
            for key in keys:
                group.start_soon(get, key)
    return found


async def check_consistency(
    stack: Stack, names: harness.Names, corpus: Corpus, report: ChaosReport
) -> ChaosReport:
    """Fill ``report``'s findings from the output bucket and the three topics."""
    stored = await _check_outputs(stack, names, corpus, report)
    _check_results(
        await harness.read_json_topic(stack, names.results_topic), stored, corpus, report
    )
    _check_dead_letters(await harness.read_json_topic(stack, names.dlq_topic), corpus, report)
    _check_audit(await harness.read_topic_raw(stack, names.audit_topic), corpus, report)
    return report


async def _check_outputs(
    stack: Stack, names: harness.Names, corpus: Corpus, report: ChaosReport
) -> dict[str, bytes]:
    """Exactly the expected keys; each ``.npy`` equal to the reference. Returns the sidecars."""
    prefix = f"out/{names.source_bucket}/"
    expected = {prefix + o.key + suffix for o in corpus.supported for suffix in (".npy", ".json")}
    async with harness.s3_client(stack) as s3:
        present = set(await _list_keys(s3, names.output_bucket))
    report.unexpected_outputs = sorted(present - expected)
    report.outputs_missing = sorted(expected - present)
    stored = await _get_many(stack, names.output_bucket, sorted(expected & present))

    def compare_arrays() -> list[str]:
        wrong = []
        for obj in corpus.supported:
            found = stored.get(prefix + obj.key + ".npy")
            assert obj.data is not None
            if found is not None and found != expected_npy(obj.data):
                wrong.append(obj.key)
        return wrong

    report.outputs_wrong = await anyio.to_thread.run_sync(compare_arrays)
    return {
        o.key: stored[prefix + o.key + ".json"]
        for o in corpus.supported
        if prefix + o.key + ".json" in stored
    }


def _check_results(
    documents: list[dict[str, Any]],
    sidecars: Mapping[str, bytes],
    corpus: Corpus,
    report: ChaosReport,
) -> None:
    """At least one result per supported object; copies (and the sidecar) agree."""
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for document in documents:
        results[document["source"]["key"]].append(document)
    report.result_events = len(documents)
    report.duplicate_result_events = len(documents) - len(results)
    supported = {o.key for o in corpus.supported}
    report.unexpected_results = sorted(set(results) - supported)
    for key in sorted(supported):
        copies = {_comparable(d) for d in results.get(key, [])}
        if not copies:
            report.results_missing.append(key)
        elif len(copies) > 1:
            report.distinct_duplicate_outputs.append(key)
        sidecar = sidecars.get(key)
        if sidecar is not None and _comparable(json.loads(sidecar)) not in copies:
            report.sidecars_wrong.append(key)


def _check_dead_letters(dlq: list[dict[str, Any]], corpus: Corpus, report: ChaosReport) -> None:
    """Each bad object and notification there with its reason; no supported object there."""
    report.dlq_records = len(dlq)
    report.dlq_by_reason = Counter(d["reason"] for d in dlq)
    by_key: dict[str, set[str]] = defaultdict(set)
    by_value: dict[str, set[str]] = defaultdict(set)
    for d in dlq:
        if d["key"] is None:
            by_value[d["record"]["value"]].add(d["reason"])
        else:
            by_key[d["key"]].add(d["reason"])
    for obj in corpus.objects:
        reasons = by_key.get(obj.key, set())
        if obj.expect == OK:
            if reasons:
                report.dlq_wrong.append(f"{obj.key}: supported but {sorted(reasons)}")
        elif obj.expect not in reasons:
            report.dlq_missing.append(f"{obj.key}: want {obj.expect}, got {sorted(reasons)}")
        elif reasons != {obj.expect}:
            report.dlq_wrong.append(f"{obj.key}: {sorted(reasons)}")
    for note in corpus.bad_notifications:
        reasons = by_value.get(note.decode(), set())
        if reasons != {BAD_NOTIFICATION}:
            report.dlq_missing.append(f"notification {note!r}: {sorted(reasons)}")


def _check_audit(messages: list[bytes], corpus: Corpus, report: ChaosReport) -> None:
    """Every record opens; every process's chain is gap-free; every object has its outcome."""
    opened = verify_trail(messages, keys={"local-1": harness.AUDIT_KEY})
    report.audit_undecryptable = sum(1 for f in opened.findings if "does not open" in f.detail)
    audit = object_records(opened.records)  # the records of objects and notifications
    report.audit_records = len(audit)
    chain = verify_chain(opened.records)  # a killed process's trail may end early: not a finding
    report.audit_trails = chain.trails
    report.audit_duplicates = chain.duplicates
    report.chain_problems = [
        f"{p.worker}/{p.trail} seq {p.seq}: {p.kind} {p.detail}" for p in chain.problems
    ]
    trails_per_worker = Counter(w for w, _t in {(r["worker"], r["trail"]) for r in audit})
    report.chain_problems += [
        f"{w}: {n} trails in one process" for w, n in trails_per_worker.items() if n > 1
    ]
    outcomes: dict[str, set[tuple[str, str | None]]] = defaultdict(set)
    for record in audit:
        outcomes[record["key"]].add((record["outcome"], record["reason"]))
    for obj in corpus.objects:
        want = ("success", None) if obj.expect == OK else ("failure", obj.expect)
        seen = outcomes.get(obj.key, set())
        if want not in seen:
            report.audit_missing.append(f"{obj.key}: want {want}")
        elif seen != {want}:
            report.audit_wrong.append(f"{obj.key}: {sorted(seen, key=str)}")
    notes = sum(1 for r in audit if r["event"] == "notification.dead_lettered")
    if notes < len(corpus.bad_notifications):
        report.audit_missing.append(
            f"{notes} notification records for {len(corpus.bad_notifications)}"
        )


@contextlib.contextmanager
def no_orphans() -> Iterator[None]:
    """Kill every worker started inside the block when it exits, however it exits."""
    try:
        yield
    finally:
        for process in list(LIVE):
            process.kill()
