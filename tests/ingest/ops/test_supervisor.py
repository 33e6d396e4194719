"""``dicom-ingest worker --processes N``: the supervisor's pure logic, its process handling
with stand-in children, and the real thing against the real broker and S3 server.

The integration tests run the real parent (``python -m ingest.cli worker --processes 2``)
with its children's JSON log lines in one file (each line carries its worker id), and
check everything the run left behind with ``tests.chaos.check_consistency``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from ingest.cli import device_decodes, device_environment, main
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack, create_topics
from ingest.errors import ConfigError
from ingest.logs import configure_logging
from ingest.ops.supervisor import (
    ChildSpec,
    Exit,
    RestartPolicy,
    Supervisor,
    auto_processes,
    child_environment,
    child_specs,
    classify_exit,
    describe_exit,
    parse_gpus,
    shares_gpu,
)
from ingest.settings import load_settings, setting_names
from tests import chaos, harness
from tests.chaos import (
    OK,
    REPO_ROOT,
    ChaosObject,
    ChaosReport,
    Corpus,
    GroupProgress,
    WorkerProcess,
    check_consistency,
    no_orphans,
    worker_environment,
)

PARTITIONS = 4
DEADLINE_S = 10.0


@pytest.fixture(autouse=True)
def logging_to_this_tests_stderr() -> Iterator[None]:
    """The supervisor logs in-process here; an earlier test's configuration may point
    structlog at a capture stream that is closed by now. Restored afterwards."""
    saved = structlog.get_config()
    configure_logging(json=True)
    yield
    structlog.configure(**saved)


# ---------------------------------------------------------------------------------------
# Pure logic


REQUIRED_ENV = {  # what load_settings needs besides what a test sets
    "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
    "DICOM_INGEST_OUTPUT_URL": "s3://out/prefix/",
    "DICOM_INGEST_AUDIT_KEY": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
}


def _settings(**extra: str) -> Any:
    env = dict(REQUIRED_ENV)
    env.update({f"DICOM_INGEST_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env)


GIB = 1 << 30


@pytest.mark.parametrize(
    ("cores", "gpus", "memory", "expected"),
    [
        (16, 0, 128 * GIB, 1),  # no GPU: one process; its decoding pool uses every core
        (16, 1, 128 * GIB, 8),  # two cores a process
        (64, 1, 512 * GIB, 8),  # at most eight on one GPU
        (64, 4, 512 * GIB, 32),
        (16, 1, 6 * GIB, 3),  # what memory holds: a 1 GiB ring + 1 GiB each
        (1, 1, 128 * GIB, 1),  # never none
    ],
)
def test_auto_processes_follows_cores_gpus_and_memory(
    cores: int, gpus: int, memory: int, expected: int
) -> None:
    assert auto_processes(cores, gpus, memory, ring_bytes=GIB) == expected


def test_child_environment_sets_id_port_and_gpu_round_robin() -> None:
    base = {"PATH": "/bin", "DICOM_INGEST_WORKER_ID": "parent", "CUDA_VISIBLE_DEVICES": "7"}
    envs = [child_environment(base, i, "host-1", 8080, ("0", "1")) for i in range(3)]
    assert [e["DICOM_INGEST_WORKER_ID"] for e in envs] == ["host-1-0", "host-1-1", "host-1-2"]
    assert [e["DICOM_INGEST_HEALTH_PORT"] for e in envs] == ["8080", "8081", "8082"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert all(e["PATH"] == "/bin" for e in envs)
    assert base["DICOM_INGEST_WORKER_ID"] == "parent"  # the parent's own mapping is untouched
    plain = child_environment({"X": "1"}, 1, "w", 0, ())
    assert plain == {"X": "1", "DICOM_INGEST_WORKER_ID": "w-1"}  # no port, no GPU: none set


def test_child_specs_from_settings(tmp_path: Path) -> None:
    settings = _settings(worker_id="ingest-a", health_port="9000")
    config = tmp_path / "worker.toml"
    specs = child_specs(settings, 2, ("3",), {"K": "v"}, config, 4242, python="/py")
    assert [(s.index, s.worker_id, s.gpu, s.health_port) for s in specs] == [
        (0, "ingest-a-0", "3", 9000),
        (1, "ingest-a-1", "3", 9001),
    ]
    argv = (
        "/py",
        "-m",
        "ingest.cli",
        "worker",
        "--parent-pid",
        "4242",
        "--config",
        str(config),
    )
    assert all(s.argv == argv for s in specs)
    assert specs[1].env["K"] == "v"
    default_id = _settings()  # hostname-PID of the parent
    assert child_specs(default_id, 1, (), {}, None, 1)[0].worker_id == default_id.worker_id + "-0"


def test_children_that_share_a_gpu_try_the_cuda_jpeg_decoder_first() -> None:
    key = "DICOM_INGEST_GPU_JPEG_DECODER"
    base = REQUIRED_ENV  # the parent's environment, which each child's settings are read from
    shared = child_specs(_settings(), 3, ("0", "1"), base, None, 1)  # two on GPU 0
    assert [s.env.get(key) for s in shared] == ["cuda"] * 3
    assert load_settings(shared[0].env).jpeg_decoder == "cuda"  # what the child reads
    assert [s.env.get(key) for s in child_specs(_settings(), 2, (), base, None, 1)] == [
        "cuda",
        "cuda",
    ]  # no --gpus: both on the visible ones
    alone = child_specs(_settings(), 2, ("0", "1"), base, None, 1)  # one a GPU
    assert [s.env.get(key) for s in alone] == [None, None]
    assert load_settings(alone[0].env).jpeg_decoder == "hardware"
    chosen = child_specs(_settings(gpu_jpeg_decoder="hardware"), 4, (), base, None, 1)
    assert [s.env.get(key) for s in chosen] == [None] * 4  # the operator's choice stands
    assert not shares_gpu(1, ())
    assert not shares_gpu(2, ("0", "1"))
    assert shares_gpu(2, ("0", "0"))


def test_child_specs_refuse_bad_counts_and_ports() -> None:
    with pytest.raises(ConfigError, match="HEALTH_PORT"):
        child_specs(_settings(health_port="65535"), 2, (), {}, None, 1)
    with pytest.raises(ConfigError, match="--processes"):
        child_specs(_settings(), 0, (), {}, None, 1)


def test_parse_gpus() -> None:
    assert parse_gpus("") == ()
    assert parse_gpus(" 0, 1 ") == ("0", "1")
    assert parse_gpus("GPU-5d2c") == ("GPU-5d2c",)
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus("0,,1")


def test_device_environment_takes_the_first_gpu_and_one_connection_unless_set() -> None:
    env: dict[str, str] = {}
    device_environment(("3", "5"), env, decodes=False)
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    chosen = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    device_environment((), chosen, decodes=False)  # no --gpus, the user's: both left alone
    assert chosen == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    decoding: dict[str, str] = {}
    device_environment(("2",), decoding, decodes=True)  # nvImageCodec's own streams
    assert decoding == {"CUDA_VISIBLE_DEVICES": "2"}


@pytest.mark.parametrize(
    ("device", "gpu_decode", "installed", "decodes"),
    [
        ("auto", "auto", True, True),
        ("cuda", "auto", True, True),
        ("cpu", "auto", True, False),
        ("cuda", "off", True, False),
        ("cuda", "auto", False, False),
    ],
)
def test_a_worker_that_may_decode_on_the_device_keeps_the_connections(
    monkeypatch: pytest.MonkeyPatch, device: str, gpu_decode: str, installed: bool, decodes: bool
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "nvidia.nvimgcodec":
            return real("json") if installed else None  # any spec stands for "installed"
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert device_decodes(_settings(device=device, gpu_decode=gpu_decode)) is decodes


def test_restart_backoff_is_capped_and_resets_after_a_stable_run() -> None:
    policy = RestartPolicy(first_s=0.5, cap_s=30.0, stable_s=60.0)
    failures, delays = 0, []
    for _ in range(9):
        failures = policy.failures_after(failures, ran_s=1.0)
        delays.append(policy.delay_s(failures))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.failures_after(failures, ran_s=60.0) == 1  # ran long enough: start over
    assert policy.delay_s(0) == 0.0
    assert policy.delay_s(10_000) == 30.0  # no float overflow


def test_classify_exit() -> None:
    assert classify_exit(1, stopping=False) is Exit.CRASHED
    assert classify_exit(-signal.SIGKILL, stopping=False) is Exit.CRASHED
    assert classify_exit(0, stopping=False) is Exit.ENDED
    assert classify_exit(2, stopping=False) is Exit.CONFIG
    for code in (0, -signal.SIGTERM, -signal.SIGINT, 130):
        assert classify_exit(code, stopping=True) is Exit.STOPPED
    assert classify_exit(-signal.SIGKILL, stopping=True) is Exit.FAILED_STOP
    assert classify_exit(1, stopping=True) is Exit.FAILED_STOP
    assert describe_exit(-signal.SIGKILL) == {"signal": "SIGKILL"}
    assert describe_exit(3) == {"code": 3}


def test_cli_refuses_bad_flags_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # logging set up against pytest's capture stream would outlive this test
    monkeypatch.setattr("ingest.cli.configure_logging", lambda **_: None)
    for name in setting_names():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DICOM_INGEST_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("DICOM_INGEST_OUTPUT_URL", "s3://out/")
    monkeypatch.setenv("DICOM_INGEST_AUDIT_KEY", "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=")
    monkeypatch.setenv("DICOM_INGEST_HEALTH_PORT", "65535")
    assert main(["worker", "--processes", "2"]) == 2
    assert "HEALTH_PORT" in capsys.readouterr().err
    assert main(["worker", "--processes", "2", "--gpus", "0,,1"]) == 2
    assert "--gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["worker", "--processes", "0"])


# ---------------------------------------------------------------------------------------
# Process handling, with small Python programs standing in for workers

# Exits 1 on its first two runs (counted in a file), then runs until SIGTERM and exits 0.
FLAKY = """
import pathlib, signal, sys, time
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text() or 0) + 1 if runs.exists() else 1
runs.write_text(str(n))
if n <= 2:
    sys.exit(1)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(sys.argv[1] + ".ready").touch()
