"""Start-up as a user sees it: ``dicom-ingest worker`` on the embedded stack, to the first result.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.startup [--runs N] [--same-group]
        [--set NAME=VALUE ...] [--json PATH] [--logs DIR]

It starts the embedded stack and prepares it as ``dicom-ingest stack`` does
(same buckets, topics and printed environment), uploads one small object
(pydicom's ``CT_small.dcm``, 39 KB) per run, then for each run starts
``dicom-ingest worker`` as a subprocess whose environment is the user's, less
any ``DICOM_INGEST_*``, plus what ``stack`` prints, publishes the object's
notification right after the spawn, and reports seconds from the spawn to:

- ``started``: the worker's log line "worker started": the interpreter, the imports,
  the device thread, the ring and the clients (the group join goes on meanwhile);
- ``joined``: its first non-empty "partitions assigned": the end of the group join;
- ``result``: the result record's timestamp on the results topic (set by the
  worker's producer when it sent it; the record is found by the object's key).

Each run is a new group on a new source topic of its own (``startup-TOKEN-I``,
4 partitions as ``stack`` makes them): a first start. With ``--same-group``
every run uses the stack's own group and topic, so runs after the first are
restarts of a worker stopped with SIGTERM a moment before. ``--set
SESSION_TIMEOUT_MS=30000 --set HEARTBEAT_INTERVAL_MS=3000`` gives the worker
the production defaults again (``NAME`` without the ``DICOM_INGEST_`` prefix).
To time an older commit: copy this file and ``ingest/embedded/stack_cli.py`` into
a worktree of it and run it from outside the repository with
``PYTHONPATH=WORKTREE`` (the worker inherits it). docs/benchmarks.md, "Start-up",
has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ingest.embedded.samples import example_bytes
from ingest.embedded.stack import Stack, _s3_client, create_topics, embedded_stack
from ingest.embedded.stack_cli import SOURCE_BUCKET, TOPICS, prepare_stack
from ingest.settings import PREFIX

RESULTS_TOPIC = "dicom-ingest.results"  # the worker's default, which ``stack`` creates
RESULT_WITHIN_S = 120.0
STOP_WITHIN_S = 40.0


@dataclass(frozen=True, slots=True)
class RunFigures:
    """Seconds from the worker's spawn; None where the log did not say."""

    started: float | None
    joined: float | None
    result: float
    exit_code: int | None


def worker_command() -> list[str]:
    """``dicom-ingest worker``, the console script of this environment where there is one."""
    script = Path(sys.executable).parent / "dicom-ingest"
    if script.is_file():
        return [str(script), "worker"]
    found = shutil.which("dicom-ingest")
    return [found, "worker"] if found else [sys.executable, "-m", "ingest.cli", "worker"]


def notification(bucket: str, key: str) -> bytes:
    record = {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": "ObjectCreated:Put",
        "s3": {"bucket": {"name": bucket}, "object": {"key": key}},
    }
    return json.dumps({"Records": [record]}).encode()


def log_times(log: Path, spawned: float) -> tuple[float | None, float | None]:
    """Seconds from ``spawned`` (epoch) to "worker started" and to the first assignment."""
    started = joined = None
    for line in log.read_text(errors="replace").splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if not isinstance(fields, dict) or "timestamp" not in fields:
            continue
        at = datetime.fromisoformat(fields["timestamp"].replace("Z", "+00:00")).timestamp()
        if fields.get("event") == "worker started" and started is None:
            started = at - spawned
        if fields.get("event") == "partitions assigned" and fields.get("partitions"):
            joined = at - spawned if joined is None else joined
    return started, joined


