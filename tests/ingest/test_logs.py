"""The log set-up: one JSON record a line, each line in one write."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from ingest.cli import main
from ingest.embedded.stack import Stack
from ingest.logs import configure_logging


class WriteRecorder:
    """A stderr stand-in that keeps every ``write`` call apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.fixture
def recorder() -> Iterator[WriteRecorder]:
    """Swapped in by ``configure_into``, not here: pytest swaps its own capture
    stream into ``sys.stderr`` at the start of each test phase."""
    saved = structlog.get_config()
    stream = WriteRecorder()
    yield stream
    structlog.configure(**saved)


def configure_into(recorder: WriteRecorder, monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    monkeypatch.setattr("sys.stderr", recorder)
    configure_logging(json=True, level=level)


def test_each_record_is_one_write_of_one_whole_line(
    recorder: WriteRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Supervised children share the parent's stderr: a line written in two parts
    (message, then newline) can interleave with a sibling's line."""
    configure_into(recorder, monkeypatch, logging.INFO)
    log = structlog.get_logger()
    log.info("worker stopped", worker="sup-0", records=12)
    log.warning("retrying", attempt=2)
    assert len(recorder.writes) == 2
    for text in recorder.writes:
        assert text.endswith("\n")
        assert text.count("\n") == 1
    records = [json.loads(text) for text in recorder.writes]
    assert [r["event"] for r in records] == ["worker stopped", "retrying"]
    assert records[0]["worker"] == "sup-0"
    assert records[0]["level"] == "info"


def test_level_filters_below_it(recorder: WriteRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    configure_into(recorder, monkeypatch, logging.WARNING)
    log = structlog.get_logger()
    log.info("quiet")
    log.error("loud")
    assert [json.loads(t)["event"] for t in recorder.writes] == ["loud"]


def test_lines_follow_stderr_when_it_is_swapped_and_the_old_one_closed(
    recorder: WriteRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logger holding the stream of set-up would raise ValueError once that stream is
    closed (pytest closes each test's capture), in whatever task logs next."""
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_logging(json=True, level=logging.INFO)
    log = structlog.get_logger()
    log.info("before")
    first.close()
    monkeypatch.setattr("sys.stderr", recorder)
    log.warning("dependency unreachable", dependency="broker")
    assert [json.loads(text)["event"] for text in recorder.writes] == ["dependency unreachable"]


# A module's logger as the worker's modules hold theirs: made at import, used much later.
MODULE_LOG = structlog.get_logger("dicom_ingest.test_logs")


def test_a_command_run_through_main_logs_at_its_own_level(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``audit keygen`` configures logging at WARNING for its process; the module's logger,
    first used now, logs at that level. The next test must not inherit it."""
    monkeypatch.setattr("sys.stderr", sys.__stderr__)
    assert main(["audit", "keygen", "--keyring", str(tmp_path / "keyring.json")]) == 0
    capsys.readouterr()
    MODULE_LOG.info("quiet under the command's level")
    assert "quiet under" not in capsys.readouterr().out


def test_a_later_test_logs_as_configured_now_not_as_an_earlier_main_left_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Runs after the test above (file order): a logger cached with that test's
    configuration (``cache_logger_on_first_use``) stayed at WARNING and wrote to
    stderr for the rest of the session; structlog's default prints INFO to stdout."""
    MODULE_LOG.info("heard at the default level")
    assert "heard at the default level" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# One stream: every line a process writes to stderr is one JSON object

OUTAGE_ENV = {
    "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:1",  # nothing listens: a broker outage
    "DICOM_INGEST_OUTPUT_URL": "s3://out/",
    "DICOM_INGEST_AUDIT_KEY": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
    "DICOM_INGEST_LOG_FORMAT": "json",
    "DICOM_INGEST_WORKER_ID": "w-logs",
}


def json_lines(stderr: str) -> list[dict[str, object]]:
    """Every line of ``stderr`` as JSON; fails on the first line that is not."""
    records = []
    for line in stderr.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\n{stderr}")
    return records


def environment(extra: dict[str, str]) -> dict[str, str]:
    import os

    return {**{k: v for k, v in os.environ.items() if not k.startswith("DICOM_INGEST_")}, **extra}


def test_a_supervised_crash_loop_under_a_broker_outage_logs_json_only() -> None:
    """Children that cannot reach the broker exit 1 and are restarted; the supervisor's
    lines, aiokafka's and each child's last line are all JSON, with the same fields."""
    import signal
    import subprocess
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "worker", "--processes", "2"],
        env=environment(OUTAGE_ENV),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    deadline = time.monotonic() + 60
    assert process.stderr is not None
    for line in process.stderr:  # until a child has been restarted after its failure
        seen.append(line)
        if '"child started"' in line and '"restarts": 0' not in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=60)
    stderr = "".join(seen) + rest
    records = json_lines(stderr)
    loggers = {str(r.get("logger")) for r in records}
    assert {"aiokafka", "dicom_ingest.supervisor", "dicom_ingest.cli"} <= loggers, loggers
    assert any(r["event"] == "child died; restarting" for r in records)
    failed = [r for r in records if r["event"] == "worker failed"]
    assert failed
    assert all(str(r["error"]).startswith("consumer start (PLAINTEXT)") for r in failed)
    for r in records:
        assert r["service"] == "dicom-ingest", r
        assert r["version"]
        assert str(r["worker"]).startswith("w-logs"), r
        assert r["level"] in ("info", "warning", "error", "critical"), r


def test_an_uncaught_exception_and_a_warning_are_json_lines_with_the_traceback_as_a_field() -> None:
    import subprocess

    program = (
        "import logging, threading, warnings\n"
        "from ingest.logs import configure_logging, set_identity\n"
        "configure_logging(json=True)\n"
        "set_identity(worker='w-crash')\n"
        "logging.getLogger('botocore.hooks').warning('a library line')\n"
        "warnings.warn('a warning')\n"
        "t = threading.Thread(target=lambda: 1 / 0)\n"
        "t.start(); t.join()\n"
        "raise RuntimeError('a bug')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env=environment({}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    records = json_lines(done.stderr)
    assert records[0]["event"] == "a library line"
    assert [r["logger"] for r in records] == [
        "botocore.hooks",
        "py.warnings",
        "dicom_ingest.uncaught",
        "dicom_ingest.uncaught",
    ]
    thread, main_thread = records[2], records[3]
    assert "ZeroDivisionError" in str(thread["exception"])
    assert str(main_thread["exception"]).endswith("RuntimeError: a bug")
    assert {r["worker"] for r in records} == {"w-crash"}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_a_running_worker_logs_json_only_through_a_broker_outage(
    stack: Stack, tmp_path: Path
) -> None:
    """A worker in its group loses its broker (a private Tansu, stopped) and is stopped
    while it is gone: aiokafka's reconnects and errors, the readiness probe's warning and
    the worker's last line all come out as JSON lines with the worker's fields, and the
    reconnect loop's lines are thinned."""
    import os
    import signal
    import uuid

    import anyio

    from ingest.embedded.stack import create_topics, start_tansu
    from tests import harness
    from tests.chaos import WorkerProcess, no_orphans

    names = harness.make_names(f"lg{uuid.uuid4().hex[:8]}")
    stack.s3.create_bucket(names.source_bucket)
    stack.s3.create_bucket(names.output_bucket)
    with start_tansu(workdir=tmp_path) as broker:
        create_topics(broker.bootstrap, [names.source_topic])
        create_topics(broker.bootstrap, [names.results_topic, names.dlq_topic, names.audit_topic])
        env = {k: v for k, v in os.environ.items() if not k.startswith("DICOM_INGEST_")}
        env |= harness.worker_environment(stack, names, worker_id="w-outage")
        env |= {"DICOM_INGEST_KAFKA_BOOTSTRAP": broker.bootstrap, "PYTHONUNBUFFERED": "1"}
        with no_orphans(), WorkerProcess(env, tmp_path / "w.log") as worker:
            assert await worker.wait_for("worker started", within_s=60), worker.log_tail()
            assert await worker.wait_for_partitions(within_s=60) is not None, worker.log_tail()
            broker.stop()  # the outage
            await anyio.sleep(6.0)  # reconnects, failed heartbeats, the probe's 4 s timeout
            worker.signal(signal.SIGTERM)
            assert await worker.wait(within_s=90) is not None, worker.log_tail()
    records = json_lines((tmp_path / "w.log").read_text())  # every line, the last one too
    loggers = {str(r["logger"]) for r in records}
    assert any(name.startswith("aiokafka.") for name in loggers), loggers
    assert any(r["level"] == "error" and str(r["logger"]).startswith("aiokafka") for r in records)
    assert any(r["event"] == "dependency unreachable" for r in records)  # the probe saw it
    assert len(records) < 200  # aiokafka's reconnect loop thinned (it logs >1,000 lines/s)
    assert {r["worker"] for r in records} == {"w-outage"}
    assert {r["service"] for r in records} == {"dicom-ingest"}


def test_a_library_line_repeated_in_a_burst_is_thinned_and_counted(
    recorder: WriteRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka logs every failed reconnect (over a thousand lines a second while a broker
    is down): one line per template and window gets out, the next says how many were not;
    our own lines are never dropped."""
    import time

    configure_into(recorder, monkeypatch, logging.INFO)
    library = logging.getLogger("aiokafka")

    def reconnect_failed(node: int) -> None:  # one call site, as in aiokafka
        library.error("Unable connect to node with id %s: refused", node)

    for node in range(500):
        reconnect_failed(node)
    for _ in range(3):
        structlog.get_logger("dicom_ingest.test_logs").warning("ours, each time")
    monkeypatch.setattr("ingest.logs.REPEAT_WINDOW_S", 0.0)  # the window has passed
    time.sleep(0.01)
    reconnect_failed(7)
    lines = [json.loads(text) for text in recorder.writes]
    mine = [line for line in lines if line["logger"] == "aiokafka"]
    assert [line["event"] for line in mine] == [
        "Unable connect to node with id 0: refused",
        "Unable connect to node with id 7: refused",
    ]
    assert "repeated" not in mine[0]
    assert mine[1]["repeated"] == 499
    assert sum(line["event"] == "ours, each time" for line in lines) == 3