while True:
    time.sleep(0.05)
"""
STEADY = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(sys.argv[1]).touch()
while True:
    time.sleep(0.05)
"""
STUBBORN = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).touch()
while True:
    time.sleep(0.05)
"""


def _stand_in(index: int, program: str, *args: str) -> ChildSpec:
    argv = (sys.executable, "-c", program, *args)
    return ChildSpec(index, f"w-{index}", argv, dict(os.environ))


async def _until(predicate: Any, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():  # the stand-ins signal through files
        assert time.monotonic() < deadline
        await anyio.sleep(0.02)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_crashed_child_restarted_then_all_stop_cleanly(tmp_path: Path) -> None:
    runs, steady = tmp_path / "runs", tmp_path / "steady"
    specs = [_stand_in(0, FLAKY, str(runs)), _stand_in(1, STEADY, str(steady))]
    supervisor = Supervisor(specs, stop_timeout_s=10.0, policy=RestartPolicy(first_s=0.01))
    async with anyio.create_task_group() as group:
        status: list[int] = []

        async def run() -> None:
            status.append(await supervisor.run())

        group.start_soon(run)
        await _until(lambda: Path(f"{runs}.ready").exists() and steady.exists())
        assert supervisor.restarts == {0: 2, 1: 0}
        assert set(supervisor.pids()) == {0, 1}
        supervisor.stop()
    assert status == [0]
    assert runs.read_text() == "3"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_configuration_error_in_a_child_stops_the_rest(tmp_path: Path) -> None:
    steady = tmp_path / "steady"
    specs = [_stand_in(0, "import sys; sys.exit(2)"), _stand_in(1, STEADY, str(steady))]
    supervisor = Supervisor(specs, stop_timeout_s=10.0)
    with anyio.fail_after(20):
        assert await supervisor.run() == 2
    assert supervisor.restarts == {0: 0, 1: 0}


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor([_stand_in(0, STUBBORN, str(ready))], stop_timeout_s=0.3)
    async with anyio.create_task_group() as group:
        status: list[int] = []

        async def run() -> None:
            status.append(await supervisor.run())

        group.start_soon(run)
        await _until(ready.exists)
        supervisor.stop()
    assert status == [1]


# ---------------------------------------------------------------------------------------
# The real supervisor on the real stack


class SupervisorProcess(WorkerProcess):
    """``python -m ingest.cli worker --processes N``, its and its children's log in one file."""

    def __init__(self, env: dict[str, str], log_path: Path, processes: int) -> None:
        super().__init__(env, log_path)
        self.processes = processes

    def start(self) -> SupervisorProcess:
        argv = [sys.executable, "-m", "ingest.cli", "worker", "--processes", str(self.processes)]
        with self.log_path.open("ab") as out:
            self._log_offset = out.tell()
            self.started_at = time.monotonic()
            self.spawned_wall = time.time()
            self._popen = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group
                preexec_fn=chaos.die_with_parent,  # its children die with it in turn
            )
        chaos.LIVE.add(self)
        return self

    def kill(self) -> None:
        """The whole process group (the children share the parent's), then reap."""
        if self._popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait()
        chaos.LIVE.discard(self)

    def lines(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                fields = json.loads(line)
                if isinstance(fields, dict):
                    found.append(fields)
        return found

    def processed_by(self) -> Counter[str]:
        return Counter(str(f.get("worker")) for f in self.lines() if f.get("event") == "processed")

    def children_started(self) -> list[dict[str, Any]]:
        return [f for _, f in self.events if f["event"] == "child started"]

    def everyone_assigned(self) -> bool:
        """Each child's latest assignment is non-empty and together they cover the topic."""
        latest: dict[str, list[int]] = {}
        for _, f in self.events:
            if f["event"] == "partitions assigned":
                latest[f["worker"]] = f["partitions"]
        together = sorted(p for partitions in latest.values() for p in partitions)
        return len(latest) == self.processes and together == list(range(PARTITIONS))


def _corpus(count: int) -> Corpus:
    slices = synthetic_ct_series(count, rows=256, columns=256, seed=11)
    return Corpus(tuple(ChaosObject(f"ct/{key}", data, OK) for key, data in slices), ())


async def _setup(stack: Stack, corpus: Corpus) -> harness.Names:
    names = harness.make_names(f"sup{uuid.uuid4().hex[:8]}")
    stack.s3.create_bucket(names.source_bucket)
    stack.s3.create_bucket(names.output_bucket)
    create_topics(stack.kafka.bootstrap, [names.source_topic], partitions=PARTITIONS)
    create_topics(stack.kafka.bootstrap, [names.results_topic, names.dlq_topic, names.audit_topic])
    await harness.upload(
        stack, names.source_bucket, [(o.key, o.data or b"") for o in corpus.objects]
    )
    return names


async def _publish_round_robin(progress: GroupProgress, messages: list[bytes]) -> None:
    """Spread over every partition, so that both children get work whatever they are assigned."""
    await progress.publish(messages, round_robin=True)


async def _until_committed(
    progress: GroupProgress, parent: SupervisorProcess, within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while await progress.backlog():
        parent.poll_log()
        assert parent.alive(), parent.log_tail()
        assert time.monotonic() < deadline, (
            f"backlog {await progress.backlog()}\n{parent.log_tail()}"
        )
        await anyio.sleep(0.2)


async def _sigterm(parent: SupervisorProcess) -> int | None:
    parent.signal(signal.SIGTERM)
    return await parent.wait(DEADLINE_S + 15)


def _supervisor(stack: Stack, names: harness.Names, tmp_path: Path) -> SupervisorProcess:
    env = worker_environment(stack, names, worker_id="sup", shutdown_deadline_s=str(DEADLINE_S))
    return SupervisorProcess(env, tmp_path / "supervisor.log", processes=2)


def _after_stop_checks(parent: SupervisorProcess, code: int | None) -> None:
    assert code == 0, parent.log_tail()
    lines = parent.lines()
    stopped = [f for f in lines if f.get("event") == "child stopped"]
    assert sorted((f["child"], f["code"]) for f in stopped) == [(0, 0), (1, 0)], parent.log_tail()
    drained = [f for f in lines if f.get("event") == "worker stopped"]
    assert sorted(f["worker"] for f in drained[-2:]) == ["sup-0", "sup-1"], parent.log_tail()
    for stats in drained[-2:]:  # everything it took, it finished before exiting
        assert stats["processed"] == stats["objects"], stats
        assert stats["dead_lettered"] == 0, stats
    assert [f["status"] for f in lines if f.get("event") == "supervisor stopped"] == [0]


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_two_processes_share_the_group_and_drain_on_sigterm(
    stack: Stack, tmp_path: Path
) -> None:
    corpus = _corpus(24)
    names = await _setup(stack, corpus)
    messages = [harness.aws_notification(names.source_bucket, [o.key]) for o in corpus.objects]
    report = ChaosReport()
    with no_orphans():
        async with GroupProgress(stack, names, PARTITIONS) as progress:
            with _supervisor(stack, names, tmp_path) as parent:
                assigned = await parent.wait_until(SupervisorProcess.everyone_assigned, 60)
                assert assigned is not None, parent.log_tail()
                await _publish_round_robin(progress, messages)
                await _until_committed(progress, parent, within_s=60)
                by_worker = parent.processed_by()
                report.final_exit_code = await _sigterm(parent)
    _after_stop_checks(parent, report.final_exit_code)
    assert set(by_worker) == {"sup-0", "sup-1"}, by_worker  # both took part
    await check_consistency(stack, names, corpus, report)
    assert report.problems() == [], report.format()
    assert report.audit_trails == 2


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_killed_child_is_restarted_and_nothing_is_lost(stack: Stack, tmp_path: Path) -> None:
    corpus = _corpus(60)
    names = await _setup(stack, corpus)
    messages = [harness.aws_notification(names.source_bucket, [o.key]) for o in corpus.objects]
    report = ChaosReport()
    with no_orphans():
        async with GroupProgress(stack, names, PARTITIONS) as progress:
            with _supervisor(stack, names, tmp_path) as parent:
                assigned = await parent.wait_until(SupervisorProcess.everyone_assigned, 60)
                assert assigned is not None, parent.log_tail()
                await _publish_round_robin(progress, messages[:20])
                await _until_committed(progress, parent, within_s=60)
                await _publish_round_robin(progress, messages[20:])
                assert await parent.wait_until(
                    lambda p: p.counts["processed"] >= 25, within_s=30
                ), parent.log_tail()
                victim = next(f for f in parent.children_started() if f["child"] == 0)
                os.kill(victim["pid"], signal.SIGKILL)  # mid-run: 35 objects still published
                assert await parent.wait_until(
                    lambda p: len(p.children_started()) >= 3, within_s=30
                ), parent.log_tail()
                await _until_committed(progress, parent, within_s=60)
                report.final_exit_code = await _sigterm(parent)
    _after_stop_checks(parent, report.final_exit_code)
    died = parent.last("child died; restarting")
    assert died is not None
    assert (died["child"], died["signal"], died["pid"]) == (0, "SIGKILL", victim["pid"])
    restarted = parent.children_started()[-1]
    assert (restarted["child"], restarted["restarts"], restarted["worker"]) == (0, 1, "sup-0")
    assert restarted["pid"] != victim["pid"]
    await check_consistency(stack, names, corpus, report)
    # The restarted child keeps its worker id (a stable identity) and starts a new trail.
    assert "sup-0: 2 trails in one process" in report.chain_problems
    report.chain_problems.remove("sup-0: 2 trails in one process")
    assert report.problems() == [], report.format()
    assert report.audit_trails == 3