async def result_reader(bootstrap: str) -> AIOKafkaConsumer:
    """A group-less reader of the results topic, positioned at its end."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    partitions = consumer.partitions_for_topic(RESULTS_TOPIC) or {0}
    assigned = [TopicPartition(RESULTS_TOPIC, p) for p in partitions]
    consumer.assign(assigned)
    await consumer.seek_to_end(*assigned)
    for tp in assigned:
        await consumer.position(tp)  # resolve the end now, before the worker writes
    return consumer


async def wait_for_result(reader: AIOKafkaConsumer, key: str) -> float:
    """The epoch seconds of the result record for ``key`` (its producer's timestamp)."""
    with anyio.fail_after(RESULT_WITHIN_S):
        while True:
            batches = await reader.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    if json.loads(record.value)["source"]["key"] == key:
                        return float(record.timestamp) / 1000.0


async def one_run(
    env: dict[str, str], bootstrap: str, topic: str, key: str, log: Path
) -> RunFigures:
    reader = await result_reader(bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        with log.open("wb") as out:
            spawned = time.time()
            process = await anyio.open_process(
                worker_command(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        async with process:
            try:
                await producer.send_and_wait(topic, notification(SOURCE_BUCKET, key))
                result = await wait_for_result(reader, key) - spawned
                process.send_signal(signal.SIGTERM)
                code: int | None = None
                with anyio.move_on_after(STOP_WITHIN_S):
                    code = await process.wait()
            finally:
                if process.returncode is None:
                    process.kill()
                    with anyio.CancelScope(shield=True):
                        await process.wait()
    finally:
        await producer.stop()
        await reader.stop()
    started, joined = log_times(log, spawned)
    return RunFigures(started, joined, result, code)


def _parse_set(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected NAME=VALUE")
        out[PREFIX + name.strip().upper().removeprefix(PREFIX)] = value
    return out


def _stats(values: list[float | None]) -> str:
    seen = [v for v in values if v is not None]
    if not seen:
        return "-"
    return f"median {statistics.median(seen):6.2f}  min {min(seen):6.2f}  max {max(seen):6.2f}"


async def measure(stack: Stack, args: argparse.Namespace, workdir: Path) -> list[RunFigures]:
    stack_env = prepare_stack(stack)
    user_env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    overrides = _parse_set(args.set)
    token = uuid.uuid4().hex[:8]
    body = example_bytes("CT_small.dcm")
    s3 = _s3_client(stack.s3.endpoint_url, stack.s3.credentials)
    timing = {**stack_env, **overrides}
    print(
        f"worker: {' '.join(worker_command())}; session timeout "
        f"{timing.get(PREFIX + 'SESSION_TIMEOUT_MS', '30000 (default)')} ms, heartbeat "
        f"{timing.get(PREFIX + 'HEARTBEAT_INTERVAL_MS', '3000 (default)')} ms"
        f"{', one group for every run' if args.same_group else ', a new group each run'}"
    )
    figures = []
    try:
        for run in range(args.runs):
            key = f"startup/{token}-{run}/CT_small.dcm"
            s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=body)
            env = {**user_env, **stack_env, **overrides}
            topic = TOPICS[0]
            if not args.same_group:
                topic = f"startup-{token}-{run}"
                create_topics(stack.kafka.bootstrap, [topic], partitions=4)
                env |= {PREFIX + "SOURCE_TOPIC": topic, PREFIX + "GROUP_ID": topic}
            log = workdir / f"worker-{run}.log"
            got = await one_run(env, stack.kafka.bootstrap, topic, key, log)
            figures.append(got)
            print(
                f"run {run + 1}: started {_fmt(got.started)}  joined {_fmt(got.joined)}  "
                f"result {got.result:6.2f} s  (exit {got.exit_code})",
                flush=True,
            )
    finally:
        s3.close()
    print(f"started: {_stats([f.started for f in figures])}")
    print(f"joined:  {_stats([f.joined for f in figures])}")
    print(f"result:  {_stats([f.result for f in figures])}")
    return figures


def _fmt(value: float | None) -> str:
    return "     -" if value is None else f"{value:6.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ingest.bench.diagnostics.startup")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--same-group", action="store_true", help="restarts, not first starts")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--logs", type=Path, help="keep the workers' logs in this directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dicom-ingest-startup-") as tmp, embedded_stack() as s:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        figures = anyio.run(measure, s, args, logs, backend="asyncio")
    if args.json:
        report: dict[str, Any] = {
            "command": sys.argv,
            "settings": args.set,
            "same_group": args.same_group,
            "runs": [asdict(f) for f in figures],
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
