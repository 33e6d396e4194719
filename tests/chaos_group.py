"""Chaos for a consumer group of many processes: ``dicom-ingest worker --processes N``.

The worker runs as users start it (the supervisor and its children, one
consumer group) on a broker whose log survives a kill, while the objects of
``tests/chaos.py``'s corpus are published in batches and, between batches:

- a child is SIGKILLed (the supervisor restarts it: a rebalance each time);
- the supervisor itself is SIGKILLed (its children get SIGTERM, drain and
  exit) and a new one is started, as a container runtime would;
- an extra worker process joins the group and later leaves it (SIGTERM), as
  KEDA scaling out and in does;
- the broker is killed and restarted on the same port and storage.

A consumer of the results and dead-letter topics reads them live from their
end at the start, as a user's downstream service would. At the end the
supervisor gets SIGTERM and must exit 0, and ``check_consistency`` checks the
outputs, the topics read from the start and the audit trail; the live view
must have seen every record the read from the start found.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition

from ingest.embedded.stack import Stack
from tests import harness
from tests.chaos import (
    ChaosReport,
    GroupProgress,
    WorkerProcess,
    check_consistency,
    corpus_staged,
    worker_environment,
)

KILL_CHILD, KILL_SUPERVISOR, RESTART_BROKER, SCALE_OUT, SCALE_IN = (
    "kill child",
    "kill supervisor",
    "restart broker",
    "scale out",
    "scale in",
)


@dataclass(frozen=True, slots=True)
class GroupChaosConfig:
    seed: int = 0
    ct_slices: int = 300
    multiframes: int = 8
    not_dicom_objects: int = 3
    truncated: int = 3
    missing: int = 2
    bad_notifications: int = 2
    partitions: int = 8
    processes: int = 3
    child_kills: int = 6
    supervisor_kills: int = 1
    broker_restarts: int = 1
    scale_outs: int = 1
    events_between_batches: int = 2
    progress_between_events: int = 10  # objects finished before the next event
    event_timeout_s: float = 30.0
    finish_timeout_s: float = 240.0
    live_catch_up_s: float = 30.0
    shutdown_deadline_s: float = 10.0
    device: str = "cpu"  # DICOM_INGEST_DEVICE of every worker: "auto" on a GPU machine


FULL = GroupChaosConfig(
    seed=20261127,
    ct_slices=4000,
    multiframes=40,
    not_dicom_objects=8,
    truncated=8,
    missing=4,
    bad_notifications=6,
    partitions=8,
    processes=8,
    child_kills=20,
    supervisor_kills=2,
    broker_restarts=2,
    scale_outs=2,
    events_between_batches=1,
    progress_between_events=60,
    finish_timeout_s=900,
)
"""The long run: ``--processes 8``, 4,000+ objects in 8 partitions, 20 child SIGKILLs,
2 of the supervisor, 2 broker restarts, 2 workers joining and leaving."""


@dataclass(slots=True)
class GroupChaosReport:
    """What happened, and ``ChaosReport``'s findings from the read from the start."""

    events: Counter[str] = field(default_factory=Counter)
    event_log: list[str] = field(default_factory=list)
    supervisors: int = 0
    live_results: int = 0
    live_dead_letters: int = 0
    unseen_results: list[str] = field(default_factory=list)
    unseen_dead_letters: list[str] = field(default_factory=list)
    both_result_and_dead_letter: list[str] = field(default_factory=list)
    backends: Counter[str] = field(default_factory=Counter)  # result records by "backend"
    consistency: ChaosReport = field(default_factory=ChaosReport)
    wall_s: float = 0.0

    def problems(self) -> list[str]:
        found = self.consistency.problems()
        for name in ("unseen_results", "unseen_dead_letters", "both_result_and_dead_letter"):
            items = getattr(self, name)
            if items:
                found.append(f"{name}: {len(items)}: {items[:5]}")
        faults = sum(self.events[e] for e in (KILL_CHILD, KILL_SUPERVISOR, RESTART_BROKER))
        if not faults and self.consistency.duplicate_result_events:
            found.append(f"{self.consistency.duplicate_result_events} duplicates with no fault")
        return found

    def format(self) -> str:
        problems = self.problems()
        return "\n".join(
            [
                f"events {dict(self.events)}; supervisors started {self.supervisors};"
                f" wall {self.wall_s:.1f} s; results by backend {dict(self.backends)}",
                f"live view: {self.live_results} result records,"
                f" {self.live_dead_letters} dead letters; unseen results"
                f" {len(self.unseen_results)}, unseen dead letters"
                f" {len(self.unseen_dead_letters)}",
                self.consistency.format(),
                "GROUP CONSISTENT"
                if not problems
                else "GROUP PROBLEMS:\n  " + "\n  ".join(problems),
            ]
        )


class LiveView:
    """Results and dead letters as a downstream consumer sees them: from the end, live.

    Counts every record by object key (dead letters of malformed notifications
    by their raw value). aiokafka reconnects by itself across broker restarts.
    """

    def __init__(self, bootstrap: str, results_topic: str, dlq_topic: str) -> None:
        self.results: Counter[str] = Counter()
        self.dead_letters: Counter[str] = Counter()
        self._topics = {results_topic: self.results, dlq_topic: self.dead_letters}
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50
        )
        self.ready = anyio.Event()

    async def run(self) -> None:
        await self._consumer.start()
        try:
            await self._consumer.topics()
            parts = [
                TopicPartition(topic, p)
                for topic in self._topics
                for p in sorted(self._consumer.partitions_for_topic(topic) or {0})
            ]
            self._consumer.assign(parts)
            await self._consumer.seek_to_end(*parts)
            for tp in parts:
                await self._consumer.position(tp)  # resolved now, before anything is written
            self.ready.set()
            while True:
                for tp, records in (await self._consumer.getmany(timeout_ms=200)).items():
                    into = self._topics[tp.topic]
                    for record in records:
                        into[_document_key(json.loads(record.value or b"{}"))] += 1
        finally:
            await self._consumer.stop()


def _document_key(document: dict[str, Any]) -> str:
    """A result's or dead letter's object key; a malformed notification's raw value."""
    key = document.get("key") or (document.get("source") or {}).get("key")
    return str(key) if key is not None else "record:" + str(document["record"]["value"])


class Group:
    """The supervisor (restarted when killed), its children, extra workers and the broker."""

    def __init__(
        self, stack: Stack, env: dict[str, str], workdir: Path, config: GroupChaosConfig
    ) -> None:
        self.stack, self.env, self.workdir, self.config = stack, env, workdir, config
        self.supervisor: WorkerProcess | None = None
        self.extras: list[WorkerProcess] = []
        self.started = 0
        self.finished_before = 0  # objects finished by supervisors no longer followed

    def start_supervisor(self) -> WorkerProcess:
        self.started += 1
        env = dict(self.env, DICOM_INGEST_WORKER_ID=f"group-s{self.started}")
        log = self.workdir / f"supervisor-{self.started:02d}.log"
        args = ("--processes", str(self.config.processes))
        self.supervisor = WorkerProcess(env, log, args).start()
        return self.supervisor

    def finished(self) -> int:
        """Objects processed or dead-lettered so far, by every supervisor's children."""
        now = 0
        if self.supervisor is not None:
            self.supervisor.poll_log()
            now = self.supervisor.counts["processed"] + self.supervisor.counts["dead-lettered"]
        return self.finished_before + now

    def children(self) -> list[int]:
        """Pids of the current supervisor's children that are alive now."""
        if self.supervisor is None:
            return []
        self.supervisor.poll_log()
        latest: dict[int, int] = {}
        for _, fields in self.supervisor.events:
            if fields["event"] == "child started":
                latest[int(fields["child"])] = int(fields["pid"])
        alive = []
        for pid in latest.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                alive.append(pid)
        return alive

    async def kill_child(self, rng: random.Random) -> str:
        deadline = time.monotonic() + self.config.event_timeout_s
        while not (pids := self.children()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no child to kill:\n{self.tail()}")
            await anyio.sleep(0.05)
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        return f"{KILL_CHILD} {pid}"

    async def kill_supervisor(self) -> str:
        assert self.supervisor is not None
        self.finished_before = self.finished()
        pids = self.children()
        self.supervisor.kill()  # its children get SIGTERM from the kernel, drain and exit
        self.start_supervisor()
        return f"{KILL_SUPERVISOR} (children {pids}); started supervisor {self.started}"

    async def restart_broker(self) -> str:
        await anyio.to_thread.run_sync(self.stack.kafka.restart)
        return RESTART_BROKER

    async def scale_out(self) -> str:
        n = len(self.extras)
        env = dict(self.env, DICOM_INGEST_WORKER_ID=f"group-extra-{n}")
        extra = WorkerProcess(env, self.workdir / f"extra-{n:02d}.log").start()
        self.extras.append(extra)
        joined = await extra.wait_for_partitions(self.config.event_timeout_s)
        return f"{SCALE_OUT}: extra-{n}, partitions after {joined} s"

    async def scale_in(self) -> str:
        extra = next((e for e in self.extras if e.alive()), None)
        if extra is None:
            return f"{SCALE_IN}: none running"
        extra.signal(signal.SIGTERM)
        code = await extra.wait(self.config.shutdown_deadline_s + 30)
        # SIGTERM before the handler is installed ends the process by the signal; it
        # had taken nothing yet (the supervisor counts that as a clean stop too)
        if code != 0 and not (code == -signal.SIGTERM and not extra.counts["worker started"]):
            raise AssertionError(f"extra worker exited {code}:\n{extra.log_tail()}")
        return f"{SCALE_IN}: {extra.worker_id}"

    def tail(self) -> str:
        return self.supervisor.log_tail() if self.supervisor else "(no supervisor)"

    def kill_everything(self) -> None:
        for process in [*self.extras, self.supervisor]:
            if process is not None:
                process.kill()


def _plan(config: GroupChaosConfig, rng: random.Random) -> list[str]:
    """The events in a random order; each scale-out has its scale-in somewhere after it."""
    events = (
        [KILL_CHILD] * config.child_kills
        + [KILL_SUPERVISOR] * config.supervisor_kills
        + [RESTART_BROKER] * config.broker_restarts
        + [SCALE_OUT] * config.scale_outs
    )
    rng.shuffle(events)
    for at in reversed([i for i, e in enumerate(events) if e == SCALE_OUT]):
        events.insert(rng.randint(at + 1, len(events)), SCALE_IN)
    return events


async def run_group_chaos(
    stack: Stack, config: GroupChaosConfig, workdir: Path
) -> GroupChaosReport:
    """Publish while the events of ``_plan`` happen; finish, SIGTERM, then check."""
    started = time.monotonic()
    names, corpus, messages, rng = await corpus_staged(stack, config, "group")
    events = _plan(config, rng)
    per = max(1, config.events_between_batches)
    batches = max(1, -(-len(events) // per))
    size = -(-len(messages) // batches)
    await anyio.Path(workdir).mkdir(parents=True, exist_ok=True)
    env = worker_environment(
        stack, names, shutdown_deadline_s=str(config.shutdown_deadline_s), device=config.device
    )
    report = GroupChaosReport()
    report.consistency = ChaosReport(
        objects=len(corpus.objects),
        supported=len(corpus.supported),
        bad_objects=len(corpus.bad_objects),
        bad_notifications=len(corpus.bad_notifications),
        messages=len(messages),
        kills=config.child_kills + config.supervisor_kills,
    )
    live = LiveView(stack.kafka.bootstrap, names.results_topic, names.dlq_topic)
    group = Group(stack, env, workdir, config)
    try:
        async with (
            anyio.create_task_group() as tasks,
            GroupProgress(stack, names, config.partitions) as progress,
        ):
            tasks.start_soon(live.run)
            with anyio.fail_after(30):
                await live.ready.wait()
            group.start_supervisor()
            for index in range(batches):
                await progress.publish(messages[index * size : (index + 1) * size])
                for event in events[index * per : (index + 1) * per]:
                    await _wait_for_progress(group, progress, config)
                    done = await _do(group, event, rng)
                    report.events[event] += 1
                    report.event_log.append(f"{time.monotonic() - started:7.1f} s {done}")
            await _finish(group, progress, config)
            await _wait_until_seen(live, stack, names, config)
            supervisor = group.supervisor
            assert supervisor is not None
            supervisor.signal(signal.SIGTERM)
            code = await supervisor.wait(config.shutdown_deadline_s + 40)
            report.consistency.final_exit_code = code
            tasks.cancel_scope.cancel()
    finally:
        group.kill_everything()
    report.supervisors = group.started
    await check_consistency(stack, names, corpus, report.consistency)
    # A restarted child keeps its worker id and starts a trail of its own: several
    # trails under one id are expected here (each trail's own chain is still checked).
    report.consistency.chain_problems = [
        p for p in report.consistency.chain_problems if not p.endswith("trails in one process")
    ]
    await _compare_live(live, stack, names, report)
    report.wall_s = time.monotonic() - started
    return report


async def _wait_for_progress(
    group: Group, progress: GroupProgress, config: GroupChaosConfig
) -> None:
    """Let the group finish a few more objects, so events land on work in flight; not
    past the point where every record published so far is committed (there is no more
    work to wait for until the next batch: the event comes at once)."""
    target = group.finished() + config.progress_between_events
    deadline = time.monotonic() + config.event_timeout_s
    looked = time.monotonic()
    # following a log file another process writes: there is no event to wait on
    while group.finished() < target and time.monotonic() < deadline:
        await anyio.sleep(0.05)
        if time.monotonic() - looked >= 0.5:
            looked = time.monotonic()
            with contextlib.suppress(Exception):  # the broker may be restarting
                if not await progress.backlog():
                    return


async def _do(group: Group, event: str, rng: random.Random) -> str:
    if event == KILL_CHILD:
        return await group.kill_child(rng)
    if event == KILL_SUPERVISOR:
        return await group.kill_supervisor()
    if event == RESTART_BROKER:
        return await group.restart_broker()
    if event == SCALE_OUT:
        return await group.scale_out()
    return await group.scale_in()


async def _finish(group: Group, progress: GroupProgress, config: GroupChaosConfig) -> None:
    deadline = time.monotonic() + config.finish_timeout_s
    while True:
        with contextlib.suppress(Exception):  # the broker may still be coming back
            if not await progress.backlog():
                return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not finished: published {progress.published},"
                f" committed {await progress.committed()}:\n{group.tail()}"
            )
        await anyio.sleep(0.2)


async def _wait_until_seen(
    live: LiveView, stack: Stack, names: harness.Names, config: GroupChaosConfig
) -> None:
    """Give the live view time to read what the topics hold (it may lag, not miss)."""
    results = await harness.read_json_topic(stack, names.results_topic)
    dead = await harness.read_json_topic(stack, names.dlq_topic)
    deadline = time.monotonic() + config.live_catch_up_s
    while time.monotonic() < deadline:
        if sum(live.results.values()) >= len(results) and sum(live.dead_letters.values()) >= len(
            dead
        ):
            return
        await anyio.sleep(0.1)


async def _compare_live(
    live: LiveView, stack: Stack, names: harness.Names, report: GroupChaosReport
) -> None:
    documents = await harness.read_json_topic(stack, names.results_topic)
    report.backends = Counter(str(d.get("backend")) for d in documents)
    results = {_document_key(d) for d in documents}
    dead = {_document_key(d) for d in await harness.read_json_topic(stack, names.dlq_topic)}
    report.live_results = sum(live.results.values())
    report.live_dead_letters = sum(live.dead_letters.values())
    report.unseen_results = sorted(results - set(live.results))
    report.unseen_dead_letters = sorted(dead - set(live.dead_letters))
    report.both_result_and_dead_letter = sorted(results & dead)
